"""The result tables of README.md and docs/results.md, made from the files under benchmarks/results/: a number in a
table is one of theirs.

  python -m benchmarks.results_tables            # prints every table
  python -m benchmarks.results_tables --write    # rewrites the tables in README.md and docs/results.md in place

Each table sits in its file (FILES says which) between `<!-- results: NAME -->` and `<!-- end results -->`;
tests/test_benchmarks.py checks that each file holds exactly its tables, as the result files give them now.
"""

import json
import os
import re
import statistics

from absl import app, flags

from benchmarks import trace_overlap
from benchmarks.common import REPO
from models.presets import build, get_config
from sljax.lora.engine import lora_flops_per_token
from sljax.lora.model import LoraConfig, LoraModel

RESULTS = os.path.join(REPO, "benchmarks", "results")

flags.DEFINE_bool("write", False, "Rewrite the tables in the files that hold them instead of printing them.")
FLAGS = flags.FLAGS

# What each row ran, in words the files do not hold (their numbers come from the files; {field}: the row's engine's).
TRAIN_THROUGHPUT_CASES = {
    "big_clip": "llama13b as `train.py --model=llama13b` builds it (batch 32 = 4 x 8, clip 1.0, bf16 first moment, "
                "{device_state_groups} of 40 groups' state on the GPU)",
    "big": "llama13b, batch 32, clipping off, fp32 moments ({device_state_groups} of 40 on the GPU)",
    "llama7b": "all 32 layers, the offload engine's plan (8 x 2048, everything on the GPU, clip 1.0, a tail of "
               "{tail_layers} layers)",
    "fits/device_remat": "llama7b shape, 8 layers, batch 16, the all-on-device jitted step with remat",
    "fits/device_no_remat": "the same without remat (fits: 16 x 2048 of 8 layers)",
    "fits/engine": "the engine, plan placement (everything on the GPU; 2 sub-batches of 8; all 8 layers one tail "
                   "group)",
}
TRAIN_PY_RUNS = {  # model: (its step, its batch); {device_state_groups}: from the run's printed plan
    "llama13b": ("offload engine, {device_state_groups} of 40 groups' state on the GPU", "32 x 2048 (the plan's)"),
    "llama7b": ("on-device (its state fits)", "8 x 2048"),
}
VS_DEEPSPEED = {  # table: (file, run, the sljax row's words)
    "vs_deepspeed_llama13b": ("vs_deepspeed_llama13b_h200.json", "llama13b", "plan placement"),
    "vs_deepspeed_fits": ("vs_deepspeed_fits_h200.json", "fits", "plan: everything on the device"),
}
GENERATE_VS_ACCELERATE = [("llama70b", "generate_llama70b_hf_accelerate_h200.json"),
                          ("opt-30b", "generate_opt-30b_hf_accelerate_h200.json")]
SCALING_ROWS = [  # (file, case, row label)
    ("train_scaling_h200x2.json", "one_gpu", "one GPU (FSDP run)"), ("train_scaling_h200x2.json", "fsdp", "fsdp:2"),
    ("train_scaling_dp_h200x2.json", "one_gpu", "one GPU (data-parallel run)"),
    ("train_scaling_dp_h200x2.json", "data_parallel", "data:2"),
]
SAVERS_QUALITY = [  # (file, variant, the saver's flag): benchmarks.int8_moments_quality runs, on CPU
    ("int8_moments_quality_cpu.json", "int8", "--moments_dtype=int8"),
    ("bf16_parked_grads_quality_cpu.json", "bf16_parked_grads", "--parked_grads_dtype=bfloat16"),
    ("int8_exchange_quality_cpu.json", "int8_exchange", "--int8_exchange"),
]
GENERATE_INT4_RUNS = {"bf16": "generate_llama70b_streamed_bf16_h200.json",  # streamed kernels: file
                      "int4": "generate_llama70b_streamed_int4_h200.json"}


def _load(name: str) -> dict:
  with open(os.path.join(RESULTS, name)) as f:
    return json.load(f)


def _percent(x) -> str:
  return "—" if x is None else f"{100 * x:.1f}%"


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
  return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|",
                    *("| " + " | ".join(row) + " |" for row in rows)])


def train_throughput() -> str:
  cases = {r["case"]: r for r in _load("train_throughput_h200.json")["results"]}
  rows = [[f"`{name}`: {words.format(**cases[name].get('engine', {}))}", f"{cases[name]['tokens_per_s']:,.0f}",
           _percent(cases[name]["mfu"]), _percent(cases[name]["hfu"]), f"{cases[name]['step_seconds']:.2f}",
           _percent(cases[name].get("gpu_busy_fraction")), _percent(_kernels_of_untraced_step(cases[name])),
           _percent(cases[name].get("ceiling_mfu_full_recompute"))]
          for name, words in TRAIN_THROUGHPUT_CASES.items()]
  return _table(["case", "tokens/s", "MFU", "HFU", "step (s)", "GPU busy (traced step)",
                 "its kernels / untraced step", "full-recompute ceiling"],
                ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], rows)


def _kernels_of_untraced_step(case: dict):
  """benchmarks.trace_overlap.kernel_share of the case's traced step over its untraced one, from the recorded
  fields (rows older than untraced_busy_fraction have them too); None without a GPU trace."""
  trace = case.get("trace", {})
  return trace_overlap.kernel_share(trace, case["step_seconds"]) if "busy_s" in trace else None


def train_py() -> str:
  rows = []
  for model, (step, batch) in TRAIN_PY_RUNS.items():
    run = _load(f"train_py_{model}_default_h200.json")
    losses = run["losses"]
    loss = (f"{losses[0]:.2f}, {max(losses[1:]):.2f}, {statistics.mean(losses[:10]):.2f} / "
            f"{statistics.mean(losses[-10:]):.2f}")
    kept = re.search(r"(\d+) group\(s\) keep master weights", run["plan"] or "")
    step = step.format(device_state_groups=kept and kept[1])
    rows.append([f"`--model={model}`", step, batch, f"{run['tokens_per_s_steady']:,.0f}",
                 _percent(run["mfu_steady"]), loss])
  return _table(["command", "step", "batch", "steady tokens/s", "MFU",
                 "loss: first, highest after it, mean of first / last 10"],
                ["---", "---", "---", "---:", "---:", "---"], rows)


def generate_int4() -> str:
  rows = []
  for kernels, name in GENERATE_INT4_RUNS.items():
    (run,) = _load(name)["results"]
    layers, offload = run["config"]["model"]["num_layers"], run["config"]["plan"]["offload"]
    resident, bits = offload["resident_layers"], offload.get("streamed_bits", 16)
    layout = (f"batch {run['batch']}: {resident} of {layers} layers resident, {layers - resident} streamed" +
              (f" as int{bits}" if bits < 16 else "") + f", {offload['sub_batches']} sub-batches")
    rows.append([kernels, layout, f"{run['prefill_tokens_per_s']:,.0f}", f"{run['decode_tokens_per_s']:,.1f}",
                 f"{run['decode_pass_seconds']:.3f}", f"{run['decode_io_seconds_per_pass_at_measured_bandwidth']:.3f}",
                 f"{run['generation_tokens_per_s']:,.1f}"])
  return _table(["streamed kernels", "layout", "prefill tok/s", "decode tok/s", "decode pass (s)",
                 "its PCIe time (s)", "generated tok/s"], ["---", "---", "---:", "---:", "---:", "---:", "---:"], rows)


def vs_deepspeed(name: str) -> str:
  file, run, words = VS_DEEPSPEED[name]
  runs = _load(file)["runs"][run]
  ours, theirs = runs["sljax"], runs["deepspeed"]
  ratio = re.search(r"--offload_ratio auto -> ([\d.]+)", " ".join(theirs["notes"]))[1]
  rows = [[f"sljax ({words})", f"{ours['tokens_per_s']:,.0f}", _percent(ours["mfu"]), f"{ours['step_seconds']:.2f}"],
          [f"DeepSpeed ZeRO-3 offload (ratio {ratio})", f"{theirs['tokens_per_s']:,.0f}", _percent(theirs["mfu"]),
           ", ".join(f"{t:#.3g}" for t in theirs["step_s"])]]
  return _table(["system", "tokens/s", "MFU", "step (s)"], ["---", "---:", "---:", "---:"], rows)


def generate_vs_accelerate() -> str:
  ours = {r["model"]: r for r in _load("generate_h200.json")["results"]}
  rows = []
  for model, file in GENERATE_VS_ACCELERATE:
    run, peer = ours[model], _load(file)
    offload, layers = run["config"]["plan"]["offload"], run["config"]["model"]["num_layers"]
    kv = "in pinned host memory" if offload["kv_on_host"] else "on the device"
    resident = offload["resident_layers"]
    where = (f"all {layers} layers and the KV cache {kv}" if resident == layers else
             f"{resident} of {layers} layers resident, {layers - resident} streamed; KV cache {kv}")
    modules = peer["modules_per_device"]
    on_cpu, total = modules.get("cpu", 0), sum(modules.values())
    peer_where = (f"{total - on_cpu} of {total} modules on the GPU, {on_cpu} on the CPU" if on_cpu else
                  "everything on the GPU")
    for system, placement, r in (("sljax", where, run), ("HF + accelerate", peer_where, peer["result"])):
      rows.append([f"{model}, {r['batch']}", system, placement, f"{r['prefill_tokens_per_s']:,.0f}",
                   f"{r['decode_tokens_per_s']:,.1f}", f"{r['generation_tokens_per_s']:,.1f}"])
  return _table(["model, batch", "system", "placement", "prefill tok/s", "decode tok/s", "generated tok/s"],
                ["---", "---", "---", "---:", "---:", "---:"], rows)


def scaling() -> str:
  rows = []
  for file, case, label in SCALING_ROWS:
    r = next(r for r in _load(file)["results"] if r["case"] == case)
    moved = r["bytes_per_step_per_gpu"]
    between = f"{moved['between_devices'] / 1e9:.1f} GB" if moved["between_devices"] else "—"
    rows.append([label, f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.0f}", _percent(r["mfu_per_gpu"]),
                 f"{r['weak_scaling_efficiency']:.2f}",
                 f"{moved['host_to_device'] / 1e9:.1f} / {moved['device_to_host'] / 1e9:.1f} GB, {between}"])
  return _table(["mesh", "tokens/s", "per GPU", "MFU per GPU", "weak-scaling efficiency",
                 "per GPU per step: PCIe in / out, between GPUs"], ["---", "---:", "---:", "---:", "---:", "---"], rows)


def checkpoint_scale() -> str:
  r = _load("checkpoint_scale_h200.json")
  peak, rss, disk = r["peak_host_extra_gib"], r["rss_gib"], r["disk_rates"]
  held = rss["after_save"] - rss["before_save"]
  rows = [["save", f"{r['save_seconds']:.1f}", f"{r['save_gb_per_s']:.2f}",
           f"{disk['write_bytes_per_s'] / 1e9:.2f} ({r['save_fraction_of_disk']:.2f})",
           f"{peak['save']:.1f} GiB peak ({held:.1f} GiB of it still held after the save and reused by the next)"],
          ["restore", f"{r['restore_seconds']:.1f}", f"{r['restore_gb_per_s']:.2f}",
           f"{disk['read_bytes_per_s'] / 1e9:.2f} ({r['restore_fraction_of_disk']:.2f})", f"{peak['restore']:.1f} GiB peak"]]
  return _table(["", "seconds", "GB/s", "the disk's own GB/s (fraction reached)", "host memory above the level before"],
                ["---", "---:", "---:", "---:", "---:"], rows)


def generate_vs_peers() -> str:
  models, rows = _load("generate_vs_peers_h200.json")["models"], []
  names = {"sljax": "sljax", "flexgen": "FlexGen", "zero_inference": "ZeRO-Inference"}
  for model, entry in models.items():
    for system, figures in entry["systems"].items():
      if "not_run" in figures:
        continue
      for kind in ("exact", "compressed"):
        best = figures[f"best_{kind}"]
        if best is None:
          reasons = {s["status"].split(":")[0] for s in figures["settings"][kind]}
          rows.append([model, names[system], kind, ", ".join(sorted(reasons)) or "not run", "—", "—", "—"])
          continue
        rows.append([model, names[system], kind, best["setting"], f"{best['prefill_tokens_per_s']:,.0f}",
                     f"{best['decode_tokens_per_s']:,.1f}", f"{best['generated_tokens_per_s']:,.1f}"])
  return _table(["model", "system", "weights", "best setting run", "prefill tok/s", "decode tok/s", "generated tok/s"],
                ["---", "---", "---", "---", "---:", "---:", "---:"], rows)


def _lora_run(r: dict) -> tuple[str, float, float]:
  """A LoRA run's base placement in words, its MFU (no recompute) and its HFU (recompute counted). A file from before
  hfu was recorded holds the HFU as mfu, with the hardware FLOPs per token as flops_per_token: its MFU is computed
  from the same tokens/s with lora_flops_per_token's model FLOPs."""
  model = LoraModel(build(get_config(r["model"])), LoraConfig(rank=r["lora_rank"]))
  layers, resident = model.cfg.num_layers, r["plan"]["resident_layers"]
  placed = (f"all {layers} layers resident" if resident == layers else
            f"{resident} of {layers} layers resident, {layers - resident} streamed")
  if "hfu" in r:
    return placed, r["mfu"], r["hfu"]
  return placed, r["mfu"] * lora_flops_per_token(model, r["seq_len"], 0).model / r["flops_per_token"], r["mfu"]


def lora() -> str:
  """The LoRA runs. Peaks are the process's: a second model in the same run shows the first's when it was higher."""
  data, rows = _load("lora_llama70b_h200.json"), []
  for i, r in enumerate(data["results"]):
    moved = r["pcie_bytes_per_step"]
    placed, mfu, hfu = _lora_run(r)
    peaks = (f"{r['peak_device_bytes'] / 2**30:.1f} / {r['peak_host_rss_bytes'] / 2**30:.1f}" if i == 0 else
             "(same process)")
    rows.append([r["model"], f"{r['batch']} x {r['seq_len']}", placed, f"{r['tokens_per_s']:,.0f}", _percent(mfu),
                 _percent(hfu), f"{r['step_seconds']:.2f}",
                 f"{(moved['host_to_device'] + moved['device_to_host']) / 1e9:.1f}", peaks,
                 "equal" if r["checkpoint"]["equal"] else "DIFFERENT"])
  return _table(["model", "batch", "base", "tokens/s", "MFU (no recompute)", "HFU (recompute counted)", "step (s)",
                 "PCIe GB/step", "peak device / host RSS GiB", "step after save vs after restore"],
                ["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---"], rows)


def savers_quality() -> str:
  """Each inexact saver's run against the fp32 run of the same file (same init, batches and gradient sums)."""
  rows = []
  for name, variant, flag in SAVERS_QUALITY:
    r = _load(name)
    exact, saved, difference = r["runs"]["float32"], r["runs"][variant], r[f"{variant}_minus_float32"]
    grouping = f", groups of {r['live_layers']} layer(s)" if "live_layers" in r else ""
    rows.append([f"`{flag}`", f"{r['model']}, {r['steps']:,} steps, {r.get('sub_batches', 1)} sub-batch(es){grouping}",
                 f"{r['final_steps']}",
                 *(f"{exact[key]:.3f} / {saved[key]:.3f} ({difference[key]:+.4f})"
                   for key in ("train_loss_final", "held_out_loss")), f"`{name}`"])
  return _table(["saver", "run", "final steps", "final train loss: fp32 / saver (difference)",
                 "held-out loss: fp32 / saver (difference)", "file"], ["---", "---", "---:", "---:", "---:", "---"],
                rows)


def headline() -> str:
  """The README's few numbers, each row from the file it names."""
  train = _load("train_py_llama13b_default_h200.json")
  runs = _load("vs_deepspeed_llama13b_h200.json")["runs"]["llama13b"]
  ours, deepspeed = runs["sljax"], runs["deepspeed"]
  lora_run = _load("lora_llama70b_h200.json")["results"][0]
  placed, lora_mfu, lora_hfu = _lora_run(lora_run)
  peers = _load("generate_vs_peers_h200.json")["models"]
  qlora = _load("train_py_qlora_llama70b_h200.json")
  qlora_batch = re.search(r"batch (\d+ x \d+)", qlora["plan"]).group(1)

  def rate(figures: dict, kind: str) -> str:
    return f"{figures[f'best_{kind}']['generated_tokens_per_s']:,.1f} tok/s"

  def peers_row(model: str, kind: str, weights: str) -> list[str]:
    entry = peers[model]
    against = [(name, key) for name, key in (("FlexGen", "flexgen"), ("ZeRO-Inference", "zero_inference"))
               if entry["ratios"][f"sljax_over_{key}"][kind] is not None]
    return [f"{model} generation, {weights}", rate(entry["systems"]["sljax"], kind),
            "; ".join(f"{name} {rate(entry['systems'][key], kind)}" for name, key in against),
            ", ".join(f"{entry['ratios'][f'sljax_over_{key}'][kind]:.2f}x" for _, key in against),
            "`generate_vs_peers_h200.json`"]

  rows = [["llama13b training, `train.py --model=llama13b` (32 x 2048, the plan's batch)",
           f"{train['tokens_per_s_steady']:,.0f} tok/s, {_percent(train['mfu_steady'])} MFU", "—", "—",
           "`train_py_llama13b_default_h200.json`"],
          ["llama13b training beside DeepSpeed (batch 32 x 2048, one system after the other)",
           f"{ours['tokens_per_s']:,.0f} tok/s, {_percent(ours['mfu'])} MFU",
           f"DeepSpeed ZeRO-3 offload {deepspeed['tokens_per_s']:,.0f} tok/s, {_percent(deepspeed['mfu'])} MFU",
           f"{ours['tokens_per_s'] / deepspeed['tokens_per_s']:.2f}x", "`vs_deepspeed_llama13b_h200.json`"],
          [f"LoRA llama70b, rank {lora_run['lora_rank']}, {lora_run['batch']} x {lora_run['seq_len']} ({placed})",
           f"{lora_run['tokens_per_s']:,.0f} tok/s, {_percent(lora_mfu)} MFU, {_percent(lora_hfu)} HFU", "—", "—",
           "`lora_llama70b_h200.json`"],
          ["QLoRA llama70b, `train.py --model=llama70b --lora_rank=16 --base_bits=4` "
           f"({qlora_batch}, the plan's; the int4 base resident)",
           f"{qlora['tokens_per_s_steady']:,.0f} tok/s, {_percent(qlora['mfu_steady'])} MFU, "
           f"{_percent(qlora['hfu_steady'])} HFU", "—", "—", "`train_py_qlora_llama70b_h200.json`"],
          peers_row("llama70b", "compressed", "int4 weights"), peers_row("opt-66b", "compressed", "int4 weights"),
          peers_row("opt-66b", "exact", "16-bit weights")]
  return _table(["on one H200", "sljax", "against", "sljax / it", "from benchmarks/results/"],
                ["---", "---:", "---", "---:", "---"], rows)


TABLES = {"headline": headline, "train_throughput": train_throughput, "generate_vs_peers": generate_vs_peers,
          "lora": lora, "train_py": train_py, "generate_int4": generate_int4,
          "vs_deepspeed_llama13b": lambda: vs_deepspeed("vs_deepspeed_llama13b"),
          "vs_deepspeed_fits": lambda: vs_deepspeed("vs_deepspeed_fits"), "generate_vs_accelerate": generate_vs_accelerate,
          "scaling": scaling, "checkpoint_scale": checkpoint_scale, "savers_quality": savers_quality}
FILES = {  # file, from the repository root: the tables it holds (each table in one file)
    "README.md": ("headline",),
    "docs/results.md": ("train_py", "train_throughput", "vs_deepspeed_llama13b", "vs_deepspeed_fits",
                        "generate_vs_accelerate", "generate_vs_peers", "generate_int4", "lora", "scaling",
                        "checkpoint_scale", "savers_quality"),
}
# A section's body never spans another section's start: an empty body ends at its own end marker.
_SECTION = re.compile(r"(<!-- results: (?P<name>\w+) -->\n)(?P<body>(?:(?!<!-- results:).)*?)(\n?<!-- end results -->)",
                      re.S)


def marked_tables(text: str) -> dict[str, str]:
  """{name: the table the text holds} for every marked section."""
  return {match["name"]: match["body"] for match in _SECTION.finditer(text)}


def with_tables(text: str) -> str:
  """The text with every marked section's table made anew from the files."""
  return _SECTION.sub(lambda match: match[1] + TABLES[match["name"]]() + "\n<!-- end results -->", text)


def main(argv):
  del argv
  if FLAGS.write:
    for name in FILES:
      path = os.path.join(REPO, name)
      with open(path) as f:
        text = f.read()
      with open(path, "w") as f:
        f.write(with_tables(text))
    return
  for name, make in TABLES.items():
    print(f"{name}:\n{make()}\n")


if __name__ == "__main__":
  app.run(main)
