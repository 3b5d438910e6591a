"""sljax against DeepSpeed ZeRO-3 offload (issues 7 and 36): both systems back to back on the same GPU, one JSON with
the ratio.

  python3 -m benchmarks.vs_deepspeed --install --models=llama13b \
      --out=benchmarks/results/vs_deepspeed_llama13b_h200.json
  python3 -m benchmarks.vs_deepspeed --install --accumulation=1,4,16 \
      --out=benchmarks/results/vs_deepspeed_accumulation_h200.json
  python3 -m benchmarks.vs_deepspeed --smoke --out=/tmp/vs.json          # tiny model on a CPU: checks the code paths
  python3 -m benchmarks.vs_deepspeed --smoke --accumulation=1,2 --out=/tmp/vs_ga.json

For each model the two systems run one after the other, each in its own process (each owns the whole GPU while it
runs), on the same sequence length and effective batch, with the same MFU formula (models.ModelConfig.flops_per_token:
6 x matmul params + causal attention, recompute not counted, 989 TFLOP/s dense bf16 peak):
  sljax      benchmarks.train_throughput: the engine under the plan for the budgets (llama13b: the "big" case)
  DeepSpeed  benchmarks.baselines.deepspeed_zero3: HF LlamaForCausalLM, bf16, activation checkpointing, ZeRO-3 with
             offload_param + offload_optimizer to pinned CPU memory (partial optimizer offload where the host cannot
             hold all of it: --ds_host_mem_gib)
Models: llama13b (batch 32 x 2048, the engine benchmark's workload) and fits (llama7b shapes with 8 layers, batch
16 x 2048: the model that fits on one GPU). The JSON is rewritten after every run, so a time-out keeps what finished.

--accumulation (issue 36, the paper's setting): llama13b, micro-batches of --micro_batch x --seq, each gradient
accumulation A of the list an optimizer step of A micro-batches, the same optimizer on both sides (AdamW with fp32
master weights and moments, fp32 gradient accumulation, clipped at global norm 1.0, checked from both records):
  sweep      DeepSpeed's zero_optimization knobs (--sweep), greedily at accumulation 1 on llama13b with
             --sweep_layers layers (each setting is a process, and the knobs act per layer): each value is tried over
             the best so far and kept if faster; the best goes to the points
  deepspeed  one DeepSpeed process, full offload (--ds_offload_ratio 1), the points one after the other on its engine
  sljax      per point a train_throughput process, case big_like_deepspeed, at the point's effective batch (micro
             x accumulation rows) as sub-batches in one step (--sljax_sub_batches, else the plan's)
--parts picks which run here and --merge starts from an earlier file of this benchmark, so the parts and points can
be split over several device calls; --time_budget_s stops the last run itself, leaving time to write.
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time

from benchmarks.common import REPO, provenance, write_results
from sljax.machines import GIB, PINNED_FRACTION, ram_bytes

WORKLOADS = {
    # name: (sljax train_throughput.py flags, deepspeed_zero3.py flags)
    "llama13b": (["--cases=big", "--big_batch=32", "--trace_cases="],  # --timeout_s leaves no time for a traced step
                 ["--model=llama13b", "--batch=32", "--micro_batch=16"]),
    "fits": (["--cases=fits", "--fits_cases=engine", "--fits_model=llama7b", "--fits_set=num_layers=8",
              "--fits_batch=16"],
             ["--model=llama7b", "--override=num_layers=8", "--batch=16", "--micro_batch=16"]),
}
PARTS = ("sweep", "deepspeed", "sljax")
# --sweep's default: KEY=VALUE,... per knob, knobs apart by ";", tried in this order over the baseline script's own
# settings (HF's "auto" sizes: prefetch 0.9 h^2 = 23.6M parameters, less than one of a layer's MLP matrices;
# overlap_comm on). Three runs of about a minute each; reduce_bucket_size, sub_group_size, offload_param.pin_memory
# and the like are for --sweep to add where there is time.
SWEEP = ("stage3_prefetch_bucket_size=640000000;"  # two llama13b layers (317M parameters each) ahead of the compute
         "overlap_comm=false")  # gradients reduced and sent to the CPU on the compute stream instead of beside it
MICRO_BATCH_WHY = (
    "16 rows: the micro-batch of the last DeepSpeed run (vs_deepspeed_llama13b_h200.json, 16 x 2 accumulation, "
    "which fitted beside 37% of the optimizer state on the GPU; full offload leaves it more room), and the largest "
    "for which sljax can take accumulation 16 (256 rows: ~300 GiB of pinned host memory for its activation stash and "
    "state, by sljax.plan) as one step; a larger one would favour DeepSpeed (fewer weight fetches per token) but "
    "leave no accumulation-16 point")


def run(name, argv, timeout, log_path, env=None, on_line=None):
  """Runs one system, stopped with SIGTERM after `timeout` seconds (both scripts write their JSON on it; None: no
  limit); returns (exit status, seconds). Output goes to the terminal and to log_path; on_line(line) sees each line
  as it comes."""
  print(f"== {name}: {' '.join(shlex.quote(a) for a in argv)}", flush=True)
  start = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    timer = threading.Timer(timeout, proc.terminate) if timeout is not None else None
    if timer:
      timer.start()
    for line in proc.stdout:
      sys.stdout.write(line)
      log.write(line)
      if on_line:
        on_line(line)
    status = proc.wait()
    if timer:
      timer.cancel()
  return status, time.perf_counter() - start


def read_json(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as error:
    return {"status": "failed", "error": f"no result: {error}"}


def sljax_summary(data, case):
  result = next((r for r in data.get("results", []) if r.get("case") == case), None)
  if result is None:
    return {"status": "failed", "error": data.get("error", f"case {case} did not finish")}
  keys = ("tokens_per_s", "step_seconds", "step_seconds_all", "losses", "mfu", "hfu", "plan", "bytes_moved_per_step",
          "peak_device_bytes", "peak_host_rss_bytes", "engine", "optimizer_settings")
  return {"status": "ok", **{k: result[k] for k in keys if k in result}, "command": data.get("command"),
          "device": data.get("device"), "versions": data.get("versions")}


def finished_points(data):
  """The baseline's points that finished (those with their tokens/s)."""
  return [point for point in data.get("points") or [] if "tokens_per_s" in point]


def deepspeed_summary(data):
  """The baseline's JSON; a run stopped after all its points (in teardown) still counts."""
  points = finished_points(data)
  if data.get("status") != "ok" and points and len(points) == len(data["config"]["accumulation"]):
    last = points[-1]
    data = {**data, "status": "ok", **{k: last[k] for k in ("step_s", "step_s_mean", "tokens_per_s", "mfu")},
            "stopped_after_timed_steps": f"all {len(points)} points finished; stopped in phase {data.get('phase')!r}"}
  return data


def compare_models(args, report, write, out_dir):
  """--models: each model's sljax run, then its DeepSpeed run, and the ratio."""
  host_memory_gib = 85 if args.sljax_host_memory_gib is None else args.sljax_host_memory_gib
  timeout = args.timeout_s or 420
  for name in args.models.split(","):
    if name not in WORKLOADS:
      sys.exit(f"vs_deepspeed: unknown model {name!r}; known: {', '.join(WORKLOADS)}")
    ours, theirs = WORKLOADS[name]
    case = "big" if name == "llama13b" else "fits/engine"
    s_json, d_json = os.path.join(out_dir, f"sljax_{name}.json"), os.path.join(out_dir, f"deepspeed_{name}.json")
    for path in (s_json, d_json):
      if os.path.exists(path):
        os.remove(path)
    seq = ["--seq_len=64"] if args.smoke else [f"--seq_len={args.seq}"]
    s_argv = [args.python, "-m", "benchmarks.train_throughput", *ours, *seq, f"--steps={args.sljax_steps}",
              f"--host_memory_gib={host_memory_gib}", f"--out={s_json}"] + (["--smoke"] if args.smoke else [])
    d_argv = [args.python, "-m", "benchmarks.baselines.deepspeed_zero3", *([] if args.smoke else theirs),
              f"--seq={args.seq}", "--warmup=1", f"--steps={args.ds_steps}", "--offload_ratio=auto",
              f"--host_mem_gib={args.ds_host_mem_gib or 240}", f"--out={d_json}"] + (["--smoke"] if args.smoke else [])
    entry = report["runs"][name] = {}
    status, seconds = run(f"sljax {name}", s_argv, timeout, os.path.join(out_dir, f"sljax_{name}.log"))
    entry["sljax"] = {**sljax_summary(read_json(s_json), case), "exit_status": status, "wall_s": round(seconds, 1)}
    report["device"] = report["device"] or entry["sljax"].get("device")
    write()
    status, seconds = run(f"deepspeed {name}", d_argv, timeout, os.path.join(out_dir, f"deepspeed_{name}.log"))
    entry["deepspeed"] = {**deepspeed_summary(read_json(d_json)), "exit_status": status, "wall_s": round(seconds, 1)}
    ok = entry["sljax"].get("status") == "ok" and entry["deepspeed"].get("status") == "ok"
    entry["ratio_tokens_per_s"] = (entry["sljax"]["tokens_per_s"] / entry["deepspeed"]["tokens_per_s"]) if ok else None
    write()
    print(f"== {name}: sljax {entry['sljax'].get('tokens_per_s', float('nan')):,.0f} tok/s, DeepSpeed "
          f"{entry['deepspeed'].get('tokens_per_s') or float('nan'):,.0f} tok/s, ratio {entry['ratio_tokens_per_s']}",
          flush=True)


# ------------------------------------------------------------------------------------------- gradient accumulation
def parse_sweep(text):
  """--sweep "KEY=V1,V2;KEY2=V" -> [(KEY, ["V1", "V2"]), (KEY2, ["V"])]; "" -> no sweep."""
  knobs = []
  for item in filter(None, (part.strip() for part in text.split(";"))):
    key, sep, values = item.partition("=")
    if not sep or not values:
      raise ValueError(f"--sweep {item!r}: expected KEY=VALUE[,VALUE...]")
    knobs.append((key, values.split(",")))
  return knobs


def greedy_sweep(knobs, measure):
  """The knobs' values tried one at a time over the best settings so far (measure(settings) -> tokens/s, or None for
  a run that failed), each kept if it beats them. Returns (best settings, every trial: settings and tokens/s)."""
  best, trials = {}, []
  best_rate = measure(best)
  trials.append({"settings": {}, "tokens_per_s": best_rate})
  for key, values in knobs:
    for value in values:
      settings = {**best, key: value}
      rate = measure(settings)
      trials.append({"settings": settings, "tokens_per_s": rate})
      if rate is not None and (best_rate is None or rate > best_rate):
        best, best_rate = settings, rate
  return best, trials


def timed_steps(args, accumulation):
  """Timed optimizer steps at a point: --timed_steps, but no more than --timed_micro_batches micro-batches' worth
  (a DeepSpeed step at accumulation 16 takes minutes), and at least one."""
  return max(1, min(args.timed_steps, args.timed_micro_batches // accumulation))


def same_settings(points):
  """Both systems' optimizer records, from the first point that has each, and where they differ."""
  def first(system):
    return next((p[system]["optimizer_settings"] for p in points.values()
                 if p.get(system, {}).get("optimizer_settings")), None)
  ours, theirs = first("sljax"), first("deepspeed")
  if ours is None or theirs is None:
    return {"sljax": ours, "deepspeed": theirs, "same": None}
  differences = {k: {"sljax": ours.get(k), "deepspeed": theirs.get(k)} for k in sorted(set(ours) | set(theirs))
                 if ours.get(k) != theirs.get(k)}
  return {"sljax": ours, "deepspeed": theirs, "same": not differences, "differences": differences}


def ratios(report, goal_ratio=5.0, goal_accumulation=16):
  """Each point's sljax tokens/s over DeepSpeed's and whether their optimizer steps had the same rows, where both
  finished; the issue's goal; both optimizer records and where they differ."""
  for point in report["points"].values():
    ours, theirs = point.get("sljax", {}), point.get("deepspeed", {})
    ok = ours.get("status") == "ok" and theirs.get("status") == "ok"
    point["ratio_tokens_per_s"] = ours["tokens_per_s"] / theirs["tokens_per_s"] if ok else None
    point["same_batch_rows"] = ours["rows"] == theirs["grad_accum"] * theirs["micro_batch"] if ok else None
  ratio = report["points"].get(str(goal_accumulation), {}).get("ratio_tokens_per_s")
  report["goal"] = {"accumulation": goal_accumulation, "ratio_at_least": goal_ratio, "ratio": ratio,
                    "met": None if ratio is None else ratio >= goal_ratio}
  report["settings"] = same_settings(report["points"])


def compare_accumulation(args, report, write, out_dir):
  """--accumulation: the sweep, the DeepSpeed points and the sljax points of --parts, in that order."""
  parts = args.parts.split(",")
  unknown = set(parts) - set(PARTS)
  if unknown:
    sys.exit(f"vs_deepspeed: unknown --parts {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}")
  accumulation = [int(a) for a in args.accumulation.split(",")]
  micro = args.micro_batch or (1 if args.smoke else 16)
  merged = report.get("workload", {}).get("micro_batch_rows")
  if merged not in (None, micro):
    sys.exit(f"vs_deepspeed: --merge {args.merge} holds micro-batches of {merged} rows, this run's are {micro}")
  host_gib = ram_bytes() / GIB
  ds_host_gib = args.ds_host_mem_gib or round(host_gib, 1)
  sljax_host_gib = args.sljax_host_memory_gib or round(PINNED_FRACTION * host_gib, 1)
  model = ["--smoke"] if args.smoke else ["--model=llama13b", f"--seq={args.seq}"]
  ds_common = [f"--micro_batch={micro}", f"--offload_ratio={args.ds_offload_ratio}", f"--host_mem_gib={ds_host_gib}"]
  # One GPU for both, as the comparison is for one; on a machine with more the others stay idle.
  env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
  report.update(
      workload={"model": "tiny (--smoke)" if args.smoke else "llama13b", "seq_len": None if args.smoke else args.seq,
                "micro_batch_rows": micro,
                "micro_batch_why": MICRO_BATCH_WHY if micro == 16 else "--micro_batch",
                "accumulation": sorted({*accumulation, *map(int, report.get("points", {}))}),
                "timed_steps": {str(a): timed_steps(args, a) for a in accumulation}},
      host_ram_gib=round(host_gib, 1), deepspeed_host_mem_gib=ds_host_gib, sljax_host_memory_gib=sljax_host_gib)
  points = report.setdefault("points", {})

  def time_left():
    return (args.time_budget_s - (time.perf_counter() - args.started)) if args.time_budget_s else float("inf")

  def child(name, argv, json_path, on_line=None):
    """Runs one child within --timeout_s and what --time_budget_s leaves (less 20 s to write); None if too little
    is left to start it. Its JSON, exit status and seconds are recorded in report["runs"]."""
    timeout = min(args.timeout_s or float("inf"), time_left() - 20)
    if timeout < args.min_run_s:
      print(f"== {name}: skipped, {time_left():.0f} s left of --time_budget_s", flush=True)
      report["runs"].append({"name": name, "skipped": f"{time_left():.0f} s left of --time_budget_s"})
      write()
      return None
    if os.path.exists(json_path):
      os.remove(json_path)
    limit = None if timeout == float("inf") else timeout
    status, seconds = run(name, argv, limit, json_path.removesuffix(".json") + ".log", env, on_line)
    report["runs"].append({"name": name, "command": " ".join(shlex.quote(a) for a in argv), "exit_status": status,
                           "wall_s": round(seconds, 1), "timeout_s": limit and round(limit, 1)})
    return read_json(json_path)

  if "sweep" in parts:
    knobs = parse_sweep(args.sweep)
    layers = [] if args.smoke or not args.sweep_layers else [f"--override=num_layers={args.sweep_layers}"]
    sweep = report["deepspeed_sweep"] = {
        "model": "llama-tiny (--smoke)" if args.smoke else f"llama13b with {args.sweep_layers or 40} layers",
        "accumulation": 1, "micro_batch": micro, "timed_steps": args.sweep_steps, "knobs": args.sweep, "trials": []}

    def measure(settings):
      i = len(sweep["trials"])
      path = os.path.join(out_dir, f"deepspeed_sweep_{i}.json")
      data = child(f"deepspeed sweep {i}: {settings or 'baseline settings'}",
                   [args.python, "-m", "benchmarks.baselines.deepspeed_zero3", *model, *layers, *ds_common,
                    "--accumulation=1", "--warmup=1", f"--steps={args.sweep_steps}",
                    *[f"--zero_set={k}={v}" for k, v in settings.items()], f"--out={path}"], path)
      done = finished_points(data or {})
      rate = done[0]["tokens_per_s"] if done else None
      sweep["trials"].append({"settings": settings, "tokens_per_s": rate, "status": (data or {}).get("status"),
                              "error": (data or {}).get("error"), "step_s": done[0]["step_s"] if done else None,
                              "zero_optimization": (data or {}).get("ds_config", {}).get("zero_optimization")})
      write()
      return rate

    sweep["best"], _ = greedy_sweep(knobs, measure)
    write()
  knobs = (dict(item.split("=", 1) for item in args.ds_knobs.split(";") if item) if args.ds_knobs is not None
           else report.get("deepspeed_sweep", {}).get("best", {}))
  knobs_from = ("--ds_knobs" if args.ds_knobs is not None else
                "the sweep" if "best" in report.get("deepspeed_sweep", {}) else "none: the baseline's own settings")

  if "deepspeed" in parts:
    path = os.path.join(out_dir, "deepspeed_accumulation.json")

    def record(data):
      common = {k: data.get(k) for k in ("label", "optimizer", "optimizer_settings", "ds_config", "versions",
                                         "device", "phases_s", "warmup_step_s", "optimizer_state_on_cpu_fraction",
                                         "grad_accum_buffer_dtype", "command", "date")}
      for point in finished_points(data):
        points.setdefault(str(point["grad_accum"]), {})["deepspeed"] = {
            "status": "ok", **point, **common, "knobs": knobs, "knobs_from": knobs_from}
      report["device"] = report.get("device") or (data.get("device") or {}).get("name")
      ratios(report)
      write()

    def on_line(line):  # each finished point reaches the report while the process runs on
      if "phase: accumulation" in line:
        record(read_json(path))

    data = child(f"deepspeed {args.accumulation}",
                 [args.python, "-m", "benchmarks.baselines.deepspeed_zero3", *model, *ds_common,
                  f"--accumulation={','.join(map(str, accumulation))}", "--warmup=1",
                  f"--steps={','.join(str(timed_steps(args, a)) for a in accumulation)}",
                  *[f"--zero_set={k}={v}" for k, v in knobs.items()], f"--out={path}"], path, on_line)
    if data is not None:
      record(data)
      steps = 1 + sum(timed_steps(args, a) for a in accumulation)  # its warm-up step and the points'
      report.setdefault("deepspeed_runs", {})[args.accumulation] = {
          **{k: data.get(k) for k in ("status", "error", "failed_in_phase", "optimizer_steps_applied",
                                      "grad_accum_buffer_dtype", "peak_gpu_reserved_gib", "peak_host_rss_gib",
                                      "host_estimate_gb", "gpu_estimate_gb", "notes", "config")},
          "one_update_per_optimizer_step": data.get("optimizer_steps_applied") == steps if data.get(
              "status") == "ok" else None}
      for a in accumulation:
        points.setdefault(str(a), {}).setdefault("deepspeed", {"status": "failed", "error": data.get("error")})
      ratios(report)
      write()

  if "sljax" in parts:
    for a in accumulation:
      path = os.path.join(out_dir, f"sljax_accumulation_{a}.json")
      sub_batches = [f"--big_sub_batches={a * micro // args.sljax_sub_batch_rows}"] if args.sljax_sub_batch_rows else []
      data = child(f"sljax accumulation {a}",
                   [args.python, "-m", "benchmarks.train_throughput", "--cases=big_like_deepspeed",
                    f"--big_batch={a * micro}", *sub_batches, f"--seq_len={args.seq}",
                    f"--steps={timed_steps(args, a)}", f"--host_memory_gib={sljax_host_gib}", "--trace_cases=",
                    "--nokernel_ceilings", f"--out={path}"] + (["--smoke"] if args.smoke else []), path)
      if data is None:
        continue
      ours = sljax_summary(data, "big_like_deepspeed")
      if ours["status"] == "ok":  # the rows its step had, from its own figures
        ours["rows"] = round(ours["tokens_per_s"] * ours["step_seconds"] / data["seq_len"])
      points.setdefault(str(a), {})["sljax"] = {**ours, "date": data.get("date")}
      ratios(report)
      write()
  for a, point in sorted(points.items(), key=lambda item: int(item[0])):
    print(f"== accumulation {a}: sljax {point.get('sljax', {}).get('tokens_per_s') or float('nan'):,.0f} tok/s, "
          f"DeepSpeed {point.get('deepspeed', {}).get('tokens_per_s') or float('nan'):,.0f} tok/s, ratio "
          f"{point.get('ratio_tokens_per_s')}", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--models", default="llama13b,fits", help="comma-separated: " + ", ".join(WORKLOADS))
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--sljax_steps", type=int, default=3, help="timed sljax steps (after one warm-up)")
  ap.add_argument("--ds_steps", type=int, default=2, help="timed DeepSpeed steps (after one warm-up)")
  ap.add_argument("--ds_host_mem_gib", type=float, default=0,
                  help="host RAM DeepSpeed may fill (its offload ratio and preflight); 0: 240 for --models, this "
                       "machine's RAM for --accumulation")
  ap.add_argument("--sljax_host_memory_gib", type=float, default=None,
                  help="pinned host memory of sljax's plan; default 85 for --models, for --accumulation the "
                       "machine's pinned budget (sljax.machines.PINNED_FRACTION of RAM)")
  ap.add_argument("--timeout_s", type=float, default=0, help="per run; a run past it is stopped and reported (0: "
                  "420 s for --models, none for --accumulation but what --time_budget_s leaves)")
  ap.add_argument("--accumulation", default="",
                  help="comma-separated gradient accumulations: the accumulation comparison instead of --models")
  ap.add_argument("--micro_batch", type=int, default=0, help="--accumulation: rows per micro-batch (0: 16, smoke 1)")
  ap.add_argument("--parts", default=",".join(PARTS), help="--accumulation: which of " + ", ".join(PARTS) + " to run")
  ap.add_argument("--merge", default="", help="--accumulation: start from this earlier JSON of it (its sweep and "
                  "points; this run's replace theirs)")
  ap.add_argument("--sweep", default=SWEEP, help="--accumulation: DeepSpeed knobs to sweep, KEY=V1,V2;KEY2=V")
  ap.add_argument("--sweep_layers", type=int, default=8, help="llama13b layers of the sweep's model (0: all 40)")
  ap.add_argument("--sweep_steps", type=int, default=2, help="timed steps of each sweep run (after one warm-up)")
  ap.add_argument("--ds_knobs", default=None,
                  help="--accumulation: DeepSpeed's settings for the points, KEY=V;KEY2=V ('' none), instead of the "
                       "sweep's best (this run's or --merge's)")
  ap.add_argument("--ds_offload_ratio", default="1.0", help="--accumulation: offload_optimizer.ratio (1: full "
                  "offload, the paper's setting; auto: what --ds_host_mem_gib holds)")
  ap.add_argument("--sljax_sub_batch_rows", type=int, default=0,
                  help="--accumulation: rows per sljax sub-batch (0: the plan's choice)")
  ap.add_argument("--timed_steps", type=int, default=2, help="--accumulation: timed steps per point (after warm-up)")
  ap.add_argument("--timed_micro_batches", type=int, default=4,
                  help="--accumulation: fewer timed steps where a point's would pass this many micro-batches")
  ap.add_argument("--time_budget_s", type=float, default=560,
                  help="--accumulation: wall seconds for this whole run, the install included (default: under the "
                       "device's 10-minute command limit; 0: none); each run gets what is left, less 20 s to write, "
                       "and one that would get under --min_run_s is not started")
  ap.add_argument("--min_run_s", type=float, default=60)
  ap.add_argument("--install", action="store_true", help="install DeepSpeed from .dsdeps first")
  ap.add_argument("--python", default=sys.executable)
  ap.add_argument("--smoke", action="store_true", help="tiny shapes on any machine")
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  args.started = time.perf_counter()  # --time_budget_s counts from here, the install included

  out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else "/tmp"
  os.makedirs(out_dir, exist_ok=True)
  # The device is the children's: this process never starts a backend, which would hold the GPU they need.
  facts = {**provenance(device=None), "host": platform.node()}
  if args.accumulation:
    report = read_json(args.merge) if args.merge else {}
    if args.merge and "points" not in report:
      sys.exit(f"vs_deepspeed: --merge {args.merge}: not a result of --accumulation ({report.get('error')})")
    report = {"benchmark": "sljax vs DeepSpeed ZeRO-3 full CPU offload under gradient accumulation (issue 36)",
              **report, **facts, "device": report.get("device"), "runs": report.get("runs", [])}
    report.setdefault("calls", []).append({k: facts[k] for k in ("command", "date")})
  else:
    report = {"benchmark": "sljax vs DeepSpeed ZeRO-3 offload, back to back on one GPU (issue 7)", **facts, "runs": {}}

  def write():
    write_results(args.out, report)

  if args.install:
    started = time.perf_counter()
    status = subprocess.call(["bash", "benchmarks/baselines/install_deepspeed.sh"], cwd=REPO,
                             env={**os.environ, "PYTHON": args.python})
    report["install_status"] = status
    report["install_s"] = round(time.perf_counter() - started, 1)
    write()
  (compare_accumulation if args.accumulation else compare_models)(args, report, write, out_dir)
  write()


if __name__ == "__main__":
  main()
