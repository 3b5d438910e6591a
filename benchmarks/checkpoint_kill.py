"""`kill -9` in the middle of a save, then the same train.py command again: it resumes from the last complete
checkpoint, and its losses for the steps both runs ran equal the killed run's.

  python -m benchmarks.checkpoint_kill --out=benchmarks/results/checkpoint_kill_during_save_h200.json   # one H200
  python -m benchmarks.checkpoint_kill --smoke --out=/tmp/checkpoint_kill_smoke.json                  # tiny, any machine

The run saves every --save_every steps and is killed (SIGKILL to its process group) once the save of step --kill_at
has written --kill_after_gb into its temporary directory (orbax's `<step>.orbax-checkpoint-tmp-*`): a save cut in half.
The same command then runs to --kill_at again; the results hold both runs' losses (their --loss_log), what the kill
left on disk, and what the second run resumed from and left.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.common import REPO, define_flags, provenance, write_results
from sljax.checkpoint import directory_bytes, partial_saves

define_flags("A tiny model on CPU: checks the code path in seconds.")
flags.DEFINE_string("workdir", "", "The run's workdir (default: a temporary directory, removed after).")
flags.DEFINE_list("model_args", ["--model=llama13b", "--set=num_layers=6", "--batch_size=8", "--seq_len=2048",
                                 "--warmup_steps=2", "--decay_steps=8", "--log_every=1"],
                  "train.py flags of both runs.")
flags.DEFINE_integer("save_every", 2, "--checkpoint_every of both runs.")
flags.DEFINE_integer("kill_at", 4, "The step whose save is killed (a multiple of --save_every after the first save).")
flags.DEFINE_float("kill_after_gb", 4.0, "Kill once the save has written this much.")
FLAGS = flags.FLAGS

SMOKE_MODEL = ["--model=llama-tiny", "--set=num_layers=2", "--set=hidden_size=32", "--set=intermediate_size=64",
               "--set=num_heads=2", "--set=num_kv_heads=1", "--seq_len=32", "--batch_size=2", "--max_tokens=200000",
               "--warmup_steps=2", "--decay_steps=8", "--log_every=1"]


def losses_of(log: str) -> dict[int, float]:
  losses = {}
  if os.path.exists(log):
    with open(log) as f:
      for line in f:
        if line.strip():
          record = json.loads(line)
          if "loss" in record and "eval" not in record:
            losses[record["step"]] = record["loss"]
  return losses


def listing(directory: str) -> list[str]:
  return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def main(argv):
  del argv
  model = SMOKE_MODEL if FLAGS.smoke else FLAGS.model_args
  kill_after = 0 if FLAGS.smoke else int(FLAGS.kill_after_gb * 1e9)
  root = FLAGS.workdir or tempfile.mkdtemp(prefix="checkpoint_kill_")
  os.makedirs(root, exist_ok=True)
  workdir = os.path.join(root, "run")
  shutil.rmtree(workdir, ignore_errors=True)
  checkpoints = os.path.join(workdir, "checkpoints")
  args = [sys.executable, "train.py", f"--workdir={workdir}", *model, f"--steps={FLAGS.kill_at}",
          f"--checkpoint_every={FLAGS.save_every}"]
  try:
    killed_log, resumed_log = os.path.join(root, "killed.jsonl"), os.path.join(root, "resumed.jsonl")
    print("$", " ".join(args[1:]), flush=True)
    start = time.perf_counter()
    with open(os.path.join(root, "killed.log"), "w") as out:
      process = subprocess.Popen([*args, f"--loss_log={killed_log}"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
      partial, written = None, 0
      while process.poll() is None:
        found = [path for path in partial_saves(checkpoints) if os.path.basename(path).startswith(f"{FLAGS.kill_at}.")]
        if found:
          written = directory_bytes(found[0])
          if written >= kill_after:
            os.killpg(process.pid, signal.SIGKILL)
            partial = found[0]
            break
        time.sleep(0.001 if FLAGS.smoke else 0.05)
      returncode = process.wait()
    killed_seconds = time.perf_counter() - start
    left = listing(checkpoints)
    print(f"killed: rc {returncode} after {killed_seconds:.1f} s, {written / 1e9:.2f} GB into the save of step "
          f"{FLAGS.kill_at}; checkpoints/ holds {left}", flush=True)
    start = time.perf_counter()
    done = subprocess.run([*args, f"--loss_log={resumed_log}"], cwd=REPO, capture_output=True, text=True)
    resumed_seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    with open(os.path.join(root, "resumed.log"), "w") as f:
      f.write(output)
    if done.returncode:
      print(output[-3000:], flush=True)
    killed, resumed = losses_of(killed_log), losses_of(resumed_log)
    both = sorted(set(killed) & set(resumed))
    diff = max((abs(resumed[s] - killed[s]) / abs(killed[s]) for s in both), default=None)
    resumed_from = [line.split("] ", 1)[-1] for line in output.splitlines() if "resumed from" in line]
    result = {
        **provenance(None), "train_command": " ".join(["python", *args[1:]]),
        "kill": {"returncode": returncode, "seconds": round(killed_seconds, 1), "during_save": partial is not None,
                 "save_step": FLAGS.kill_at, "bytes_written_when_killed": written,
                 "partial_directory": os.path.basename(partial) if partial else None,
                 "checkpoints_after_kill": left},
        "rerun": {"returncode": done.returncode, "seconds": round(resumed_seconds, 1), "resumed_from": resumed_from,
                  "checkpoints_after": listing(checkpoints), "tail": output[-2000:]},
        "losses": {"killed": killed, "resumed": resumed}, "steps_both_ran": both, "max_rel_diff": diff,
        "first_step_after_resume_equal": bool(both) and resumed[both[0]] == killed[both[0]],
    }
    write_results(FLAGS.out, result)
    print(f"steps both ran {both}: largest relative difference {diff}; rerun rc {done.returncode}, "
          f"{resumed_seconds:.1f} s, {resumed_from}; checkpoints/ now {listing(checkpoints)}")
  finally:
    if not FLAGS.workdir:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
