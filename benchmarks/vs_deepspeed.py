"""sljax against DeepSpeed ZeRO-3 offload (issue 7): both systems back to back on the same GPU, one JSON with the ratio.

  python3 -m benchmarks.vs_deepspeed --install --models=llama13b \
      --out=benchmarks/results/vs_deepspeed_llama13b_h200.json
  python3 -m benchmarks.vs_deepspeed --smoke --out=/tmp/vs.json          # tiny model on a CPU: checks the code paths

For each model the two systems run one after the other, each in its own process (each owns the whole GPU while it
runs), on the same sequence length and effective batch, with the same MFU formula (models.ModelConfig.flops_per_token:
6 x matmul params + causal attention, recompute not counted, 989 TFLOP/s dense bf16 peak):
  sljax      benchmarks.train_throughput: the engine under the plan for the budgets (llama13b: the "big" case)
  DeepSpeed  benchmarks.baselines.deepspeed_zero3: HF LlamaForCausalLM, bf16, activation checkpointing, ZeRO-3 with
             offload_param + offload_optimizer to pinned CPU memory (partial optimizer offload where the host cannot
             hold all of it: --ds_host_mem_gib)
Models: llama13b (batch 32 x 2048, the engine benchmark's workload) and fits (llama7b shapes with 8 layers, batch
16 x 2048: the model that fits on one GPU). The JSON is rewritten after every run, so a time-out keeps what finished.
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

WORKLOADS = {
    # name: (sljax train_throughput.py flags, deepspeed_zero3.py flags)
    "llama13b": (["--cases=big", "--big_batch=32", "--trace_cases="],  # --timeout_s leaves no time for a traced step
                 ["--model=llama13b", "--batch=32", "--micro_batch=16"]),
    "fits": (["--cases=fits", "--fits_cases=engine", "--fits_model=llama7b", "--fits_set=num_layers=8",
              "--fits_batch=16"],
             ["--model=llama7b", "--override=num_layers=8", "--batch=16", "--micro_batch=16"]),
}


def run(name, argv, timeout, log_path):
  """Runs one system, stopped with SIGTERM after `timeout` seconds (both scripts write their JSON on it); returns
  (exit status, seconds). Output goes to the terminal and to log_path."""
  print(f"== {name}: {' '.join(shlex.quote(a) for a in argv)}", flush=True)
  start = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.terminate)
    timer.start()
    for line in proc.stdout:
      sys.stdout.write(line)
      log.write(line)
    status = proc.wait()
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
          "peak_device_bytes", "peak_host_rss_bytes", "engine")
  return {"status": "ok", **{k: result[k] for k in keys if k in result}, "command": data.get("command"),
          "device": data.get("device"), "versions": data.get("versions")}


def deepspeed_summary(data, args):
  """The baseline's JSON; a run stopped after all its timed steps (in teardown) still counts, from its step times."""
  steps = data.get("step_s") or []
  if data.get("status") != "ok" and len(steps) == args.ds_steps:
    mean = sum(steps) / len(steps)
    tokens = data["config"]["tokens_per_step"]
    data = {**data, "status": "ok", "step_s_mean": round(mean, 4), "tokens_per_s": round(tokens / mean, 1),
            "mfu": round(tokens / mean * data["flops_per_token"] / data["peak_flops"], 5),
            "stopped_after_timed_steps": f"all {len(steps)} timed steps finished; stopped in phase {data.get('phase')!r}"}
  return data


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--models", default="llama13b,fits", help="comma-separated: " + ", ".join(WORKLOADS))
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--sljax_steps", type=int, default=3, help="timed sljax steps (after one warm-up)")
  ap.add_argument("--ds_steps", type=int, default=2, help="timed DeepSpeed steps (after one warm-up)")
  ap.add_argument("--ds_host_mem_gib", type=float, default=240, help="host RAM DeepSpeed may fill (offload ratio)")
  ap.add_argument("--sljax_host_memory_gib", type=float, default=85, help="pinned host memory of sljax's plan")
  ap.add_argument("--timeout_s", type=float, default=420, help="per run; a run past it is stopped and reported")
  ap.add_argument("--install", action="store_true", help="install DeepSpeed from .dsdeps first")
  ap.add_argument("--python", default=sys.executable)
  ap.add_argument("--smoke", action="store_true", help="tiny shapes on any machine")
  ap.add_argument("--out", default="")
  args = ap.parse_args()

  out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else "/tmp"
  os.makedirs(out_dir, exist_ok=True)
  # The device is the children's: this process never starts a backend, which would hold the GPU they need.
  report = {"benchmark": "sljax vs DeepSpeed ZeRO-3 offload, back to back on one GPU (issue 7)",
            **provenance(device=None), "host": platform.node(), "runs": {}}

  def write():
    write_results(args.out, report)

  if args.install:
    status = subprocess.call(["bash", "benchmarks/baselines/install_deepspeed.sh"], cwd=REPO,
                             env={**os.environ, "PYTHON": args.python})
    report["install_status"] = status
    write()

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
              f"--host_memory_gib={args.sljax_host_memory_gib}", f"--out={s_json}"] + (["--smoke"] if args.smoke else [])
    d_argv = [args.python, "-m", "benchmarks.baselines.deepspeed_zero3", *([] if args.smoke else theirs),
              f"--seq={args.seq}", "--warmup=1", f"--steps={args.ds_steps}", "--offload_ratio=auto",
              f"--host_mem_gib={args.ds_host_mem_gib}", f"--out={d_json}"] + (["--smoke"] if args.smoke else [])
    entry = report["runs"][name] = {}
    status, seconds = run(f"sljax {name}", s_argv, args.timeout_s, os.path.join(out_dir, f"sljax_{name}.log"))
    entry["sljax"] = {**sljax_summary(read_json(s_json), case), "exit_status": status, "wall_s": round(seconds, 1)}
    report["device"] = report["device"] or entry["sljax"].get("device")
    write()
    status, seconds = run(f"deepspeed {name}", d_argv, args.timeout_s, os.path.join(out_dir, f"deepspeed_{name}.log"))
    entry["deepspeed"] = {**deepspeed_summary(read_json(d_json), args), "exit_status": status,
                          "wall_s": round(seconds, 1)}
    ok = entry["sljax"].get("status") == "ok" and entry["deepspeed"].get("status") == "ok"
    entry["ratio_tokens_per_s"] = (entry["sljax"]["tokens_per_s"] / entry["deepspeed"]["tokens_per_s"]) if ok else None
    write()
    print(f"== {name}: sljax {entry['sljax'].get('tokens_per_s', float('nan')):,.0f} tok/s, DeepSpeed "
          f"{entry['deepspeed'].get('tokens_per_s') or float('nan'):,.0f} tok/s, ratio {entry['ratio_tokens_per_s']}",
          flush=True)


if __name__ == "__main__":
  main()
