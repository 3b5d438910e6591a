"""Generates text with a model larger than the GPU: weights and KV caches stream through pinned host memory.

  python generate.py --model llama-tiny --random_weights --prompt_file prompts.txt --max_new_tokens 32
  python generate.py --checkpoint runs/llama-tiny --prompt_file prompts.txt --temperature 0.8 --top_p 0.95
  python generate.py --lora_checkpoint runs/llama7b-lora --tokenizer Llama-2-7b-hf/tokenizer.json \\
      --prompt_file prompts.txt
  python generate.py --hf_dir Llama-2-70b-hf --tokenizer Llama-2-70b-hf/tokenizer.json --set dtype=bfloat16 \\
      --prompt_file prompts.txt --batch 64 --stop_token 2
  python generate.py --model llama70b --set dtype=bfloat16 --prompt_len 512 --max_new_tokens 32 --plan

One prompt per line of --prompt_file (blank lines skipped); prints one JSON line per prompt, in order:
{"prompt", "completion", "tokens": ids generated, the stop token included}. The layout (batch, sub-batches, resident
layers, where the KV cache lives) comes from sljax.generate_plan.plan, except what the flags fix; --plan prints it and
exits. Every flag is a field of sljax.generate_launch.GenerateConfig or sljax.generate.SamplingConfig. Installed
(pip install .), `sljax-generate` is the same command.
"""

import json
import sys

from absl import logging

from models.presets import PRESETS
from sljax import generate_launch
from sljax.cli import run_command
from sljax.flags import define
from sljax.generate import SamplingConfig
from sljax.machines import configure_process, default_host_budget_help

REQUEST = define(generate_launch.GenerateConfig, rename={"overrides": "set"},
                 unset={"model": generate_launch.DEFAULT_MODEL}, help={
                     "model": f"Model preset: {', '.join(PRESETS)}",
                     "host_memory_gib": f"Pinned host memory the plan may use (0: {default_host_budget_help()})."})
# SamplingConfig's comments are not all help: these are.
SAMPLING = define(SamplingConfig, rename={"stop_tokens": "stop_token"}, skip=("pad_token",), help={
    "max_new_tokens": "Tokens generated per prompt, at most.", "temperature": "Sampling temperature (0: greedy).",
    "top_p": "Nucleus sampling: keep the most likely tokens up to this mass.",
    "stop_tokens": "A row ends after generating this token id (repeatable).",
    "seed": "Seeds sampling and --random_weights."})


def run() -> list[dict]:
  """Checks the request, then generates; returns the printed records. Bad requests exit with one line."""
  try:
    job = generate_launch.prepare(REQUEST.build(), SAMPLING.build())
  except ValueError as error:
    raise SystemExit(f"sljax: {error}") from None
  if job.request.plan:
    return []
  records = []
  try:
    for record in generate_launch.generate(job):
      records.append(record)
      print(json.dumps(record, ensure_ascii=False), flush=True)
  except generate_launch.NonFiniteWeights as error:  # found as the weights are read, group by group
    raise SystemExit(f"sljax: {error}") from None
  return records


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"sljax: unexpected arguments {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)  # stdout is the JSON lines; libraries' INFO chatter would bury them
  try:  # before anything touches a device: XLA's limits are what the plan's default budgets read
    configure_process(REQUEST.build().host_memory_gib)
  except ValueError as error:
    raise SystemExit(f"sljax: {error}") from None
  run()


def console():
  """`sljax-generate` and `python generate.py`."""
  run_command(sys.modules[__name__])
