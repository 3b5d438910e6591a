"""Trains a decoder-only LM: `python train.py` fits llama-tiny on the embedded stdlib corpus in a few CPU minutes.

  python train.py --model llama-tiny --set num_layers=8 --steps 1000 --batch_size 16
  python train.py --model opt-125m --data c4/en --tokenizer tokenizer.json --seq_len 1024 --workdir runs/opt
  python train.py --hf_dir Llama-2-7b-hf --lora_rank 16 --lora_targets q_proj,v_proj --workdir runs/llama7b-lora

Every flag is a field of a config dataclass (sljax.request's LaunchConfig and ClusterConfig, DataConfig, OptimConfig,
RunConfig, sljax.lora.model.LoraConfig), its default the field's or the preset's training recipe's
(sljax.optim.RECIPES); sljax.launch makes every decision. A run resumes from the newest checkpoint in --workdir.
Installed (pip install .), `sljax-train` is the same command.
"""

import dataclasses
import logging as std_logging
import os
import sys

from absl import logging

import models
import sljax
from models.presets import PRESETS
from sljax import launch
from sljax.checkpoint import CheckpointCorruptError, CheckpointMismatchError, CheckpointWriteError, DiskSpaceError
from sljax.cli import run_command
from sljax.data import DataConfig
from sljax.flags import define
from sljax.lora.model import LoraConfig
from sljax.machines import configure_process, default_host_budget_help
from sljax.optim import OptimConfig
from sljax.request import DEFAULT_MODEL, FINE_TUNING_LEARNING_RATE, ClusterConfig, Configs, LaunchConfig, Request
from sljax.trainer import Diverged, ExitOnSignal, RunConfig, WorkdirBusy

RECIPE = "the recipe's"
LAUNCH = define(LaunchConfig, rename={"overrides": "set"}, unset={"model": DEFAULT_MODEL}, help={
    "model": f"Model preset: {', '.join(PRESETS)}",
    "host_memory_gib": "Pinned host memory this process may use, split evenly among its devices (0: "
                       f"{default_host_budget_help()})."})
CLUSTER = define(ClusterConfig)
DATA = define(DataConfig, rename={"name": "data"}, unset={
    "seq_len": RECIPE, "batch_size": f"{RECIPE}; where it has none, the plan's smallest compute-bound batch on the "
                                     f"offload engine, else {DataConfig.batch_size}"})
# A flag given replaces its field of the recipe's OptimConfig (a --hf_dir model takes its family's nearest preset's).
OPTIM = define(OptimConfig, unset={
    **{field.name: RECIPE for field in dataclasses.fields(OptimConfig)},
    "learning_rate": f"{RECIPE}; with --lora_rank {FINE_TUNING_LEARNING_RATE:g}, LoRA's usual rate (the recipes train "
                     f"every weight from scratch)",
    "warmup_steps": f"{RECIPE}, whatever --steps: a shorter run ends within it, below the peak rate",
    # Not OptimConfig's default (0: none): a library user of OptimConfig has no run length to decay over.
    "decay_steps": "--steps; none for a run that ends within its warmup",
    "moments_dtype": f"{RECIPE}, float32; on the offload engine bfloat16 where float32 does not fit, with a notice"})
RUN = define(RunConfig)
# Without --lora_rank every weight trains, and the other LoRA flags have nothing to shape (they are refused).
LORA = define(LoraConfig, rename={"rank": "lora_rank", "alpha": "lora_alpha", "targets": "lora_targets"}, unset={
    "rank": "none, every weight trains", "alpha": f"{LoraConfig.alpha:g}", "targets": "every projection",
    "base_bits": "0, the base in the dtype it runs in"}, help={
    "rank": "Fine-tune LoRA adapters of this rank on the frozen weights of --hf_dir (without it a random base, for "
            "benchmarks only); checkpoints hold the adapters and point to the base.",
    "alpha": "LoRA: the adapter term is scaled by lora_alpha / lora_rank.",
    "targets": "LoRA: the projections of each layer that get adapters, by module name (q_proj, v_proj, ...; a comma "
               "list, or the flag repeated).",
    "base_bits": "LoRA: hold the frozen base's kernels as 8- or 4-bit group-wise codes with scales (QLoRA's base, "
                 "as generation quantizes), dequantized inside each layer call; checkpoints record it."})
# This project's code, in the checkout or installed: sljax's and models' directories.
OWN_DIRS = tuple(os.path.dirname(package.__file__) + os.sep for package in (sljax, models))


class _OwnInfoOnly(std_logging.Filter):
  """Orbax logs dozens of INFO lines per checkpoint: keep libraries' warnings and this project's own INFO lines."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or os.path.abspath(record.pathname).startswith(OWN_DIRS)


def lora_config() -> LoraConfig | None:
  """--lora_rank and its companions as a LoraConfig; None without --lora_rank. ValueError on a bad value."""
  fields = {name: value for name, value in LORA.given().items() if value != ()}  # --lora_targets not given: ()
  if "rank" not in fields:
    if fields:
      raise ValueError(f"{' and '.join('--' + LORA.names[name] for name in fields)} shape LoRA fine-tuning: add "
                       f"--lora_rank")
    return None
  targets = tuple(name.strip() for names in fields.get("targets", ()) for name in names.split(",") if name.strip())
  return LoraConfig(**{**fields, "targets": targets})


def request() -> Request:
  """The parsed flags as a request; ValueError on a bad value."""
  return Request(LAUNCH.build(), RUN.build(), data=DATA.given(), optim=OPTIM.given(), lora=lora_config())


def configs_from_flags() -> Configs:
  """(ModelConfig, DataConfig, OptimConfig, RunConfig, initial weights or None) from the parsed flags over the
  preset's recipe; ValueError on a bad value. Prints a line for each default it adapts."""
  return launch.resolve(request())


def run() -> dict[int, float]:
  """Checks the request, then trains; returns {step: loss} of the steps run. Bad requests exit with one line."""
  try:
    job = launch.prepare(request())
  except ValueError as error:
    raise SystemExit(f"sljax: {error}") from None
  if job.request.launch.plan:
    return {}
  try:
    return launch.train(job)
  except CheckpointMismatchError as error:
    raise SystemExit(f"sljax: {error}; use another --workdir") from None
  except (CheckpointCorruptError, CheckpointWriteError, DiskSpaceError, Diverged, WorkdirBusy) as error:
    raise SystemExit(f"sljax: {error}") from None


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"sljax: unexpected arguments {' '.join(argv[1:])}")
  logging.get_absl_handler().addFilter(_OwnInfoOnly())
  with ExitOnSignal():  # until the loop's own stop handling takes over: a signal at start-up ends in one line
    try:  # before anything touches a device: every process of a multi-host run starts here
      launch_cfg = LAUNCH.build()
      configure_process(launch_cfg.host_memory_gib)
      launch.start(launch_cfg, CLUSTER.build())
    except (TimeoutError, ValueError) as error:
      raise SystemExit(f"sljax: {error}") from None
    run()


def console():
  """`sljax-train` and `python train.py`."""
  run_command(sys.modules[__name__])
