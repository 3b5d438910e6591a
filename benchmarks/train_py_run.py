"""A train.py command run as a user types it, with what it printed, its losses and its throughput in one JSON.

  python -m benchmarks.train_py_run --out=benchmarks/results/train_py_llama13b_default_h200.json \
      -- --model=llama13b --steps=40 --checkpoint_every=0          # one H200
  python -m benchmarks.train_py_run --smoke --out=/tmp/train_py_smoke.json                  # tiny, any machine

The command's output goes to the JSON's `log` file beside it (`--log`). Throughput is the trainer's own: each log
window's tokens/s, MFU (model FLOPs, no recompute) and HFU (recompute counted; a log from before the trainer printed
it has none) as its progress bar printed them; "steady" is over every window after the first (whose step compiles),
weighted by the window's steps. Goals (from the issues that asked for them): the plan is compute-bound; steady
MFU >= 45% for full training (the README command's), steady >= 2,000 tok/s and MFU >= 55% for LoRA on an int4 base
(QLoRA), no throughput goal for LoRA on a bf16 base; no step's loss above 1.05 x the first step's, and the last ten
steps' mean loss below the first ten's.
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
SMOKE_ARGS = ["--model=llama-tiny", "--set=num_layers=2", "--set=hidden_size=32", "--set=intermediate_size=64",
              "--set=num_heads=2", "--set=num_kv_heads=1", "--seq_len=32", "--batch_size=4", "--max_tokens=200000",
              "--steps=12", "--log_every=4", "--checkpoint_every=0", "--engine=offload", "--sub_batches=2"]

define_flags("A tiny model on CPU: checks the code path in seconds.")
flags.DEFINE_string("log", "", "Write the command's output here (default: the JSON's path with .log).")
FLAGS = flags.FLAGS

# The trainer's progress bar: "loss 11.426 | 2,053 tok/s | MFU 16.5% | HFU 21.9%: ... 10/12 [...]", with
# " | eval 2.310" before the colon once an --eval_every evaluation ran (metrics.progress_description); older logs
# have no HFU
WINDOW = re.compile(r"loss (?P<loss>[\d.]+) \| (?P<tps>[\d,]+) tok/s \| MFU (?P<mfu>[\d.]+%|n/a)"
                    r"(?: \| HFU (?P<hfu>[\d.]+%|n/a))?(?: \| eval [\d.]+)?:\s+\d+%\|[^|]*\| (?P<step>\d+)/\d+")


def _fraction(percent: str | None) -> float | None:
  return None if percent in (None, "n/a") else float(percent[:-1]) / 100


def windows(log: str) -> list[dict]:
  """The trainer's log windows, in order: {"last_step", "steps", "tokens_per_s", "mfu", "hfu", "mean_loss"} (hfu
  None where the log has none). A window's numbers first appear on the progress bar at the step that closed it."""
  seen, out = set(), []
  for match in WINDOW.finditer(log):
    key = (match["loss"], match["tps"], match["mfu"], match["hfu"])
    if key in seen:
      continue
    seen.add(key)
    out.append({"last_step": int(match["step"]), "tokens_per_s": float(match["tps"].replace(",", "")),
                "mfu": _fraction(match["mfu"]), "hfu": _fraction(match["hfu"]), "mean_loss": float(match["loss"])})
  previous = 0
  for window in out:
    window["steps"], previous = window["last_step"] - previous, window["last_step"]
  return out


def throughput_goals(command: list[str], tokens_per_s: float | None, mfu: float | None) -> list[tuple]:
  """(name, steady value, least) of the throughput goals the command's kind has: full training, the README
  command's MFU; LoRA on an int4 base, QLoRA's tok/s and MFU (no recompute counted); LoRA on a bf16 base, none."""
  flag = lambda name: next((arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")), None)
  if flag("lora_rank") in (None, "0"):
    return [("mfu_steady", mfu, 0.45)]
  if flag("base_bits") == "4":
    return [("tokens_per_s_steady", tokens_per_s, 2000), ("mfu_steady", mfu, 0.55)]
  return []


def summarize(command: list[str], log: str, losses: list[float | None], seconds: float, returncode: int) -> dict:
  lines = log.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith("plan for ")), None)
  plan = None
  if start is not None:
    # The full engine's plan ends with "step time bound: ... -> compute-bound", the LoRA plan's with "(compute-bound)".
    end = next((i for i in range(start, len(lines)) if re.search(r"(compute|transfer)-bound\)?$", lines[i])), start)
    plan = "\n".join(lines[start:end + 1])
  found = windows(log)
  steady = found[1:]
  steady_steps = sum(w["steps"] for w in steady)
  seconds_steady = sum(w["steps"] / w["tokens_per_s"] for w in steady)
  tokens_per_s = steady_steps / seconds_steady if steady else None
  steady_mean = lambda name: (sum(w["steps"] / w["tokens_per_s"] * w[name] for w in steady) / seconds_steady
                               if steady and all(w[name] is not None for w in steady) else None)
  mfu = steady_mean("mfu")
  finite = [x for x in losses if x is not None]
  ten = min(10, len(losses) // 2)
  goals = {
      "plan_compute_bound": None if plan is None else plan.rstrip().rstrip(")").endswith("compute-bound"),
      **{f"{name}_ge_{least:g}": None if value is None else value >= least
         for name, value, least in throughput_goals(command, tokens_per_s, mfu)},
      "no_loss_above_1.05x_first": bool(finite) and len(finite) == len(losses) and max(finite) <= 1.05 * losses[0],
      "last_mean_below_first_mean": bool(ten) and None not in losses and (
          sum(losses[-ten:]) / ten < sum(losses[:ten]) / ten),
  }
  device = re.search(r"compute on (.+?); workdir", log)
  peaks = re.search(r"^memory peaks: (\{.*\})$", log, re.MULTILINE)  # train.py --memory_peaks (bytes)
  return {
      **provenance(device[1] if device else None), "command": " ".join(["python", "train.py", *command]),
      "returncode": returncode,
      "wall_seconds": round(seconds, 1),
      "notes": [line for line in lines if line.startswith("note:")],
      "recipe": next((line for line in lines if line.startswith("recipe of ")), None),
      "plan": plan, "windows": found,
      "steps_in_steady_window": f"{found[0]['last_step'] + 1}-{found[-1]['last_step']}" if steady else None,
      "tokens_per_s_steady": tokens_per_s, "mfu_steady": mfu, "hfu_steady": steady_mean("hfu"), "losses": losses,
      "memory_peaks": json.loads(peaks[1]) if peaks else None, "goals": goals,
  }


def main(argv):
  command = SMOKE_ARGS if FLAGS.smoke else argv[1:]
  if not command:
    raise app.UsageError("give train.py's flags after --, or --smoke")
  if not FLAGS.out:
    raise app.UsageError("--out is required")
  log_path = FLAGS.log or os.path.splitext(FLAGS.out)[0] + ".log"
  with tempfile.TemporaryDirectory() as tmp:
    loss_log = os.path.join(tmp, "losses.jsonl")
    extra = [f"--loss_log={loss_log}"] + ([f"--workdir={os.path.join(tmp, 'run')}"] if FLAGS.smoke else [])
    started = time.perf_counter()
    with open(log_path, "w") as log_file:
      done = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *command, *extra], cwd=REPO,
                            stdout=log_file, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in open(loss_log)] if os.path.exists(loss_log) else []
    rows = [row for row in rows if not row.get("eval")]  # --eval_every's lines hold eval_loss, not a step's loss
  log = open(log_path).read()
  result = summarize(command, log, [row["loss"] for row in sorted(rows, key=lambda row: row["step"])], seconds,
                     done.returncode)
  write_results(FLAGS.out, result)
  print(json.dumps({k: result[k] for k in ("tokens_per_s_steady", "mfu_steady", "hfu_steady", "goals", "returncode")},
                   indent=1))
  print("losses:", " ".join("nan" if x is None else f"{x:.3f}" for x in result["losses"]))
  if done.returncode:
    print(log[-3000:])
    sys.exit(done.returncode)


if __name__ == "__main__":
  app.run(main)
