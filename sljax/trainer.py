"""The training loop around any `Step` (its `step(state, batch) -> (state, loss)`): resume, log, checkpoint, profile,
skip non-finite steps, stop cleanly on SIGTERM / SIGINT. sljax.launch builds the step."""

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
import typing
from collections.abc import Callable

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from tqdm import tqdm

from sljax import metrics
from sljax.checkpoint import Checkpointer, check_disk
from sljax.data import Source
from sljax.memory import MemoryPeaks, tree_bytes

PROFILE_STEPS = 3  # steps traced by --profile, starting after the first (compiling) step of the run


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """How long to train and what to write where."""

  steps: int = 300  # total optimizer steps, counting those done before a resume
  workdir: str = ""  # where checkpoints/, tb/ and profile/ go; "": runs/<model>
  checkpoint_every: int = 100  # save a checkpoint every this many steps; 0: none at all (nothing to resume from)
  keep_checkpoints: int = 2  # newest checkpoints kept
  log_every: int = 10  # log throughput and refresh the progress bar every this many steps
  profile: bool = False  # write a jax.profiler trace of PROFILE_STEPS steps into workdir/profile
  stop_after_bad_steps: int = 5  # non-finite steps in a row (each skipped) after which the run stops
  loss_log: str = ""  # append {"step", "loss"} JSON lines here at every sync; "": none
  # sample the live arrays' bytes per memory kind while training (a thread: steps slow a little) and print the peaks,
  # with the device allocator's, at the end (what benchmarks.plan_vs_peak compares with the plan)
  memory_peaks: bool = False

  def __post_init__(self):
    for field in ("steps", "keep_checkpoints", "log_every", "stop_after_bad_steps"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
    if self.checkpoint_every < 0:
      raise ValueError(f"checkpoint_every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}")


class Diverged(RuntimeError):
  """Too many non-finite steps in a row: the run stopped; no checkpoint holds their updates."""


class Step(typing.Protocol):
  """What the loop needs of a training step (sljax.launch builds one for the all-on-device step and one for the
  offload engine). `abstract` gives the state's shapes and shardings (memory kinds included) without allocating, so
  a checkpoint restores straight into place.

  A step with a non-finite loss is a bad step. A step that `skips_bad_steps` returns its input state unchanged from
  one (and a NaN loss when only the gradient was non-finite); any other step's state is spoiled by it, and the loop
  rewinds to the newest checkpoint and replays up to the bad step, which it then skips.
  """

  skips_bad_steps: bool

  def init(self, key: jax.Array) -> typing.Any:
    """A fresh state from a random init."""

  def load(self, params) -> typing.Any:
    """A fresh state from full-model params ({"outer", "layers"}) or a reader of them (models.hf.HFWeights)."""

  def step(self, state, batch: dict[str, np.ndarray]) -> tuple[typing.Any, jax.Array]:
    """(new state, loss); may donate `state`."""

  def abstract(self, key: jax.Array) -> typing.Any:
    """The state as jax.ShapeDtypeStructs with shardings (of a settled state)."""

  def settle(self, state) -> typing.Any:
    """`state` with every update its step deferred applied (the offload engine parks clipped updates until the next
    step's forward): what a checkpoint holds. May donate `state`."""


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


def train(engine: Step, source: Source, run_cfg: RunConfig, meta: dict, learning_rate: Callable[[int], float],
          flops_per_token: float, devices: int = 1, init_params=None) -> dict[int, float]:
  """Trains to `run_cfg.steps`, resuming from the newest checkpoint in the workdir; returns {step: loss} of the
  steps this call ran (step n is the loss of the n-th update, 1-based; NaN for a skipped step). `meta` is saved
  with every checkpoint. `learning_rate` (the schedule: update index -> rate) and `flops_per_token` are logged with
  the losses, the MFU over `devices` devices. A run with no checkpoint yet starts from `init_params` (full-model
  params or a reader of them, e.g. models.hf.HFWeights) when given, else from a random init.

  The loop runs at most one step ahead of the device (it waits for step n-1's loss after dispatching step n), so
  SIGTERM / SIGINT stop it after the step in flight, which it saves. It reads losses at sync points: every
  `log_every` steps, at each checkpoint, at the end and after a signal. Losses are checked there, before any save,
  so no checkpoint holds a bad step's state (and a save refuses a state with a non-finite value:
  CheckpointWriteError); `stop_after_bad_steps` bad steps in a row raise Diverged. Before any step, ValueError when
  the workdir's disk cannot hold the checkpoints the run will keep.
  """
  device = jax.devices()[0]
  key = jax.random.key(source.cfg.seed)
  directory = os.path.join(run_cfg.workdir, "checkpoints")
  if run_cfg.checkpoint_every:  # before anything is written: a run must not find out at its first save
    check_disk(directory, tree_bytes(engine.abstract(key)), run_cfg.keep_checkpoints,
               saves=-(-run_cfg.steps // run_cfg.checkpoint_every))  # the last step's save, if not one of them
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
  tokens_per_step = source.cfg.batch_size * source.cfg.seq_len
  profile_start = start + 1 if run_cfg.steps - start > 1 else start
  skipped = set(saved_meta.get("skipped_steps", []))
  history, pending, previous_loss = {}, [], None
  window_start, window_steps = time.perf_counter(), 0
  step = start
  progress = tqdm(initial=start, total=run_cfg.steps, unit="step", disable=not lead)

  def save(force: bool = False):
    nonlocal state
    if run_cfg.checkpoint_every and (force or checkpointer.due(step)):  # settling costs the overlap of one step
      state = engine.settle(state)
      checkpointer.save(step, state, {**meta, "data_step": step, "skipped_steps": sorted(skipped)}, force)

  peaks = MemoryPeaks() if run_cfg.memory_peaks else contextlib.nullcontext()
  try:
    with StopSignal() as stop, peaks:
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
        utilization = metrics.mfu(tokens_per_s, flops_per_token, devices, device)
        for n, value in losses.items():
          logger.scalars(n, {"loss": value, "learning_rate": float(learning_rate(n - 1))})
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
  if run_cfg.memory_peaks:
    print(peaks.line(), flush=True)
  return history
