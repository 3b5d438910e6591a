"""sljax's offloaded generation against FlexGen and DeepSpeed ZeRO-Inference on one H200: the comparison, made from
the committed run files (each made by its own command, recorded in it) and written with its sources.

  python -m benchmarks.generate_vs_peers --out=benchmarks/results/generate_vs_peers_h200.json

The workload is the same in every file: random weights, prompt 512, 32 new tokens, greedy; generated tokens/s =
batch x 32 / (prefill + decode). Per model and system the best exact (16-bit) setting and the best compressed one
(4-bit weights; FlexGen's 4-bit KV cache too) of the runs; the ratios pair sljax's exact with each peer's exact and
sljax's compressed with each peer's compressed. A peer setting that could not run here is recorded with its reason.
The runs:
  sljax       python -m benchmarks.generate_throughput --models=M [--streamed_bits=4 [--resident_bits=4]] [--batch=B]
  FlexGen     python -m benchmarks.baselines.flexgen_generate --model=opt-66b --configs=...   (OPT only)
  ZeRO-Inf.   python -m benchmarks.baselines.zero_inference_generate --models=M --quant=16,4 --batches=B
"""

import json
import os

from absl import app, flags

from benchmarks.common import provenance, write_results

FLAGS = flags.FLAGS

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SLJAX = {  # model: {kind: [files, one setting each]}
    "opt-66b": {"exact": ["generate_opt-66b_h200.json", "generate_opt-66b_batch8_h200.json"],
                "compressed": ["generate_opt-66b_streamed_int4_h200.json", "generate_opt-66b_int4_all_h200.json"]},
    "llama70b": {"exact": ["generate_llama70b_streamed_bf16_h200.json"],
                 "compressed": ["generate_llama70b_streamed_int4_h200.json", "generate_llama70b_int4_all_h200.json"]},
}
FLEXGEN = {"opt-66b": "generate_opt-66b_flexgen_h200.json"}
ZERO_INFERENCE = {  # one run per file, each a part of the batch sweep
    "llama70b": ["generate_llama70b_zero_inference_h200.json", "generate_llama70b_zero_inference_batch384_h200.json",
                 "generate_llama70b_zero_inference_batch512_h200.json"],
    "opt-66b": ["generate_opt-66b_zero_inference_h200.json", "generate_opt-66b_zero_inference_batch96_h200.json"],
}
NOT_RUN = {("llama70b", "flexgen"): "FlexGen runs OPT models only"}  # (model, peer): why there is no file
UNRUN_SETTINGS = {  # (model, peer, kind): why no setting of that kind ran
    ("opt-66b", "zero_inference", "exact"): "infeasible here: ZeRO-3 keeps all 132 GB of fp16 weights in pinned host "
                                            "memory, more than the 128 GiB of RAM",
}
# The comparison's keys, and the run files' names for them.
FIGURES = {"generated_tokens_per_s": "generation_tokens_per_s", "prefill_tokens_per_s": "prefill_tokens_per_s",
           "decode_tokens_per_s": "decode_tokens_per_s"}


def _load(name: str) -> dict:
  with open(os.path.join(RESULTS, name)) as f:
    return json.load(f)


def _sljax_setting(name: str) -> dict:
  (run,) = _load(name)["results"]
  offload = run["config"]["plan"]["offload"]
  layers, resident = run["config"]["model"]["num_layers"], offload["resident_layers"]
  placed = (f"all {layers} layers resident ({offload.get('resident_bits', 16)}-bit)" if resident == layers else
            f"{resident} of {layers} layers resident ({offload.get('resident_bits', 16)}-bit), {layers - resident} "
            f"streamed ({offload.get('streamed_bits', 16)}-bit)")
  setting = (f"batch {run['batch']}, {placed}, {offload['sub_batches']} sub-batches, KV cache "
             f"{'in pinned host' if offload['kv_on_host'] else 'on the device'}")
  return {**{key: run[source] for key, source in FIGURES.items()}, "setting": setting, "file": name}


def _best(settings: list[dict]) -> dict | None:
  ok = [s for s in settings if s.get("generated_tokens_per_s")]
  return max(ok, key=lambda s: s["generated_tokens_per_s"]) if ok else None


def flexgen(model: str) -> dict:
  name = FLEXGEN[model]
  data, settings = _load(name), {"exact": [], "compressed": []}
  for point in data["sweep"]:
    policy = point.get("policy", {})
    kind = "compressed" if policy.get("compress_weight") or policy.get("compress_cache") else "exact"
    entry = {"setting": f"policy {point['config']} (batch {point['batch']})", "status": point["status"],
             "file": name, **{key: point.get(source) for key, source in FIGURES.items()}}
    settings[kind].append(entry)
  return settings


def zero_inference(model: str) -> dict:
  settings = {"exact": [], "compressed": []}
  for name in ZERO_INFERENCE[model]:
    (run,) = [r for r in _load(name)["results"] if r["model"] == model]
    for config in run["sweep"]:
      kind = "exact" if config["weight_bits"] == 16 else "compressed"
      settings[kind].append({
          "setting": f"{config['weight_bits']}-bit weights, batch {config['batch']}, KV cache "
                     f"{'offloaded' if config['kv_offload'] else 'on the GPU'}",
          "status": config["status"], "file": name, **{key: config.get(source) for key, source in FIGURES.items()}})
  for kind in settings:
    if (model, "zero_inference", kind) in UNRUN_SETTINGS:
      settings[kind].append({"setting": "16-bit weights", "status": UNRUN_SETTINGS[(model, "zero_inference", kind)]})
  return settings


def comparison() -> dict:
  models = {}
  for model, kinds in SLJAX.items():
    systems = {"sljax": {kind: [_sljax_setting(name) for name in names] for kind, names in kinds.items()}}
    for peer, files, read in (("flexgen", FLEXGEN, flexgen), ("zero_inference", ZERO_INFERENCE, zero_inference)):
      systems[peer] = read(model) if model in files else {"not_run": NOT_RUN[(model, peer)]}
    entry = {"systems": {}, "ratios": {}}
    for system, settings in systems.items():
      entry["systems"][system] = ({"not_run": settings["not_run"]} if "not_run" in settings else {
          "best_exact": _best(settings["exact"]), "best_compressed": _best(settings["compressed"]),
          "settings": settings})
    ours = entry["systems"]["sljax"]
    for peer in ("flexgen", "zero_inference"):
      theirs = entry["systems"][peer]
      entry["ratios"][f"sljax_over_{peer}"] = {kind: (
          ours[f"best_{kind}"]["generated_tokens_per_s"] / theirs[f"best_{kind}"]["generated_tokens_per_s"]
          if theirs.get(f"best_{kind}") else None) for kind in ("exact", "compressed")}
    models[model] = entry
  bf16 = _sljax_setting("generate_llama70b_streamed_bf16_h200.json")
  int4 = _sljax_setting("generate_llama70b_streamed_int4_h200.json")
  models["llama70b"]["ratios"]["int4_decode_over_bf16"] = int4["decode_tokens_per_s"] / bf16["decode_tokens_per_s"]
  quality = _load("quant_quality_llama_tiny_cpu.json")["formats"]["int4"]
  models["llama70b"]["int4_quality_cost"] = {
      "perplexity_over_bf16": quality["perplexity_over_bf16"], "max_abs_logit_diff": quality["max_abs_logit_diff"],
      "measured_on": "llama-tiny trained 400 steps on CPU (quant_quality_llama_tiny_cpu.json)"}
  return models


def main(argv):
  del argv
  models = comparison()
  for model, entry in models.items():
    for system, figures in entry["systems"].items():
      for kind in ("best_exact", "best_compressed"):
        best = figures.get(kind)
        why = figures.get("not_run") or "; ".join(s.get("status", "") for s in figures["settings"][kind[5:]])
        figure = f"{best['generated_tokens_per_s']:8.1f} tok/s  {best['setting']}" if best else why
        print(f"{model:9s} {system:15s} {kind:16s} {figure}")
    print(model, json.dumps(entry["ratios"]))
  write_results(FLAGS.out, {**provenance(device=None), "workload": "random weights, prompt 512, 32 new tokens, greedy",
                            "models": models})


if __name__ == "__main__":
  # Defined here, not on import: the tests import comparison().
  flags.DEFINE_string("out", "", "Write the comparison JSON here.")
  app.run(main)
