"""A checkpoint saved under one plan, resumed under others, beside the uninterrupted run: train.py commands as a user
types them, each run's losses (its --loss_log) and wall time in one JSON.

  python -m benchmarks.resume_placement --out=benchmarks/results/resume_placement_h200.json     # one H200
  python -m benchmarks.resume_placement --smoke --out=/tmp/resume_placement_smoke.json          # tiny, any machine

The saving plan is --saved (the offload engine at --device_memory_gib=40, by default); each --resumed plan resumes
the same checkpoint (--checkpoint_every=0: a resume writes nothing, so every plan starts from the one checkpoint) and
runs to --steps. The schedule is fixed (--warmup_steps, --decay_steps) so that a run's --steps does not move it.
Printed: one line per step with every run's loss, then the largest relative difference of each resumed run from the
uninterrupted one.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.common import REPO, define_flags, provenance, write_results

define_flags("A tiny model on CPU: checks the code path in seconds.")
flags.DEFINE_string("workdir", "", "Where the runs' workdirs go (default: a temporary directory, removed after).")
flags.DEFINE_integer("steps", 6, "Steps of the uninterrupted and resumed runs.")
flags.DEFINE_integer("save_at", 3, "The saving run's last step, saved.")
flags.DEFINE_list("model_args", ["--model=llama13b", "--set=num_layers=12", "--batch_size=8", "--seq_len=2048",
                                 "--warmup_steps=2", "--decay_steps=6", "--log_every=1"],
                  "train.py flags of every run.")
flags.DEFINE_list("saved", ["--engine=offload", "--device_memory_gib=40"], "The saving (and uninterrupted) plan.")
flags.DEFINE_multi_string("resumed", ["--engine=offload", "--engine=device"],
                          "A resumed run's plan, comma-separated flags; once per run.")
flags.DEFINE_bool("spread", False, "Also run each resumed plan uninterrupted from step 1: how far two engines' own "
                  "runs differ, the spread a resumed run's losses are judged by.")
FLAGS = flags.FLAGS

SMOKE_MODEL = ["--model=llama-tiny", "--set=num_layers=4", "--set=hidden_size=32", "--set=intermediate_size=64",
               "--set=num_heads=2", "--set=num_kv_heads=1", "--seq_len=32", "--batch_size=4", "--max_tokens=200000",
               "--warmup_steps=2", "--decay_steps=6", "--log_every=1"]
SMOKE_SAVED = ["--engine=offload", "--sub_batches=2", "--live_layers=1", "--tail_layers=1"]
SMOKE_RESUMED = [["--engine=device"]]  # the offload engine under other groups: tests/test_train.py and test_checkpoint.py


def run(name: str, workdir: str, args: list[str], log: str) -> dict:
  """One train.py command; its losses by step (from `log`), return code, seconds and the output's tail."""
  command = [sys.executable, "train.py", f"--workdir={workdir}", f"--loss_log={log}", *args]
  print("$", " ".join(command[1:]), flush=True)
  start = time.perf_counter()
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  seconds = time.perf_counter() - start
  losses = {}
  if os.path.exists(log):
    with open(log) as f:
      for line in f:
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
  output = done.stdout + done.stderr
  if done.returncode:
    print(output[-3000:], flush=True)
  notes = [line for line in output.splitlines() if line.startswith(("plan for", "note:", "sljax:"))
           or "resumed from" in line or "keep master weights" in line or "cast" in line]
  return {"name": name, "command": command[1:], "returncode": done.returncode, "seconds": round(seconds, 1),
          "losses": losses, "notes": notes, "tail": output[-2000:]}


def main(argv):
  del argv
  model, saved = (SMOKE_MODEL, SMOKE_SAVED) if FLAGS.smoke else (FLAGS.model_args, FLAGS.saved)
  resumed = SMOKE_RESUMED if FLAGS.smoke else [plan.split(",") for plan in FLAGS.resumed]
  root = FLAGS.workdir or tempfile.mkdtemp(prefix="resume_placement_")
  os.makedirs(root, exist_ok=True)
  steps = [f"--steps={FLAGS.steps}"]
  try:
    log = lambda index: os.path.join(root, f"losses_{index}.jsonl")
    runs = [run("uninterrupted", os.path.join(root, "uninterrupted"),
                [*model, *saved, *steps, "--checkpoint_every=0"], log(0))]
    write_results(FLAGS.out, {**provenance(None), "runs": runs})  # after each run: a run cut short keeps the others
    shared = os.path.join(root, "saved")  # the resumed runs save nothing: each starts from the one checkpoint
    runs.append(run("saved", shared, [*model, *saved, f"--steps={FLAGS.save_at}",
                                      f"--checkpoint_every={FLAGS.save_at}", "--keep_checkpoints=1"], log(1)))
    for index, plan in enumerate(resumed, 2):
      runs.append(run("resumed " + " ".join(plan), shared, [*model, *plan, *steps, "--checkpoint_every=0"],
                      log(index)))
      write_results(FLAGS.out, {**provenance(None), "runs": runs})
      if FLAGS.spread:
        runs.append(run("uninterrupted " + " ".join(plan), os.path.join(root, f"alone_{index}"),
                        [*model, *plan, *steps, "--checkpoint_every=0"], log(f"alone_{index}")))
  finally:
    if not FLAGS.workdir:
      shutil.rmtree(root, ignore_errors=True)
  reference = runs[0]["losses"]
  print("step  " + "  ".join(f"{r['name']:>24}" for r in runs))
  for step in range(1, FLAGS.steps + 1):
    print(f"{step:4d}  " + "  ".join(f"{r['losses'].get(step) or float('nan'):24.6f}" for r in runs))
  for r in runs[1:]:
    common = [s for s in r["losses"] if s in reference and reference[s] and r["losses"][s]]
    r["max_rel_diff"] = max((abs(r["losses"][s] - reference[s]) / abs(reference[s]) for s in common), default=None)
    print(f"{r['name']}: steps {sorted(r['losses'])}, largest relative difference from uninterrupted "
          f"{r['max_rel_diff']}, rc {r['returncode']}, {r['seconds']} s")
  write_results(FLAGS.out, {**provenance(None), "runs": runs})  # the parent starts no backend: the runs' memory


if __name__ == "__main__":
  app.run(main)
