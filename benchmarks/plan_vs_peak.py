"""Is every plan an upper bound of what runs? Each case is a CLI command as a user types it, with --memory_peaks: its
plan's bytes per memory tier (as it prints them, to 0.1 GiB) against the peaks the run measured (the device
allocator's peak_bytes_in_use; the live arrays per memory kind, sampled by a thread).

  python -m benchmarks.plan_vs_peak --out=benchmarks/results/plan_vs_peak_h200.json            # one H200
  python -m benchmarks.plan_vs_peak --cases=llama7b_offload,generate_llama70b_int4 --out=/tmp/some.json
  python -m benchmarks.plan_vs_peak --smoke --out=/tmp/plan_vs_peak_smoke.json                  # tiny, any machine

A plan holds (`within_plan`) when, per tier, the measured peak is at most the planned total. The device's planned
total includes the planning core's margin (sljax.footprint.GPU_MARGIN_BYTES on a GPU), which is there for what no
count sees; `device_peak_over_plan_less_margin_gib` says how much of it the run took.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.common import REPO, define_flags, provenance, write_results
from sljax.footprint import MARGIN
from sljax.machines import GIB

PROMPTS = 128  # generation: prompts of PROMPT_BYTES bytes each, as the user typed them
PROMPT_BYTES = 511
CASES = {
    "llama13b_readme": ["train.py", "--model=llama13b", "--steps=4", "--checkpoint_every=0"],
    # llama7b's state fits one H200, where train.py runs the on-device step (no plan): the offload engine's plan
    "llama7b_offload": ["train.py", "--model=llama7b", "--engine=offload", "--steps=5", "--checkpoint_every=0"],
    "lora_llama70b": ["train.py", "--model=llama70b", "--set=param_dtype=bfloat16", "--lora_rank=16", "--seq_len=2048",
                      "--steps=3", "--checkpoint_every=0"],
    "generate_llama70b_int4": ["generate.py", "--model=llama70b", "--random_weights", "--set=dtype=bfloat16",
                               "--streamed_bits=4", "--max_new_tokens=32", "--prompt_file={prompts}"],
}
TINY = ["--model=llama-tiny", "--set=num_layers=2", "--set=hidden_size=32", "--set=intermediate_size=64",
        "--set=num_heads=2", "--set=num_kv_heads=1"]
SMOKE_CASES = {
    "train_offload": ["train.py", *TINY, "--seq_len=32", "--batch_size=4", "--steps=3", "--checkpoint_every=0",
                      "--engine=offload", "--sub_batches=2", "--grad_clip_norm=1"],
    "lora": ["train.py", *TINY, "--seq_len=32", "--batch_size=4", "--steps=3", "--checkpoint_every=0",
             "--lora_rank=2"],
    "generate": ["generate.py", *TINY, "--random_weights", "--max_new_tokens=4", "--prompt_file={prompts}",
                 "--resident_layers=1"],
}

define_flags("Tiny CPU cases of each planner (training, LoRA, generation): checks the code path in seconds.")
flags.DEFINE_list("cases", list(CASES), f"Cases to run, in order: {', '.join(CASES)}.")
flags.DEFINE_integer("timeout", 560, "Seconds each command may run.")
FLAGS = flags.FLAGS

TIER = re.compile(r"^\s*(device|pinned host): (?P<used>[\d.]+) of (?P<budget>[\d.]+) GiB \((?P<parts>.*)\)$", re.M)
PEAKS = re.compile(r"^memory peaks: (\{.*\})$", re.M)
MARGIN_PART = re.compile(re.escape(MARGIN) + r" (?P<gib>[\d.]+)")


def planned(log: str) -> dict:
  """The first plan the command printed: {tier: {"gib", "budget_gib", "parts"}}, device and pinned host."""
  tiers = {}
  for match in TIER.finditer(log):
    tiers.setdefault(match[1].replace(" ", "_"), {"gib": float(match["used"]), "budget_gib": float(match["budget"]),
                                                   "parts": match["parts"]})
  return tiers


def compare(plan: dict, peaks: dict) -> dict:
  """Per tier, the measured peak against the plan (GiB), and whether it holds."""
  device_peak = peaks.get("device_allocator") or peaks.get("device", 0)
  margin = MARGIN_PART.search(plan["device"]["parts"])
  margin_gib = float(margin["gib"]) if margin else 0.0
  rows = {
      "device": {"planned_gib": plan["device"]["gib"], "measured_gib": device_peak / GIB,
                 "measured_is": "allocator peak" if peaks.get("device_allocator") else "live arrays (no allocator)",
                 "live_arrays_gib": peaks.get("device", 0) / GIB, "margin_gib": margin_gib},
      "pinned_host": {"planned_gib": plan["pinned_host"]["gib"], "measured_gib": peaks.get("pinned_host", 0) / GIB,
                      "measured_is": "live arrays"},
  }
  for row in rows.values():
    row["within_plan"] = row["measured_gib"] <= row["planned_gib"]
  rows["device_peak_over_plan_less_margin_gib"] = rows["device"]["measured_gib"] - (
      rows["device"]["planned_gib"] - margin_gib)
  return rows


def run_case(name: str, command: list[str], tmp: str, smoke: bool) -> dict:
  prompts = os.path.join(tmp, "prompts.txt")
  with open(prompts, "w") as f:
    f.writelines(("x" * PROMPT_BYTES if not smoke else "hello") + "\n" for _ in range(PROMPTS if not smoke else 2))
  script, *args = [part.format(prompts=prompts) for part in command]
  args += ["--memory_peaks"] + ([f"--workdir={os.path.join(tmp, name)}"] if script == "train.py" else [])
  started = time.perf_counter()
  done = subprocess.run([sys.executable, os.path.join(REPO, script), *args], cwd=REPO, capture_output=True, text=True,
                        timeout=FLAGS.timeout, check=False)
  log = done.stdout + done.stderr
  row = {"case": name, "command": " ".join(["python", script, *args]).replace(prompts, f"<{PROMPTS} prompts>"),
         "returncode": done.returncode, "wall_seconds": round(time.perf_counter() - started, 1)}
  plan, peaks = planned(log), PEAKS.search(log)
  if done.returncode or not peaks or set(plan) != {"device", "pinned_host"}:
    return {**row, "error": log[-3000:]}
  row.update(plan=plan, peaks_bytes=json.loads(peaks[1]), **compare(plan, json.loads(peaks[1])))
  row["within_plan"] = row["device"]["within_plan"] and row["pinned_host"]["within_plan"]
  row["throughput_lines"] = [line for line in log.splitlines() if "tok/s" in line][-3:]
  return row


def main(argv):
  del argv
  if not FLAGS.out:
    raise app.UsageError("--out is required")
  cases = SMOKE_CASES if FLAGS.smoke else {name: CASES[name] for name in FLAGS.cases}
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, command in cases.items():
      results.append(run_case(name, command, tmp, FLAGS.smoke))
      row = results[-1]
      print(f"{name}: " + (f"rc {row['returncode']}: {row['error'][-400:]}" if "error" in row else
                           f"device {row['device']['measured_gib']:.2f} of {row['device']['planned_gib']:.1f} GiB "
                           f"planned, pinned host {row['pinned_host']['measured_gib']:.2f} of "
                           f"{row['pinned_host']['planned_gib']:.1f}: within plan {row['within_plan']}"), flush=True)
      # The parent starts no backend (a GPU one would take memory from the cases, which run in child processes).
      write_results(FLAGS.out, {**provenance(None), "results": results})


if __name__ == "__main__":
  app.run(main)
