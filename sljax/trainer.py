"""The training loop around an engine's `step(state, batch) -> (state, loss)`: resume, log, checkpoint, profile,
skip non-finite steps, stop cleanly on SIGTERM / SIGINT."""

import dataclasses
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from tqdm import tqdm

from models.common import params_reader
from models.config import ModelConfig
from models.presets import build
from sljax import metrics, schedule
from sljax.checkpoint import Checkpointer, check_disk
from sljax.data import Source
from sljax.machines import GIB, available_ram_bytes
from sljax.memory import Placement, tree_bytes
from sljax.mesh import PER_DEVICE
from sljax.optim import OptimConfig, learning_rate_schedule, make_optimizer
from sljax.plan import optimizer_bytes_per_param
from sljax.schedule import EngineConfig

PROFILE_STEPS = 3  # steps traced by --profile, starting after the first (compiling) step of the run


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """How long to train and what to write where."""

  steps: int = 300  # total optimizer steps, counting those done before a resume
  workdir: str = ""  # checkpoints/, tb/, profile/; "": runs/<model>
  checkpoint_every: int = 100  # 0: no checkpoints at all (nothing to resume from)
  keep_checkpoints: int = 2
  log_every: int = 10
  profile: bool = False  # write a jax.profiler trace of PROFILE_STEPS steps into workdir/profile
  stop_after_bad_steps: int = 5  # non-finite steps in a row (each skipped) after which the run stops
  loss_log: str = ""  # append {"step", "loss"} JSON lines here at every sync; "": none

  def __post_init__(self):
    for field in ("steps", "keep_checkpoints", "log_every", "stop_after_bad_steps"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
    if self.checkpoint_every < 0:
      raise ValueError(f"checkpoint_every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}")


class Diverged(RuntimeError):
  """Too many non-finite steps in a row: the run stopped; no checkpoint holds their updates."""


class Engine(NamedTuple):
  """How one training step runs. `abstract` gives the state's shapes and shardings (memory kinds included) without
  allocating, so a checkpoint restores straight into place.

  A step with a non-finite loss is a bad step. An engine that `skips_bad_steps` returns its input state unchanged
  from one (and a NaN loss when only the gradient was non-finite); any other engine's state is spoiled by it, and
  the trainer rewinds to the newest checkpoint and replays up to the bad step, which it then skips.
  """

  init: Callable  # key -> state
  load: Callable  # full-model params ({"outer", "layers"}) or a reader of them (models.hf.HFWeights) -> state
  step: Callable  # (state, batch) -> (state, loss); may donate state
  abstract: Callable  # key -> state of jax.ShapeDtypeStruct with shardings
  skips_bad_steps: bool


def all_on_device(model, optimizer: optax.GradientTransformation, device: jax.Device | None = None,
                  mesh: jax.sharding.Mesh | None = None) -> Engine:
  """The whole model, its gradients and optimizer state on one device; one jitted call per step. With `mesh`: on
  every device of it, each taking its rows of the batch (data parallel; XLA all-reduces the gradient)."""
  sharding = (Placement(mesh).device() if mesh is not None
              else jax.sharding.SingleDeviceSharding(device or jax.devices()[0]))

  def init(key):
    params = model.init(key)
    return {"params": params, "opt_state": optimizer.init(params)}

  def load(params):
    reader = params_reader(params)  # the whole model fits on the device here, so it fits in host RAM too
    params = jax.device_put({"outer": reader.outer(), "layers": reader.layers(0, model.cfg.num_layers)}, sharding)
    return jax.jit(lambda p: {"params": p, "opt_state": optimizer.init(p)}, out_shardings=sharding)(params)

  def step(state, batch):
    loss, grads = jax.value_and_grad(model.loss)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    keep_old = lambda new, old: jnp.where(finite, new, old)
    return jax.tree.map(keep_old, new_state, state), jnp.where(finite, loss, jnp.nan)

  init = jax.jit(init, out_shardings=sharding)
  step = jax.jit(step, donate_argnums=0)
  if mesh is not None:  # each device takes its rows of the batch
    place, sharded_step = Placement(mesh), step
    step = lambda state, batch: sharded_step(state, place.to_device(batch, PER_DEVICE))
  return Engine(init, load, step, lambda key: jax.eval_shape(init, key), skips_bad_steps=True)


def offloaded(model, optim_cfg: OptimConfig, engine_cfg: EngineConfig,
              mesh: jax.sharding.Mesh | None = None) -> Engine:
  """The SpeedLoader engine (sljax.schedule): layer-major, sub-batched, with host-resident state; over `mesh`, data
  parallel + FSDP."""
  engine = schedule.Engine(model, make_optimizer(optim_cfg, clip=False),
                           dataclasses.replace(engine_cfg, grad_clip_norm=optim_cfg.grad_clip_norm),
                           None if mesh is None else Placement(mesh))
  # A non-finite loss leaves its state unchanged; a non-finite gradient too when clipping (the updates then wait for
  # the global norm). Without clipping, updates stream out before the whole gradient is known: rewind instead.
  return Engine(engine.init, engine.from_params, engine.step, engine.abstract_state,
                skips_bad_steps=optim_cfg.grad_clip_norm > 0)


def training_state_bytes(model_cfg: ModelConfig, optim_cfg: OptimConfig) -> int:
  """Master weights, gradients and the optimizer's state; activations come on top."""
  param_bytes = jnp.dtype(model_cfg.param_dtype).itemsize
  per_param = 2 * param_bytes + optimizer_bytes_per_param(make_optimizer(optim_cfg), model_cfg.param_dtype)
  return int(model_cfg.param_count() * per_param)


def memory_available(device: jax.Device) -> int | None:
  """Bytes a training state may use: the accelerator's allocator limit, or the host's available RAM on CPU; None
  when the platform does not say."""
  if device.platform == "cpu":
    return available_ram_bytes()
  return (device.memory_stats() or {}).get("bytes_limit")


def check_fits(model_name: str, model_cfg: ModelConfig, optim_cfg: OptimConfig, device: jax.Device):
  """Raises ValueError before anything is allocated when the all-on-device training state cannot fit."""
  needed, available = training_state_bytes(model_cfg, optim_cfg), memory_available(device)
  if available is not None and needed > available:
    raise ValueError(
        f"{model_name} ({model_cfg.param_count() / 1e9:.2f} B params) needs {needed / GIB:.1f} GiB for weights, "
        f"gradients and Adam moments, but {device.device_kind} {device.id} has {available / GIB:.1f} GiB; "
        f"train it with the offload engine (--engine=offload)")


def check_workdir(workdir: str):
  """Raises ValueError, before anything is written, when `workdir` cannot be created or written: a URL (checkpoints
  go to a local or mounted filesystem), a NUL byte, a name longer than the filesystem allows, a broken link on the
  way, a file where a directory must be, or a read-only directory."""
  if "://" in workdir:
    raise ValueError(f"workdir {workdir} is a URL; sljax writes to a local or mounted filesystem (mount the bucket)")
  if "\0" in workdir:
    raise ValueError(f"workdir {workdir!r} holds a NUL byte")
  existing = os.path.abspath(workdir)
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if os.path.islink(existing) and not os.path.exists(existing):
    raise ValueError(f"workdir {workdir} cannot be created: {existing} is a broken link")
  longest = os.pathconf(existing if os.path.isdir(existing) else os.path.dirname(existing), "PC_NAME_MAX")
  too_long = [name for name in os.path.relpath(os.path.abspath(workdir), existing).split(os.sep)
              if len(os.fsencode(name)) > longest]
  if too_long:
    raise ValueError(f"workdir {workdir} cannot be created: the name {too_long[0][:40]}... is longer than the "
                     f"{longest} bytes the filesystem allows")
  if not os.path.isdir(existing):
    raise ValueError(f"workdir {workdir} cannot be created: {existing} is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"workdir {workdir} is not writable: {existing} is read-only here")


class StopSignal:
  """While entered, SIGTERM and SIGINT set `received` (the signal's name) instead of ending the process, so the
  loop can finish its step and save; a second signal acts as it would have (Ctrl-C twice still interrupts)."""

  def __enter__(self):
    self.received, self._previous = None, {}
    if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there only
      self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def _handle(self, signum, frame):
    self.received = signal.Signals(signum).name
    self._restore()

  def _restore(self):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def __exit__(self, *exc_info):
    self._restore()


def _any_process(flag: bool) -> bool:
  """Whether `flag` is set in any process. On several hosts every process must call this at the same step: a
  signal that reaches one host (or reaches them at different steps) then stops them all after the same step. The
  all-gather waits for the step in flight, so the next step's first weights start crossing only after it (a gap of
  about one group's copy per step: ~15 ms of llama13b's 11 s); with one process nothing waits."""
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _in_a_row(step: int, skipped: set[int]) -> int:
  """Length of the run of consecutive skipped steps that ends at `step`."""
  length = 1
  while step - length in skipped:
    length += 1
  return length


def train(model_cfg: ModelConfig, source: Source, optim_cfg: OptimConfig, run_cfg: RunConfig, meta: dict,
          engine_cfg: EngineConfig | None = None, mesh: jax.sharding.Mesh | None = None,
          init_params=None) -> dict[int, float]:
  """Trains to `run_cfg.steps`, resuming from the newest checkpoint in the workdir; returns {step: loss} of the
  steps this call ran (step n is the loss of the n-th update, 1-based; NaN for a skipped step). `meta` is saved
  with every checkpoint. With `engine_cfg` the step is the offload engine's, else the plain all-on-device step;
  `mesh` spreads either over several devices (sljax.mesh). A run with no checkpoint yet starts from `init_params`
  (full-model params or a reader of them, e.g. models.hf.HFWeights) when given, else from a random init.

  The loop runs at most one step ahead of the device (it waits for step n-1's loss after dispatching step n), so
  SIGTERM / SIGINT stop it after the step in flight, which it saves. It reads losses at sync points: every
  `log_every` steps, at each checkpoint, at the end and after a signal. Losses are checked there, before any save,
  so no checkpoint holds a bad step's state (and a save refuses a state with a non-finite value:
  CheckpointWriteError); `stop_after_bad_steps` bad steps in a row raise Diverged. Before any step, ValueError when
  the workdir's disk cannot hold the checkpoints the run will keep.
  """
  device = jax.devices()[0]
  if engine_cfg is None:
    engine = all_on_device(build(model_cfg), make_optimizer(optim_cfg), device, mesh)
  else:
    engine = offloaded(build(model_cfg), optim_cfg, engine_cfg, mesh)
  key = jax.random.key(source.cfg.seed)
  directory = os.path.join(run_cfg.workdir, "checkpoints")
  if run_cfg.checkpoint_every:  # before anything is written: a run must not find out at its first save
    check_disk(directory, tree_bytes(engine.abstract(key)), run_cfg.keep_checkpoints,
               saves=run_cfg.steps // run_cfg.checkpoint_every + 1)
  checkpointer = Checkpointer(directory, run_cfg.checkpoint_every, run_cfg.keep_checkpoints)

  def newest_good_state() -> tuple[int, object, dict]:  # checkpoints are only ever saved from good states
    return checkpointer.restore_latest(engine.abstract(key)) or (
        0, engine.init(key) if init_params is None else engine.load(init_params), {})

  start, state, saved_meta = newest_good_state()
  if start:
    saved_optim, optim = saved_meta.get("optim", {}), meta.get("optim", {})
    changed = [f"{name} {saved_optim.get(name)} -> {value}" for name, value in optim.items()
               if saved_optim.get(name) != value]
    if changed:
      logging.warning("optimizer settings changed since the checkpoint: %s", ", ".join(changed))
    logging.info("resumed from %s at step %d", checkpointer.directory, start)
  if start >= run_cfg.steps:
    logging.info("checkpoint is at step %d, not before --steps %d: nothing to do", start, run_cfg.steps)
    checkpointer.close()
    return {}

  lead = jax.process_index() == 0  # on several hosts, only the first one logs
  logger = metrics.Logger(run_cfg.workdir, enabled=lead)
  loss_log = open(run_cfg.loss_log, "a") if run_cfg.loss_log and lead else None
  schedule = learning_rate_schedule(optim_cfg)
  tokens_per_step = source.cfg.batch_size * source.cfg.seq_len
  flops_per_token = model_cfg.flops_per_token(source.cfg.seq_len)
  profile_start = start + 1 if run_cfg.steps - start > 1 else start
  skipped = set(saved_meta.get("skipped_steps", []))
  history, pending, previous_loss = {}, [], None
  window_start, window_steps = time.perf_counter(), 0
  step = start
  progress = tqdm(initial=start, total=run_cfg.steps, unit="step", disable=not lead)

  def save(force: bool = False):
    checkpointer.save(step, state, {**meta, "data_step": step, "skipped_steps": sorted(skipped)}, force)

  try:
    with StopSignal() as stop:
      while step < run_cfg.steps:
        if run_cfg.profile and step == profile_start:
          jax.profiler.start_trace(os.path.join(run_cfg.workdir, "profile"))
        replaying_bad_step = step + 1 in skipped  # after a rewind: the state stays as a bad step leaves it
        if replaying_bad_step:
          loss = math.nan
        else:
          state, loss = engine.step(state, source.batch(step))  # dispatch is asynchronous: the loop runs ahead
          if previous_loss is not None:  # by one step at most, so that a stop signal waits for one step only
            jax.block_until_ready(previous_loss)
          previous_loss = loss
        step += 1
        pending.append((step, loss))
        window_steps += 1
        progress.update()
        if run_cfg.profile and step == min(profile_start + PROFILE_STEPS, run_cfg.steps):
          jax.block_until_ready(loss)
          jax.profiler.stop_trace()
        stopping = _any_process(stop.received is not None)
        sync = (not history or step % run_cfg.log_every == 0 or checkpointer.due(step)
                or step == run_cfg.steps or stopping or replaying_bad_step)
        if not sync:
          continue

        losses = {n: float(value) for n, value in jax.device_get(pending)}  # waits for the window's steps
        bad = [n for n, value in losses.items() if not math.isfinite(value) and n not in skipped]
        if bad and not engine.skips_bad_steps:  # the steps after the first bad one ran on its spoiled state
          losses = {n: value for n, value in losses.items() if n <= bad[0]}
          bad = bad[:1]
        skipped.update(bad)
        seconds = time.perf_counter() - window_start
        tokens_per_s = window_steps * tokens_per_step / seconds
        utilization = metrics.mfu(tokens_per_s, flops_per_token, 1 if mesh is None else mesh.size, device)
        for n, value in losses.items():
          logger.scalars(n, {"loss": value, "learning_rate": float(schedule(n - 1))})
        logger.scalars(step, {"tokens_per_s": tokens_per_s, "mfu": utilization, "step_seconds": seconds / window_steps,
                              "skipped_steps": len(skipped)})
        logger.flush()
        if loss_log:
          loss_log.writelines(json.dumps({"step": n, "loss": value if math.isfinite(value) else None}) + "\n"
                              for n, value in losses.items())
          loss_log.flush()
        if not history:
          logging.info("first step (compilation included): %.1f s, loss %.3f", seconds, losses[min(losses)])
        finite = [value for value in losses.values() if math.isfinite(value)]
        if finite:
          progress.set_description(metrics.progress_description(sum(finite) / len(finite), tokens_per_s, utilization))
        history.update(losses)
        pending, window_start, window_steps = [], time.perf_counter(), 0

        for n in bad:
          in_a_row = _in_a_row(n, skipped)
          logging.warning("step %d: non-finite loss or gradient; update skipped (%d in a row, %d in all)", n,
                          in_a_row, sum(m <= n for m in skipped))
          if in_a_row >= run_cfg.stop_after_bad_steps:
            newest = checkpointer.manager.latest_step()
            where = "none yet" if newest is None else os.path.join(checkpointer.directory, str(newest))
            raise Diverged(f"steps {n - in_a_row + 1}-{n}, {in_a_row} in a row, had a non-finite loss or gradient: "
                           f"stopped (newest checkpoint, with none of their updates: {where})")
        if bad and not engine.skips_bad_steps:
          state = None  # freed before the restore allocates its replacement
          step, state, _ = newest_good_state()
          logging.info("rewound to step %d: replaying up to bad step %d, which is skipped", step, bad[0])
          progress.reset()
          progress.update(step)
          continue
        save(force=replaying_bad_step)  # saved past the bad step, a next one in a row rewinds with no replay
        if stopping:
          break
      save(force=True)
      if stopping:
        saved = (f"saved {checkpointer.directory}/{step}; the same command resumes" if run_cfg.checkpoint_every
                 else "not saved (--checkpoint_every=0)")
        logging.warning("%s: stopped after step %d; %s", stop.received or "another process's stop signal", step, saved)
  finally:
    progress.close()
    checkpointer.close()
    logger.close()
    if loss_log:
      loss_log.close()
  return history
