"""Trains a decoder-only LM: `python train.py` fits llama-tiny on the embedded stdlib corpus in a few CPU minutes.

  python train.py --model llama-tiny --set num_layers=8 --steps 1000 --batch_size 16
  python train.py --model opt-125m --data c4/en --tokenizer tokenizer.json --seq_len 1024 --workdir runs/opt

Every default lives in the config dataclasses (ModelConfig presets, DataConfig, OptimConfig, RunConfig); the flags
below only expose them. A run resumes from the newest checkpoint in --workdir.
"""

import dataclasses
import glob
import logging as std_logging
import os

# XLA preallocates 75% of each GPU by default; the plan packs optimizer state into the device memory it is given, so
# give it nearly all (the benchmarks run at this value). Read when the backend starts; a value set by the user wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.97")

import jax
from absl import app, flags, logging

from models.hf import HFWeights
from models.presets import PRESETS, build, get_config, parse_overrides
from sljax import metrics, trainer
from sljax.checkpoint import CheckpointCorruptError, CheckpointMismatchError, CheckpointWriteError, DiskSpaceError
from sljax.data import DataConfig, make_source
from sljax.mesh import check_batch, initialize_distributed, make_mesh
from sljax.optim import OptimConfig, make_optimizer
from sljax.plan import GIB, Budget, default_budget, make_plan
from sljax.trainer import RunConfig

DEFAULT_MODEL = "llama-tiny"
DATA, OPTIM, RUN = DataConfig(), OptimConfig(), RunConfig()  # the defaults the flags expose

flags.DEFINE_string("model", DEFAULT_MODEL, f"Model preset: {', '.join(PRESETS)}.")
flags.DEFINE_multi_string("set", [], "Model config override field=value, repeatable (e.g. --set num_layers=8).")
flags.DEFINE_string("hf_dir", "", "Start from these Hugging Face LLaMA/OPT weights (config.json + *.safetensors) "
                    "instead of a random init; the model is the one its config.json describes (--set still applies).")

flags.DEFINE_string("data", DATA.name, "Corpus: 'stdlib' (embedded) or a TFDS name prepared as array_record.")
flags.DEFINE_string("data_dir", DATA.data_dir, "TFDS data_dir (default: TFDS's).")
flags.DEFINE_string("tokenizer", DATA.tokenizer, "sentencepiece .model or tokenizer.json (default: bytes).")
flags.DEFINE_string("split", DATA.split, "TFDS split.")
flags.DEFINE_string("text_key", DATA.text_key, "TFDS feature holding the text.")
flags.DEFINE_integer("seq_len", DATA.seq_len, "Tokens per sequence.")
flags.DEFINE_integer("batch_size", DATA.batch_size, "Sequences per step.")
flags.DEFINE_integer("max_tokens", DATA.max_tokens, "Tokens of the corpus read into memory.")
flags.DEFINE_integer("seed", DATA.seed, "Seeds the data order and the model's initialization.")

flags.DEFINE_float("learning_rate", OPTIM.learning_rate, "Peak learning rate.")
flags.DEFINE_integer("warmup_steps", OPTIM.warmup_steps, "Linear warmup steps.")
# The one flag whose default is not its field's: a library user of OptimConfig has no run length to decay over.
flags.DEFINE_integer("decay_steps", None, "Cosine decay length (default: --steps; 0: constant after warmup).")
flags.DEFINE_float("min_lr_ratio", OPTIM.min_lr_ratio, "Final learning rate as a fraction of the peak.")
flags.DEFINE_float("weight_decay", OPTIM.weight_decay, "AdamW weight decay.")
flags.DEFINE_float("b1", OPTIM.b1, "Adam beta1.")
flags.DEFINE_float("b2", OPTIM.b2, "Adam beta2.")
flags.DEFINE_float("eps", OPTIM.eps, "Adam epsilon.")
flags.DEFINE_float("grad_clip_norm", OPTIM.grad_clip_norm, "Clip gradients to this global norm (0: off).")
flags.DEFINE_string("moments_dtype", OPTIM.moments_dtype, "dtype of Adam's first moment.")

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
flags.DEFINE_float("device_memory_gib", 0, "Device memory the plan may use (0: the allocator's limit).")
flags.DEFINE_float("host_memory_gib", 0, "Pinned host memory this process may use, split evenly among its devices "
                   "(0: 90% of RAM).")

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.abspath(__file__))


class _OwnInfoOnly(std_logging.Filter):
  """Orbax logs dozens of INFO lines per checkpoint: keep libraries' warnings and this repo's own INFO lines."""

  def filter(self, record):
    own = record.pathname.startswith(REPO) and "-packages" not in record.pathname
    return record.levelno >= std_logging.WARNING or own


def model_name() -> str:
  return os.path.basename(os.path.normpath(FLAGS.hf_dir)) if FLAGS.hf_dir else FLAGS.model


def configs_from_flags() -> tuple:
  """(ModelConfig, DataConfig, OptimConfig, RunConfig, initial weights or None) from the parsed flags; ValueError
  on a bad value."""
  if FLAGS.hf_dir and FLAGS["model"].present:
    raise ValueError("give --model or --hf_dir (whose config.json names the model), not both")
  weights = HFWeights(FLAGS.hf_dir, **parse_overrides(FLAGS.set)) if FLAGS.hf_dir else None  # reads no tensor yet
  model_cfg = weights.cfg if weights else get_config(FLAGS.model, FLAGS.set)
  data_cfg = DataConfig(
      name=FLAGS.data, data_dir=FLAGS.data_dir, tokenizer=FLAGS.tokenizer, split=FLAGS.split,
      text_key=FLAGS.text_key, seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, max_tokens=FLAGS.max_tokens,
      seed=FLAGS.seed)
  optim_cfg = OptimConfig(
      learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
      decay_steps=FLAGS.steps if FLAGS.decay_steps is None else FLAGS.decay_steps, min_lr_ratio=FLAGS.min_lr_ratio,
      weight_decay=FLAGS.weight_decay, b1=FLAGS.b1, b2=FLAGS.b2, eps=FLAGS.eps, grad_clip_norm=FLAGS.grad_clip_norm,
      moments_dtype=FLAGS.moments_dtype)
  run_cfg = RunConfig(
      steps=FLAGS.steps, workdir=FLAGS.workdir or os.path.join("runs", model_name()),
      checkpoint_every=FLAGS.checkpoint_every, keep_checkpoints=FLAGS.keep_checkpoints, log_every=FLAGS.log_every,
      profile=FLAGS.profile, stop_after_bad_steps=FLAGS.stop_after_bad_steps, loss_log=FLAGS.loss_log)
  return model_cfg, data_cfg, optim_cfg, run_cfg, weights


def choose_engine(model_cfg, data_cfg, optim_cfg, mesh) -> tuple:
  """(model config, EngineConfig or None for the all-on-device step); prints the plan when offloading."""
  device = jax.devices()[0]
  mode = FLAGS.engine
  if mode == "auto":
    try:
      trainer.check_fits(model_name(), model_cfg, optim_cfg, device)
      mode = "device"
    except ValueError:
      mode = "offload"
  if mode == "device" and not FLAGS.plan:
    trainer.check_fits(model_name(), model_cfg, optim_cfg, device)
    return model_cfg, None
  # Each group's backward recomputes the group's forward: per-layer remat inside it would recompute twice.
  model_cfg = dataclasses.replace(model_cfg, remat=False)
  # The host budget is this process's: each of its devices keeps its own share of the host-resident state in pinned
  # memory (a whole copy under pure data parallel), so each device plans with an equal part of it.
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  budget = default_budget(device, sharing=local)
  budget = Budget(int(FLAGS.device_memory_gib * GIB) or budget.device_bytes,
                  int(FLAGS.host_memory_gib * GIB) // local or budget.host_bytes)
  # The plan sizes one device's work: its rows of the batch (the mesh splits every sub-batch over all devices) and
  # its 1/fsdp share of the layer state.
  plan = make_plan(build(model_cfg), data_cfg.seq_len, data_cfg.batch_size // mesh.size, budget, FLAGS.sub_batches,
                   FLAGS.live_layers, make_optimizer(optim_cfg, clip=False), optim_cfg.grad_clip_norm,
                   fsdp=mesh.shape["fsdp"])
  per_device = f" (per device, {local} on this host)" if local > 1 else ""
  print(f"plan for {model_name()}, batch {data_cfg.batch_size} x {data_cfg.seq_len}{per_device}:\n{plan.describe()}")
  return model_cfg, dataclasses.replace(plan.engine, int8_exchange=FLAGS.int8_exchange)


def run() -> dict[int, float]:
  """Checks the request, then trains; returns {step: loss} of the steps run. Bad requests exit with one line."""
  # Everything that can be wrong with the request is checked here, before the workdir or any array exists.
  try:
    model_cfg, data_cfg, optim_cfg, run_cfg, weights = configs_from_flags()
    if not FLAGS.plan:
      trainer.check_workdir(run_cfg.workdir)
      metrics.check_logger()
    source = make_source(data_cfg, model_cfg.max_positions, model_cfg.vocab_size)
    mesh = make_mesh(FLAGS.mesh)
    check_batch(data_cfg.batch_size, 1, mesh)
    model_cfg, engine_cfg = choose_engine(model_cfg, data_cfg, optim_cfg, mesh)
    check_batch(data_cfg.batch_size, engine_cfg.sub_batches if engine_cfg else 1, mesh)
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
  set_pinned_pool()
  try:  # before anything touches a device: every process of a multi-host run starts here
    initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                           FLAGS.distributed_timeout_s)
  except (TimeoutError, ValueError) as error:
    raise SystemExit(f"sljax: {error}") from None
  run()


def set_pinned_pool():
  """XLA gives each GPU its own pinned host pool (64 GiB by default), which grows by doubling regions and never
  shrinks; before the backend starts, cap each GPU's at its share of --host_memory_gib (or of 3/4 of RAM) plus 10%,
  so that host-resident state fits but the pools' growth cannot take the whole machine."""
  if "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in os.environ:
    return
  with open("/proc/meminfo") as f:
    ram = int(dict(line.split(":", 1) for line in f)["MemTotal"].split()[0]) * 1024
  process_bytes = FLAGS.host_memory_gib * GIB * 1.1 if FLAGS.host_memory_gib else 0.75 * ram
  os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(max(int(process_bytes / local_gpu_count() / GIB), 1))


def local_gpu_count() -> int:
  """The GPUs this process will see, counted without starting a backend (CUDA_VISIBLE_DEVICES, else the driver's
  list); 1 where neither says."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return max(len([d for d in visible.split(",") if d.strip()]), 1)
  return max(len(glob.glob("/proc/driver/nvidia/gpus/*")), 1)


if __name__ == "__main__":
  app.run(main)
