"""generate.py as a user types it, beside benchmarks.generate_throughput on the same plan: does the CLI run what the
benchmark measures?

  python -m benchmarks.generate_py_run --out=benchmarks/results/generate_py_llama70b_int4_h200.json    # one H200
  python -m benchmarks.generate_py_run --smoke --out=/tmp/generate_py_smoke.json                      # tiny, any machine

Three child processes, each with its own backend: `generate.py ... --plan` (the plan the command will run),
`generate.py ...` itself (its per-batch lines: rows, prompt pass, decode passes, generated tok/s), and the benchmark
at the plan's batch. The plans are compared as printed (`same_plan`); the CLI's throughput is its batches after the
first (the first compiles), against the benchmark's timed generation (after its warm-up).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.common import GENERATION_SMOKE, REPO, define_flags, provenance, write_results

PROMPTS, PROMPT_BYTES, NEW_TOKENS = 128, 511, 32  # the user: 128 prompts of 511 bytes, 32 new tokens
COMMAND = ["--model=llama70b", "--random_weights", "--set=dtype=bfloat16", "--streamed_bits=4"]
# The benchmark's smoke layout (benchmarks.generate_throughput --smoke), fixed here too so that both run one plan.
SMOKE = ["--model=llama-tiny", *(f"--set={k}={v}" for k, v in GENERATION_SMOKE["llama"].items()),
         "--set=dtype=bfloat16", "--set=param_dtype=bfloat16", "--random_weights", "--batch=4", "--sub_batches=2",
         "--resident_layers=1", "--kv_on_host"]
SMOKE_PROMPT_BYTES = 16

define_flags("A tiny model, 8 prompts, 4 new tokens: checks the code path in seconds.")
flags.DEFINE_integer("timeout", 560, "Seconds each child may run.")
FLAGS = flags.FLAGS

BATCH = re.compile(r"^batch (?P<index>\d+) of (?P<batches>\d+): (?P<rows>\d+) rows, .*: (?P<tps>[\d.]+) generated "
                   r"tok/s$", re.M)
PLAN_LINES = re.compile(r"^(batch \d+ = |weights |KV cache: |device: |pinned host: |per decode pass: |estimate: )")


def run(args: list[str]) -> tuple[str, float]:
  started = time.perf_counter()
  done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=FLAGS.timeout,
                        check=False)
  log = done.stdout + done.stderr
  if done.returncode:
    raise SystemExit(f"{' '.join(args)} failed (rc {done.returncode}):\n{log[-3000:]}")
  return log, time.perf_counter() - started


def plan_text(log: str, after: str) -> str:
  """The plan's description as printed after the line that starts with `after`."""
  lines = log[log.index(after):].splitlines()[1:]
  return "\n".join(line for line in lines[:12] if PLAN_LINES.match(line))


def main(argv):
  del argv
  if not FLAGS.out:
    raise app.UsageError("--out is required")
  prompts, prompt_bytes, new_tokens, command = ((8, SMOKE_PROMPT_BYTES, 4, SMOKE) if FLAGS.smoke else
                                                (PROMPTS, PROMPT_BYTES, NEW_TOKENS, COMMAND))
  with tempfile.TemporaryDirectory() as tmp:
    prompt_file = os.path.join(tmp, "prompts.txt")
    with open(prompt_file, "w") as f:
      f.writelines("x" * prompt_bytes + "\n" for _ in range(prompts))
    cli = ["generate.py", *command, f"--max_new_tokens={new_tokens}", f"--prompt_file={prompt_file}"]
    planned, _ = run([*cli, "--plan"])
    cli_plan = plan_text(planned, "plan for ")
    log, cli_seconds = run(cli)
    batches = [{"rows": int(m["rows"]), "tokens_per_s": float(m["tps"])} for m in BATCH.finditer(log)]
    rows = batches[0]["rows"]
    out = os.path.join(tmp, "benchmark.json")
    sets = [arg.replace("--set=", "") for arg in command if arg.startswith("--set=")]
    bench = ["-m", "benchmarks.generate_throughput", f"--models={command[0].split('=')[1]}", f"--batch={rows}",
             f"--prompt_len={prompt_bytes}", f"--new_tokens={new_tokens}", f"--out={out}",
             *[arg for arg in command if arg.startswith(("--streamed_bits", "--resident_layers"))]]
    if FLAGS.smoke:
      bench.append("--smoke")
    bench_log, _ = run(bench)
    with open(out) as f:
      measured = json.load(f)["results"][0]
  steady = batches[1:] or batches
  cli_tps = sum(b["tokens_per_s"] for b in steady) / len(steady)
  bench_plan = plan_text(bench_log, f"{command[0].split('=')[1]}: plan")
  result = {
      "cli_command": " ".join(["python", *cli]).replace(prompt_file, f"<{prompts} prompts of {prompt_bytes} bytes>"),
      "benchmark_command": " ".join(["python", *bench]).replace(out, "<tmp>"),
      "cli_batches": batches, "cli_wall_seconds": round(cli_seconds, 1),
      "cli_tokens_per_s_steady": cli_tps,
      "benchmark_tokens_per_s": measured["generation_tokens_per_s"],
      "cli_over_benchmark": cli_tps / measured["generation_tokens_per_s"],
      "cli_plan": cli_plan, "benchmark_plan": bench_plan, "same_plan": cli_plan == bench_plan,
  }
  print(f"CLI {cli_tps:.1f} tok/s (batches after the first), benchmark {result['benchmark_tokens_per_s']:.1f} tok/s: "
        f"{result['cli_over_benchmark']:.3f}; same plan: {result['same_plan']}", flush=True)
  write_results(FLAGS.out, {**provenance(None), **result})


if __name__ == "__main__":
  app.run(main)
