"""Trains a decoder-only LM: `python train.py` fits llama-tiny on the embedded stdlib corpus in a few CPU minutes.

  python train.py --model llama-tiny --set num_layers=8 --steps 1000 --batch_size 16
  python train.py --model opt-125m --data c4/en --tokenizer tokenizer.json --seq_len 1024 --workdir runs/opt

Every default lives in the config dataclasses (ModelConfig presets, DataConfig, OptimConfig, RunConfig) or in the
preset's training recipe (sljax.optim.RECIPES); the flags below only expose them. A run resumes from the newest
checkpoint in --workdir.
"""

import dataclasses
import logging as std_logging
import math
import os

from sljax.machines import (GIB, MACHINES, PINNED_POOL_ENV, Budget, cap_pinned_pools, default_budget,
                            default_host_budget_help, reserve_gpu_memory, target_budget)

# The plan packs optimizer state into the device memory it is given: give XLA nearly all of each GPU (the benchmarks
# run at this value). Read when the backend starts, which importing jax does not do.
reserve_gpu_memory()

import jax
from absl import app, flags, logging

from models.hf import HFWeights
from models.presets import PRESETS, build, get_config, parse_overrides
from sljax import metrics, trainer
from sljax.checkpoint import CheckpointCorruptError, CheckpointMismatchError, CheckpointWriteError, DiskSpaceError
from sljax.data import DataConfig, Source, make_source
from sljax.mesh import check_batch, initialize_distributed, make_mesh
from sljax.optim import DECAY_SHAPES, RECIPES, make_optimizer, recipe_for
from sljax.plan import make_plan, plan_batch
from sljax.trainer import RunConfig

DEFAULT_MODEL = "llama-tiny"
DATA, RUN = DataConfig(), RunConfig()  # the defaults the flags expose; the optimizer's and seq_len's are the recipe's
RECIPE = " (default: the recipe's)"

flags.DEFINE_string("model", DEFAULT_MODEL, f"Model preset: {', '.join(PRESETS)}.")
flags.DEFINE_multi_string("set", [], "Model config override field=value, repeatable (e.g. --set num_layers=8).")
flags.DEFINE_string("hf_dir", "", "Start from these Hugging Face LLaMA/OPT weights (config.json + *.safetensors) "
                    "instead of a random init; the model is the one its config.json describes (--set still applies).")

flags.DEFINE_string("data", DATA.name, "Corpus: 'stdlib' (embedded) or a TFDS name prepared as array_record.")
flags.DEFINE_string("data_dir", DATA.data_dir, "TFDS data_dir (default: TFDS's).")
flags.DEFINE_string("tokenizer", DATA.tokenizer, "sentencepiece .model or tokenizer.json (default: bytes).")
flags.DEFINE_string("split", DATA.split, "TFDS split.")
flags.DEFINE_string("text_key", DATA.text_key, "TFDS feature holding the text.")
flags.DEFINE_integer("seq_len", None, "Tokens per sequence" + RECIPE + ".")
flags.DEFINE_integer("batch_size", None, "Sequences per step (default: the recipe's; where it has none, the plan's "
                     f"smallest compute-bound batch on the offload engine, else {DATA.batch_size}).")
flags.DEFINE_integer("max_tokens", DATA.max_tokens, "Tokens of the corpus read into memory.")
flags.DEFINE_integer("seed", DATA.seed, "Seeds the data order and the model's initialization.")

# The recipe is the preset's (sljax.optim.RECIPES; a --hf_dir model takes its family's nearest preset's); a flag given
# replaces its field.
flags.DEFINE_float("learning_rate", None, "Peak learning rate" + RECIPE + ".")
flags.DEFINE_integer("warmup_steps", None, "Linear warmup steps (default: the recipe's, at most half of --steps unless "
                     "--decay_steps is set).")
# Not OptimConfig's default (0: none): a library user of OptimConfig has no run length to decay over.
flags.DEFINE_integer("decay_steps", None, "Steps until the rate reaches its floor (default: --steps; 0: constant "
                     "after warmup).")
flags.DEFINE_enum("decay_shape", None, list(DECAY_SHAPES), "Decay after warmup" + RECIPE + ".")
flags.DEFINE_float("min_lr_ratio", None, "Final learning rate as a fraction of the peak" + RECIPE + ".")
flags.DEFINE_float("weight_decay", None, "AdamW weight decay" + RECIPE + ".")
flags.DEFINE_float("b1", None, "Adam beta1" + RECIPE + ".")
flags.DEFINE_float("b2", None, "Adam beta2" + RECIPE + ".")
flags.DEFINE_float("eps", None, "Adam epsilon" + RECIPE + ".")
flags.DEFINE_float("grad_clip_norm", None, "Clip gradients to this global norm, 0: off" + RECIPE + ".")
flags.DEFINE_string("moments_dtype", None, "dtype of Adam's first moment (default: the recipe's, float32; on the "
                    "offload engine bfloat16 where float32 does not fit, with a notice).")

flags.DEFINE_integer("steps", RUN.steps, "Total optimizer steps (a resumed run counts the restored ones).")
flags.DEFINE_string("workdir", RUN.workdir, "Checkpoints, TensorBoard, profile (default: runs/<model>).")
flags.DEFINE_integer("checkpoint_every", RUN.checkpoint_every, "Save a checkpoint every this many steps (0: no checkpoints).")
flags.DEFINE_integer("keep_checkpoints", RUN.keep_checkpoints, "Newest checkpoints kept.")
flags.DEFINE_integer("log_every", RUN.log_every, "Log throughput and refresh the progress bar every this many steps.")
flags.DEFINE_bool("profile", RUN.profile, f"Trace {trainer.PROFILE_STEPS} steps into <workdir>/profile.")
flags.DEFINE_integer("stop_after_bad_steps", RUN.stop_after_bad_steps,
                     "Stop after this many steps in a row with a non-finite loss or gradient (each one is skipped).")
flags.DEFINE_string("loss_log", RUN.loss_log, "Append each step's loss here as JSON lines (step, loss).")

flags.DEFINE_enum("engine", "auto", ["auto", "device", "offload"],
                  "Training step: the plain all-on-device step, the SpeedLoader offload engine, or auto (device when "
                  "the training state fits on the device, else offload).")
flags.DEFINE_integer("sub_batches", 0, "Offload engine: sub-batches per step (0: the plan chooses).")
flags.DEFINE_integer("live_layers", 0, "Offload engine: layers per group fetched to the device at once (0: plan).")
flags.DEFINE_bool("int8_exchange", False, "Offload engine: stash hidden states in host memory as int8 rows (inexact).")
flags.DEFINE_string("mesh", "", "Devices as data:D,fsdp:F, D x F dividing the device count (default: fsdp over "
                    "each host's devices, data parallel across hosts).")
flags.DEFINE_string("coordinator_address", "", "Several hosts: process 0's host:port, the same on every host "
                    "(default: $JAX_COORDINATOR_ADDRESS; under SLURM, srun's).")
flags.DEFINE_integer("num_processes", 0, "Several hosts: processes in the run, one per host (default: "
                     "$JAX_NUM_PROCESSES or SLURM's).")
flags.DEFINE_integer("process_id", -1, "Several hosts: this process's index, 0 on the coordinator (default: "
                     "$JAX_PROCESS_ID or SLURM's).")
flags.DEFINE_integer("distributed_timeout_s", 300, "Several hosts: give up when the coordinator or a process has "
                     "not joined after this many seconds.")
flags.DEFINE_bool("plan", False, "Print the offload engine's plan (placement, bytes per tier, step-time bound), exit.")
flags.DEFINE_enum("target", "", ["", *MACHINES], "With --plan: plan for one GPU of this kind (its allocator limit, "
                  "pinned budget, peak and copy rate from sljax.machines) instead of this machine's device.")
flags.DEFINE_float("device_memory_gib", 0, "Device memory the plan may use (0: the allocator's limit).")
flags.DEFINE_float("host_memory_gib", 0, "Pinned host memory this process may use, split evenly among its devices "
                   f"(0: {default_host_budget_help()}).")

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.abspath(__file__))


class _OwnInfoOnly(std_logging.Filter):
  """Orbax logs dozens of INFO lines per checkpoint: keep libraries' warnings and this repo's own INFO lines."""

  def filter(self, record):
    own = record.pathname.startswith(REPO) and "-packages" not in record.pathname
    return record.levelno >= std_logging.WARNING or own


def model_name() -> str:
  return os.path.basename(os.path.normpath(FLAGS.hf_dir)) if FLAGS.hf_dir else FLAGS.model


def recipe_name(model_cfg) -> str:
  """The preset whose recipe the run takes: --model's, or for --hf_dir its family's nearest in parameters."""
  return recipe_for(model_cfg) if FLAGS.hf_dir else FLAGS.model


def batch_planned(model_cfg) -> bool:
  """Whether the offload engine's plan chooses the batch: neither --batch_size nor the recipe sets it (the on-device
  step then takes DataConfig's)."""
  return FLAGS.batch_size is None and RECIPES[recipe_name(model_cfg)].batch_size is None


def _given(name: str, recipe_value):
  return recipe_value if FLAGS[name].value is None else FLAGS[name].value


def configs_from_flags() -> tuple:
  """(ModelConfig, DataConfig, OptimConfig, RunConfig, initial weights or None) from the parsed flags over the
  preset's recipe; ValueError on a bad value. Prints a line for each default it adapts."""
  if FLAGS.hf_dir and FLAGS["model"].present:
    raise ValueError("give --model or --hf_dir (whose config.json names the model), not both")
  if FLAGS.target and not FLAGS.plan:
    raise ValueError(f"--target={FLAGS.target} plans for a machine this is not: use it with --plan")
  for name in ("sub_batches", "live_layers"):
    if FLAGS[name].value < 0:
      raise ValueError(f"--{name} must be >= 0 (0: the plan chooses), got {FLAGS[name].value}")
  memory_flags()
  weights = HFWeights(FLAGS.hf_dir, **parse_overrides(FLAGS.set)) if FLAGS.hf_dir else None  # reads no tensor yet
  model_cfg = weights.cfg if weights else get_config(FLAGS.model, FLAGS.set)
  name = recipe_name(model_cfg)
  recipe = RECIPES[name]
  if FLAGS.hf_dir:
    print(f"note: {model_name()} ({model_cfg.param_count() / 1e9:.2f} B params) has no preset: it trains with "
          f"{name}'s recipe, the nearest {model_cfg.family} preset in size")
  data_cfg = DataConfig(
      name=FLAGS.data, data_dir=FLAGS.data_dir, tokenizer=FLAGS.tokenizer, split=FLAGS.split,
      text_key=FLAGS.text_key, seq_len=_given("seq_len", recipe.seq_len),
      batch_size=DATA.batch_size if batch_planned(model_cfg) else _given("batch_size", recipe.batch_size),
      max_tokens=FLAGS.max_tokens,
      seed=FLAGS.seed)
  warmup = _given("warmup_steps", recipe.optim.warmup_steps)
  # Warmup takes at most half of a run: Adam's first updates move every weight by about the rate, all in the
  # gradient's sign, so a short run that reaches the peak within a few steps diverges at full width.
  if FLAGS.warmup_steps is None and FLAGS.decay_steps is None and FLAGS.steps < 2 * warmup:
    warmup = FLAGS.steps // 2
    print(f"note: --steps={FLAGS.steps} is shorter than twice the recipe's {recipe.optim.warmup_steps} warmup steps: "
          f"warming up over {warmup} (half the run) and decaying over the {FLAGS.steps} (--warmup_steps, "
          f"--decay_steps set them)")
  optim_cfg = dataclasses.replace(
      recipe.optim, warmup_steps=warmup, decay_steps=_given("decay_steps", FLAGS.steps),
      **{f: FLAGS[f].value for f in OPTIM_FLAGS if FLAGS[f].value is not None})
  run_cfg = RunConfig(
      steps=FLAGS.steps, workdir=FLAGS.workdir or os.path.join("runs", model_name()),
      checkpoint_every=FLAGS.checkpoint_every, keep_checkpoints=FLAGS.keep_checkpoints, log_every=FLAGS.log_every,
      profile=FLAGS.profile, stop_after_bad_steps=FLAGS.stop_after_bad_steps, loss_log=FLAGS.loss_log)
  return model_cfg, data_cfg, optim_cfg, run_cfg, weights


# Flags that replace the recipe's OptimConfig field of their name when given.
OPTIM_FLAGS = ("learning_rate", "decay_shape", "min_lr_ratio", "weight_decay", "b1", "b2", "eps", "grad_clip_norm",
               "moments_dtype")


def memory_flags() -> tuple[float, float]:
  """(--device_memory_gib, --host_memory_gib), 0 meaning the default; ValueError unless each is finite and >= 0."""
  values = FLAGS.device_memory_gib, FLAGS.host_memory_gib
  for name, value in zip(("device_memory_gib", "host_memory_gib"), values):
    if not (math.isfinite(value) and value >= 0):
      raise ValueError(f"--{name} must be a number of GiB > 0 (0: the default), got {value}")
  return values


def recipe_line(model_cfg, data_cfg, optim_cfg, planned: bool) -> str:
  """The recipe in force, flags applied, in one line."""
  batch = f"batch {data_cfg.batch_size}" + (" (the plan's)" if planned else "")
  return (f"recipe of {recipe_name(model_cfg)} ({RECIPES[recipe_name(model_cfg)].source}, flags applied): "
          f"{optim_cfg.describe()}; seq_len {data_cfg.seq_len}, {batch}")


def choose_engine(model_cfg, data_cfg, optim_cfg, mesh) -> tuple:
  """(model config, data config, optim config, EngineConfig or None for the all-on-device step). On the offload
  engine the plan settles what the flags and the recipe leave open: the batch, and a bf16 first moment where fp32
  moments do not fit. Prints the plan (and a line for each choice) when offloading."""
  device = jax.devices()[0]
  target = MACHINES[FLAGS.target] if FLAGS.target else None
  mode = FLAGS.engine
  if mode == "auto":
    mode = "device" if fits_on_device(model_cfg, optim_cfg, device, target) else "offload"
  offload_only = [f"--{name}" for name in ("sub_batches", "live_layers") if FLAGS[name].value]
  if mode == "device" and offload_only and not FLAGS.plan:
    chosen = "the auto engine chose the on-device step (the training state fits)" if FLAGS.engine == "auto" else (
        "--engine=device runs the on-device step")
    raise ValueError(f"{' and '.join(offload_only)} shape the offload engine's step, but {chosen}: add "
                     f"--engine=offload to use them")
  if mode == "device" and not FLAGS.plan:
    trainer.check_fits(model_name(), model_cfg, optim_cfg, device)
    return model_cfg, data_cfg, optim_cfg, None
  if mode == "device":
    print(f"note: training would run the on-device step (batch {data_cfg.batch_size}: the training state fits); "
          f"the plan below is the offload engine's (--engine=offload)")
  # Each group's backward recomputes the group's forward: per-layer remat inside it would recompute twice.
  model_cfg = dataclasses.replace(model_cfg, remat=False)
  # The host budget is this process's: each of its devices keeps its own share of the host-resident state in pinned
  # memory (a whole copy under pure data parallel), so each device plans with an equal part of it.
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  budget = target_budget(target, sharing=local) if target else default_budget(device, sharing=local)
  device_gib, host_gib = memory_flags()
  budget = Budget(int(device_gib * GIB) or budget.device_bytes, int(host_gib * GIB) // local or budget.host_bytes)
  model = build(model_cfg)
  planned = batch_planned(model_cfg)

  def plan_with(optim_cfg):  # the plan sizes one device's work: its rows, its 1/fsdp share of the layer state
    args = dict(sub_batches=FLAGS.sub_batches, live_layers=FLAGS.live_layers, fsdp=mesh.shape["fsdp"], target=target,
                optimizer=make_optimizer(optim_cfg, clip=False), grad_clip_norm=optim_cfg.grad_clip_norm)
    if planned:
      return plan_batch(model, data_cfg.seq_len, budget, devices=mesh.size, **args)
    return make_plan(model, data_cfg.seq_len, data_cfg.batch_size // mesh.size, budget, **args), None

  try:
    (plan, why), error = plan_with(optim_cfg), None
  except ValueError as fp32_error:
    (plan, why), error = (None, None), fp32_error
  if FLAGS.moments_dtype is None and optim_cfg.moments_dtype == "float32" and (
      plan is None or (planned and not plan.compute_bound)):
    bf16 = dataclasses.replace(optim_cfg, moments_dtype="bfloat16")
    try:
      plan16, why16 = plan_with(bf16)
    except ValueError as bf16_error:
      if plan is None:
        error = ValueError(f"{bf16_error} (with a bf16 first moment, which needs less than fp32 moments)")
    else:
      if plan is None or plan16.compute_bound:
        print(f"note: fp32 Adam moments do not fit {'a compute-bound batch' if plan else 'at all'}; training with a "
              f"bf16 first moment (optax keeps the second in fp32): --moments_dtype=float32 insists")
        plan, why, optim_cfg = plan16, why16, bf16
  if plan is None:
    elsewhere = FLAGS.plan and not target and device.platform == "cpu"
    raise ValueError(f"{error}" + ("; to plan for a GPU from this machine: --target=h200 (or h100-80gb, a100-80gb)"
                                   if elsewhere else ""))
  if planned:
    data_cfg = dataclasses.replace(data_cfg, batch_size=plan.rows * mesh.size)
    print(f"note: {why}")
  per_device = f" (per device, {local} on this host)" if local > 1 else ""
  on = f" on one {target.name} (--target)" if target else ""
  print(f"plan for {model_name()}{on}, batch {data_cfg.batch_size} x {data_cfg.seq_len}{per_device}:\n"
        f"{plan.describe()}")
  if target and device.platform == "cpu":
    print("compiled step peak: this CPU's compile, scaled by the GPU/CPU ratio measured for llama13b at 8 x 2048 "
          "(sljax.plan.gpu_peak_from_cpu): an estimate for other shapes")
  return model_cfg, data_cfg, optim_cfg, dataclasses.replace(plan.engine, int8_exchange=FLAGS.int8_exchange)


def fits_on_device(model_cfg, optim_cfg, device, target) -> bool:
  """Whether the all-on-device training state fits (on one GPU of `target` when given)."""
  if target:
    return trainer.training_state_bytes(model_cfg, optim_cfg) <= target.allocator_bytes
  try:
    trainer.check_fits(model_name(), model_cfg, optim_cfg, device)
    return True
  except ValueError:
    return False


def run() -> dict[int, float]:
  """Checks the request, then trains; returns {step: loss} of the steps run. Bad requests exit with one line."""
  # Everything that can be wrong with the request is checked here, before the workdir or any array exists.
  try:
    model_cfg, data_cfg, optim_cfg, run_cfg, weights = configs_from_flags()
    if not FLAGS.plan:
      trainer.check_workdir(run_cfg.workdir)
      metrics.check_writable_file(run_cfg.loss_log, what="loss_log", workdir=run_cfg.workdir)
      metrics.check_logger()
    source = make_source(data_cfg, model_cfg.max_positions, model_cfg.vocab_size)
    mesh = make_mesh(FLAGS.mesh)
    planned_for = data_cfg
    model_cfg, data_cfg, optim_cfg, engine_cfg = choose_engine(model_cfg, data_cfg, optim_cfg, mesh)
    check_batch(data_cfg.batch_size, engine_cfg.sub_batches if engine_cfg else 1, mesh)
    if data_cfg != planned_for:  # the plan chose the batch: the corpus read stays, the windows per step change
      source = Source(source.tokens, source.vocab_size, data_cfg)
    print(recipe_line(model_cfg, data_cfg, optim_cfg, batch_planned(model_cfg) and engine_cfg is not None))
  except ValueError as error:
    raise SystemExit(f"sljax: {error}") from None
  if FLAGS.plan:
    return {}
  logging.info("%s: %.1f M params, %s compute on %s; workdir %s", model_name(), model_cfg.param_count() / 1e6,
               model_cfg.dtype, jax.devices()[0].device_kind, run_cfg.workdir)
  meta = {"model": model_name(), "hf_dir": FLAGS.hf_dir, "overrides": FLAGS.set,
          "model_config": dataclasses.asdict(model_cfg), "data": dataclasses.asdict(data_cfg),
          "optim": dataclasses.asdict(optim_cfg)}
  try:
    return trainer.train(model_cfg, source, optim_cfg, run_cfg, meta, engine_cfg, mesh if mesh.size > 1 else None,
                         init_params=weights)
  except CheckpointMismatchError as error:
    raise SystemExit(f"sljax: {error}; use another --workdir") from None
  except (CheckpointCorruptError, CheckpointWriteError, DiskSpaceError, trainer.Diverged) as error:
    raise SystemExit(f"sljax: {error}") from None


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"sljax: unexpected arguments {' '.join(argv[1:])}")
  logging.get_absl_handler().addFilter(_OwnInfoOnly())
  try:  # before anything touches a device: every process of a multi-host run starts here
    set_pinned_pool()
    initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                           FLAGS.distributed_timeout_s)
  except (TimeoutError, ValueError) as error:
    raise SystemExit(f"sljax: {error}") from None
  run()


def set_pinned_pool():
  """Caps each GPU's pinned pool at its share of --host_memory_gib plus 10% (or of the default host budget), so that
  host-resident state fits but the pools' growth cannot take the whole machine. ValueError on a bad
  --host_memory_gib."""
  if PINNED_POOL_ENV in os.environ:
    return
  host_memory_gib = memory_flags()[1]
  cap_pinned_pools(host_memory_gib * GIB * 1.1 if host_memory_gib else None)


if __name__ == "__main__":
  app.run(main)
