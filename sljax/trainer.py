"""The training loop around an engine's `step(state, batch) -> (state, loss)`: resume, log, checkpoint, profile."""

import dataclasses
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import logging
from tqdm import tqdm

from models.config import ModelConfig
from models.presets import build
from sljax import metrics, schedule
from sljax.checkpoint import Checkpointer
from sljax.data import Source
from sljax.optim import OptimConfig, learning_rate_schedule, make_optimizer
from sljax.schedule import EngineConfig

PROFILE_STEPS = 3  # steps traced by --profile, starting after the first (compiling) step of the run


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """How long to train and what to write where."""

  steps: int = 300  # total optimizer steps, counting those done before a resume
  workdir: str = ""  # checkpoints/, tb/, profile/; "": runs/<model>
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  log_every: int = 10
  profile: bool = False  # write a jax.profiler trace of PROFILE_STEPS steps into workdir/profile

  def __post_init__(self):
    for field in ("steps", "checkpoint_every", "keep_checkpoints", "log_every"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be positive, got {getattr(self, field)}")


class Engine(NamedTuple):
  """How one training step runs. `abstract` gives the state's shapes and shardings (memory kinds included) without
  allocating, so a checkpoint restores straight into place."""

  init: Callable  # key -> state
  step: Callable  # (state, batch) -> (state, loss); may donate state
  abstract: Callable  # key -> state of jax.ShapeDtypeStruct with shardings


def all_on_device(model, optimizer: optax.GradientTransformation, device: jax.Device | None = None) -> Engine:
  """The whole model, its gradients and optimizer state on one device; one jitted call per step."""
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])

  def init(key):
    params = model.init(key)
    return {"params": params, "opt_state": optimizer.init(params)}

  def step(state, batch):
    loss, grads = jax.value_and_grad(model.loss)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

  init = jax.jit(init, out_shardings=sharding)
  return Engine(init, jax.jit(step, donate_argnums=0), lambda key: jax.eval_shape(init, key))


def offloaded(model, optim_cfg: OptimConfig, engine_cfg: EngineConfig) -> Engine:
  """The SpeedLoader engine (sljax.schedule): layer-major, sub-batched, with host-resident state."""
  engine = schedule.Engine(model, make_optimizer(optim_cfg, clip=False),
                           dataclasses.replace(engine_cfg, grad_clip_norm=optim_cfg.grad_clip_norm))
  return Engine(engine.init, engine.step, engine.abstract_state)


def training_state_bytes(model_cfg: ModelConfig, optim_cfg: OptimConfig) -> int:
  """Master weights, gradients and Adam's two moments; activations come on top."""
  param_bytes = jnp.dtype(model_cfg.param_dtype).itemsize
  per_param = 3 * param_bytes + jnp.dtype(optim_cfg.moments_dtype).itemsize  # optax keeps nu in the params' dtype
  return model_cfg.param_count() * per_param


def memory_available(device: jax.Device) -> int | None:
  """Bytes a training state may use: the accelerator's allocator limit, or the host's available RAM on CPU; None
  when the platform does not say."""
  if device.platform == "cpu":
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024
  return (device.memory_stats() or {}).get("bytes_limit")


def check_fits(model_name: str, model_cfg: ModelConfig, optim_cfg: OptimConfig, device: jax.Device):
  """Raises ValueError before anything is allocated when the all-on-device training state cannot fit."""
  needed, available = training_state_bytes(model_cfg, optim_cfg), memory_available(device)
  if available is not None and needed > available:
    gib = 2**30
    raise ValueError(
        f"{model_name} ({model_cfg.param_count() / 1e9:.2f} B params) needs {needed / gib:.1f} GiB for weights, "
        f"gradients and Adam moments, but {device.device_kind} {device.id} has {available / gib:.1f} GiB; "
        f"train it with the offload engine (--engine=offload)")


def train(model_cfg: ModelConfig, source: Source, optim_cfg: OptimConfig, run_cfg: RunConfig, meta: dict,
          engine_cfg: EngineConfig | None = None) -> dict[int, float]:
  """Trains to `run_cfg.steps`, resuming from the newest checkpoint in the workdir; returns {step: loss} of the
  steps this call ran (step n is the loss of the n-th update, 1-based). `meta` is saved with every checkpoint.
  With `engine_cfg` the step is the offload engine's, else the plain all-on-device step."""
  device = jax.devices()[0]
  if engine_cfg is None:
    engine = all_on_device(build(model_cfg), make_optimizer(optim_cfg), device)
  else:
    engine = offloaded(build(model_cfg), optim_cfg, engine_cfg)
  key = jax.random.key(source.cfg.seed)
  checkpointer = Checkpointer(os.path.join(run_cfg.workdir, "checkpoints"), run_cfg.checkpoint_every,
                              run_cfg.keep_checkpoints)
  restored = checkpointer.restore_latest(engine.abstract(key))
  if restored:
    start, state, saved_meta = restored
    saved_optim, optim = saved_meta.get("optim", {}), meta.get("optim", {})
    changed = [f"{name} {saved_optim.get(name)} -> {value}" for name, value in optim.items()
               if saved_optim.get(name) != value]
    if changed:
      logging.warning("optimizer settings changed since the checkpoint: %s", ", ".join(changed))
    logging.info("resumed from %s at step %d", checkpointer.directory, start)
  else:
    start, state = 0, engine.init(key)
  if start >= run_cfg.steps:
    logging.info("checkpoint is at step %d, not before --steps %d: nothing to do", start, run_cfg.steps)
    checkpointer.close()
    return {}

  logger = metrics.Logger(run_cfg.workdir)
  schedule = learning_rate_schedule(optim_cfg)
  tokens_per_step = source.cfg.batch_size * source.cfg.seq_len
  flops_per_token = model_cfg.flops_per_token(source.cfg.seq_len)
  profile_start = start + 1 if run_cfg.steps - start > 1 else start
  history, pending = {}, []
  window_start, window_steps = time.perf_counter(), 0
  progress = tqdm(range(start, run_cfg.steps), initial=start, total=run_cfg.steps, unit="step")
  for step in progress:
    if run_cfg.profile and step == profile_start:
      jax.profiler.start_trace(os.path.join(run_cfg.workdir, "profile"))
    state, loss = engine.step(state, source.batch(step))  # dispatch is asynchronous: the loop runs ahead
    done = step + 1
    pending.append((done, loss))
    window_steps += 1
    if run_cfg.profile and done == min(profile_start + PROFILE_STEPS, run_cfg.steps):
      jax.block_until_ready(loss)
      jax.profiler.stop_trace()
    if done == start + 1 or done % run_cfg.log_every == 0 or done == run_cfg.steps:
      losses = {n: float(value) for n, value in jax.device_get(pending)}  # waits for the window's steps
      seconds = time.perf_counter() - window_start
      tokens_per_s = window_steps * tokens_per_step / seconds
      utilization = metrics.mfu(tokens_per_s, flops_per_token, 1, device)
      for n, value in losses.items():
        logger.scalars(n, {"loss": value, "learning_rate": float(schedule(n - 1))})
      logger.scalars(done, {"tokens_per_s": tokens_per_s, "mfu": utilization, "step_seconds": seconds / window_steps})
      logger.flush()
      if done == start + 1:
        logging.info("first step (compilation included): %.1f s, loss %.3f", seconds, losses[done])
      mean_loss = sum(losses.values()) / len(losses)
      progress.set_description(metrics.progress_description(mean_loss, tokens_per_s, utilization))
      history.update(losses)
      pending, window_start, window_steps = [], time.perf_counter(), 0
    checkpointer.save(done, state, {**meta, "data_step": done})
  checkpointer.save(run_cfg.steps, state, {**meta, "data_step": run_cfg.steps}, force=True)
  progress.close()
  checkpointer.close()
  logger.close()
  return history
