"""The training loop around any `Step` (its `step(state, batch) -> (state, loss)`): resume, log, checkpoint, profile,
skip non-finite steps, stop cleanly on SIGTERM / SIGINT. sljax.launch builds the step."""

import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import os
import signal
import socket
import sys
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
from sljax.checkpoint import Checkpointer, check_disk, saved_bytes, saved_steps
from sljax.data import Source
from sljax.memory import MemoryPeaks

PROFILE_STEPS = 3  # steps traced by --profile, starting after the first (compiling) step of the run


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """How long to train and what to write where."""

  steps: int = 300  # total optimizer steps, counting those done before a resume
  workdir: str = ""  # where checkpoints/, tb/ and profile/ go; "": runs/<model>
  # save a checkpoint every this many steps; 0: none by count (and with checkpoint_minutes 0 too, none at all)
  checkpoint_every: int = 100
  # also save once this many minutes have passed since the last save began (checked after every step); 0: never
  checkpoint_minutes: float = 0
  keep_checkpoints: int = 2  # newest checkpoints kept
  log_every: int = 10  # log throughput and refresh the progress bar every this many steps
  profile: bool = False  # write a jax.profiler trace of PROFILE_STEPS steps into workdir/profile
  stop_after_bad_steps: int = 5  # non-finite steps in a row (each skipped) after which the run stops
  loss_log: str = ""  # append {"step", "loss"} JSON lines here at every sync; "": none
  # sample the live arrays' bytes per memory kind while training (a thread: steps slow a little) and print the peaks,
  # with the device allocator's, at the end (what benchmarks.plan_vs_peak compares with the plan)
  memory_peaks: bool = False
  # every this many steps (not at step 0), log the loss of --eval_batches held-out batches as eval_loss and
  # eval_perplexity (TFDS: --eval_split; stdlib: a slice of documents no step trains on); 0: never
  eval_every: int = 0
  eval_batches: int = 4  # held-out batches, of the training batch's shape, that each evaluation runs: the same ones

  def __post_init__(self):
    for field in ("steps", "keep_checkpoints", "log_every", "stop_after_bad_steps", "eval_batches"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
    if self.checkpoint_every < 0:
      raise ValueError(f"checkpoint_every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}")
    if self.eval_every < 0:
      raise ValueError(f"eval_every must be >= 0 (0: no evaluation), got {self.eval_every}")
    if not (math.isfinite(self.checkpoint_minutes) and self.checkpoint_minutes >= 0):
      raise ValueError(f"checkpoint_minutes must be finite and >= 0 (0: no saves by time), got "
                       f"{self.checkpoint_minutes}")

  @property
  def saves(self) -> bool:
    """Whether the run saves checkpoints at all (by steps or by time)."""
    return bool(self.checkpoint_every or self.checkpoint_minutes)


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

  def evaluate(self, state, batch: dict[str, np.ndarray]) -> tuple[typing.Any, jax.Array]:
    """(`settle(state)`, the loss of `batch` on its params), forward only: nothing else changes. May donate
    `state`; None where the step has none."""

  def checkpoint(self, state) -> typing.Any:
    """What a checkpoint of the settled `state` holds: a sljax.checkpoint.View (an engine's per-layer arrays,
    sljax.checkpoint_layout) or the state itself."""

  def checkpoint_target(self, key: jax.Array) -> typing.Any:
    """What a restore places (a View), or None: the arrays of `abstract(key)` as they are."""


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


def _say(line: str):
  """One line on stderr, from a signal handler: unbuffered (a print there can land inside the main thread's own write
  to the same stream, which Python refuses as a reentrant call)."""
  os.write(2, f"{line}\n".encode())


def _exit_now(code: int):
  """Ends the process at once: no interpreter teardown, whose threads (XLA's compiler, orbax's writers) a signal
  can catch half-way (a segfault), and nothing that could flush a partial file. The kernel drops the workdir lock."""
  for stream in (sys.stdout, sys.stderr):  # what was printed (the plan, say), unless the signal landed in a write
    try:
      stream.flush()
    except (RuntimeError, OSError, ValueError):
      pass
  os._exit(code)


class _Signals:
  """Installs `_handle` for SIGTERM and SIGINT while entered (from the main thread: Python runs handlers there only)
  and puts the handlers before it back on exit."""

  def __enter__(self):
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def __exit__(self, *exc_info):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum, frame):
    raise NotImplementedError


class ExitOnSignal(_Signals):
  """Outside the step loop (train.py enters it before anything is compiled or allocated; the loop's StopSignal takes
  over from the first step to the last save): SIGTERM / SIGINT end the process at once with one `sljax:` line and
  rc 128 + the signal's number (143, 130), as a shell reports a process the signal ended. Nothing is lost: no step
  is in flight and no checkpoint is being written."""

  def _handle(self, signum, frame):
    _say(f"sljax: {signal.Signals(signum).name} outside the step loop (start-up, or after the last save): exiting "
         f"at once; nothing is lost (no step is in flight, no checkpoint is being written)")
    _exit_now(128 + signum)


class StopSignal(_Signals):
  """While entered, the first SIGTERM or SIGINT sets `received` (the signal's name) instead of ending the process, so
  the loop finishes its step in flight, saves it and returns; it says so at once. A second one (an impatient Ctrl-C,
  a scheduler's repeated SIGTERM) is answered and does not interrupt the save; a third ends the process at once
  (rc 128 + its number), saying which steps are lost. The loop keeps `step` (the last step dispatched) and `saved`
  (the newest checkpoint's step, None: none; `saving` False: the run saves none) up to date for those lines."""

  def __init__(self):
    self.received, self.signals, self.step, self.saved, self.saving = None, 0, 0, None, True

  def _lost(self) -> str:
    if not self.saving:
      return "the run saves no checkpoints (--checkpoint_every=0)"
    since = f"checkpoint {self.saved}" if self.saved is not None else "the start (no checkpoint yet)"
    return f"the steps since {since}, up to step {self.step}"

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    self.signals += 1
    if self.signals == 1:
      self.received = name
      what = "saving it" if self.saving else "exiting (no checkpoints: --checkpoint_every=0)"
      _say(f"sljax: {name}: finishing the step in flight, then {what}; a third signal aborts at once")
    elif self.signals == 2:
      _say(f"sljax: {name} again: still stopping cleanly; one more aborts at once and loses {self._lost()}")
    else:
      _say(f"sljax: {name} a third time: aborted; lost: {self._lost()}")
      _exit_now(128 + signum)


def _any_process(*flags: bool) -> tuple[bool, ...]:
  """Whether each flag is set in any process, in one all-gather. On several hosts every process must call this at
  the same step: a signal that reaches one host (or reaches them at different steps), or a save that one host's
  clock finds due, then acts on all of them after the same step. The all-gather waits for the step in flight, so the
  next step's first weights start crossing only after it (a gap of about one group's copy per step: ~15 ms of
  llama13b's 11 s); with one process nothing waits."""
  if jax.process_count() == 1:
    return tuple(bool(flag) for flag in flags)
  gathered = multihost_utils.process_allgather(np.asarray(flags, bool))  # [processes, flags]
  return tuple(bool(flag) for flag in np.any(gathered.reshape(-1, len(flags)), axis=0))


def _in_a_row(step: int, skipped: set[int]) -> int:
  """Length of the run of consecutive skipped steps that ends at `step`."""
  length = 1
  while step - length in skipped:
    length += 1
  return length


class WorkdirBusy(RuntimeError):
  """Another run that is still alive holds the workdir."""


LOCK_FILE = "lock"  # in the workdir: an flock(2) on it, and who holds it
clock = time.monotonic  # what --checkpoint_minutes measures (a test's fake clock replaces it)
_held: dict[str, "WorkdirLock"] = {}  # workdir -> the lock this process holds on it, while `train` runs


class WorkdirLock:
  """An exclusive flock(2) on <workdir>/lock, so that two runs never train into one workdir (the second would resume
  from the first's newest checkpoint and both would save over each other). The kernel drops an flock when its
  process ends, however it ends: a killed run's lock file stays but blocks nothing. On several hosts only the first
  process takes it (the others share its workdir or have their own)."""

  def __init__(self, workdir: str):
    self.workdir, self.path = workdir, os.path.join(workdir, LOCK_FILE)
    self._fd, self._made = None, False

  def acquire(self) -> str | None:
    """Takes the lock; returns None, or a line saying who holds it (the lock file's record of that run)."""
    self._made = not os.path.isdir(self.workdir)
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.read(fd, 4096).decode(errors="replace").strip() or "a run that has not said who it is"
      os.close(fd)
      return (f"workdir {self.workdir} is in use by another run ({holder}): two runs in one workdir would save over "
              f"each other's checkpoints; wait for it to end, or give this run another --workdir")
    except OSError as error:  # a filesystem without flock: train unguarded rather than not at all
      logging.warning("cannot lock workdir %s (%s): nothing stops a second run from using it", self.workdir, error)
      return None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    self._fd = fd
    return None

  def release(self):
    """Lets the lock go. The file stays (unlinked, a run waiting on it and one that makes it anew could both hold
    "the" lock); a workdir this lock made and nothing else wrote to goes too."""
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None
    if self._made and os.listdir(self.workdir) == [LOCK_FILE]:
      os.remove(self.path)
      os.rmdir(self.workdir)


def hold_workdir(workdir: str):
  """Locks `workdir` for the `train` call that runs this, on every process of the run or none; WorkdirBusy (one
  line) while another live run holds it. After the disk check, which must find nothing written."""
  lock = WorkdirLock(workdir) if jax.process_index() == 0 else None
  refusal = lock.acquire() if lock else None
  if lock:
    _held[os.path.abspath(workdir)] = lock
  busy, = _any_process(refusal is not None)
  if busy:
    raise WorkdirBusy(refusal or f"workdir {workdir} is in use by another run (the first process of this run found "
                                 f"its lock held)")


def _releases_workdir(train):
  """`train`, letting go of the workdir lock that its call took (hold_workdir), however it ends."""
  @functools.wraps(train)
  def wrapped(engine, source, run_cfg, *args, **kwargs):
    try:
      return train(engine, source, run_cfg, *args, **kwargs)
    finally:
      lock = _held.pop(os.path.abspath(run_cfg.workdir), None)
      if lock:
        lock.release()
  return wrapped


@_releases_workdir
def train(engine: Step, source: Source, run_cfg: RunConfig, meta: dict, learning_rate: Callable[[int], float],
          flops: metrics.StepFlops, devices: int = 1, init_params=None) -> dict[int, float]:
  """Trains to `run_cfg.steps`, resuming from the newest checkpoint in the workdir; returns {step: loss} of the
  steps this call ran (step n is the loss of the n-th update, 1-based; NaN for a skipped step). `meta` is saved
  with every checkpoint. `learning_rate` (the schedule: update index -> rate) is logged with the losses, and from
  `flops` (per token) the MFU (model FLOPs, no recompute) and the HFU (recompute counted) over `devices` devices, on
  the progress line and in TensorBoard ("mfu", "hfu"). A run with no checkpoint yet starts from `init_params`
  (full-model params or a reader of them, e.g. models.hf.HFWeights) when given, else from a random init.

  The loop runs at most one step ahead of the device (it waits for step n-1's loss after dispatching step n), so
  SIGTERM / SIGINT stop it after the step in flight, which it saves. It reads losses at sync points: every
  `log_every` steps, at each checkpoint, at the end and after a signal. Losses are checked there, before any save,
  so no checkpoint holds a bad step's state (and a save refuses a state with a non-finite value:
  CheckpointWriteError); `stop_after_bad_steps` bad steps in a row raise Diverged. Before any step, ValueError when
  the workdir's disk cannot hold the checkpoints the run will keep.
  """
  device = jax.devices()[0]
  key = jax.random.key(source.cfg.seed)
  if run_cfg.eval_every and engine.evaluate is None:
    raise ValueError("--eval_every: this training step has no evaluate")
  eval_batches = source.eval_batches(run_cfg.eval_batches) if run_cfg.eval_every else []
  directory = os.path.join(run_cfg.workdir, "checkpoints")
  # What a checkpoint holds of the state (an engine's: per layer, sljax.checkpoint_layout) and what a restore places.
  checkpoint_of = engine.checkpoint
  restore_target = lambda: engine.checkpoint_target(key) or engine.abstract(key)
  if run_cfg.saves:  # before anything is written: a run must not find out at its first save
    # The saves after the newest checkpoint, the one a resume starts from.
    done = max(saved_steps(directory), default=0)
    saves = (run_cfg.steps - done if run_cfg.checkpoint_minutes
             else -(-run_cfg.steps // run_cfg.checkpoint_every) - done // run_cfg.checkpoint_every)
    check_disk(directory, saved_bytes(restore_target()), run_cfg.keep_checkpoints,
               saves=saves)  # the last step's save, if not one of them
  hold_workdir(run_cfg.workdir)  # refused while another run holds it; released when this call returns
  checkpointer = Checkpointer(directory, run_cfg.checkpoint_every, run_cfg.keep_checkpoints)

  def newest_good_state() -> tuple[int, object, dict]:  # checkpoints are only ever saved from good states
    return checkpointer.restore_latest(restore_target()) or (
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
  last_eval, training_tail = None, 0.0  # training_tail: the last step's work that an evaluation waited for
  step = start
  progress = tqdm(initial=start, total=run_cfg.steps, unit="step", disable=not lead)

  saved_at = clock()  # when the newest checkpoint's state was reached: a fresh or resumed state counts as saved now

  def save(force: bool = False):
    nonlocal state, saved_at
    if run_cfg.saves and (force or checkpointer.due(step)):  # settling costs the overlap of one step
      started = clock()
      state = engine.settle(state)
      if checkpointer.save(step, checkpoint_of(state), {**meta, "data_step": step, "skipped_steps": sorted(skipped)},
                           force):
        saved_at, stop.saved = started, step

  def evaluate(step_seconds: float) -> tuple[float, dict]:
    """The held-out loss of the state after `step` (the mean over eval_batches), logged, and its loss-log line; the
    wait for the step's own work to finish is training time (training_tail), the rest is not counted as training."""
    nonlocal state, training_tail
    started = time.perf_counter()
    jax.block_until_ready(state)  # the loss is known before the step's backward and updates have run
    ready, losses = time.perf_counter(), []
    for batch in eval_batches:  # the first applies clipping's parked updates: the params evaluated are the step's
      state, loss = engine.evaluate(state, batch)
      losses.append(loss)
    value = float(np.mean(jax.device_get(losses)))
    seconds, training_tail = time.perf_counter() - ready, ready - started
    with np.errstate(over="ignore"):
      perplexity = float(np.exp(value))  # inf past float64's range, NaN for a NaN loss
    logger.scalars(step, {"eval_loss": value, "eval_perplexity": perplexity,
                          "eval_seconds_per_batch": seconds / len(eval_batches)})
    finite = math.isfinite(value)
    line = {"step": step, "eval": True, "eval_loss": value if finite else None,
            "eval_perplexity": perplexity if finite and math.isfinite(perplexity) else None}
    logging.info("step %d: eval loss %.4f, perplexity %.2f on %d held-out batches; %.3f s per batch (a training "
                 "step: %.3f s)", step, value, perplexity, len(eval_batches), seconds / len(eval_batches), step_seconds)
    return value, line

  stop = StopSignal()
  stop.step, stop.saved, stop.saving = start, start or None, run_cfg.saves
  peaks = MemoryPeaks() if run_cfg.memory_peaks else contextlib.nullcontext()
  try:
    with stop, peaks:
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
        step = stop.step = step + 1
        pending.append((step, loss))
        window_steps += 1
        progress.update()
        if run_cfg.profile and step == min(profile_start + PROFILE_STEPS, run_cfg.steps):
          jax.block_until_ready(loss)
          jax.profiler.stop_trace()
        # Due by time: decided at every step (any process's clock), so the newest save is never older than
        # --checkpoint_minutes plus one step (and the save's own time).
        stopping, timed = _any_process(stop.received is not None, bool(run_cfg.checkpoint_minutes) and (
            clock() - saved_at >= 60 * run_cfg.checkpoint_minutes))
        evaluating = run_cfg.eval_every and step % run_cfg.eval_every == 0 and not stopping
        sync = (not history or step % run_cfg.log_every == 0 or checkpointer.due(step)
                or step == run_cfg.steps or stopping or replaying_bad_step or evaluating or timed)
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
        mfu = metrics.utilization(tokens_per_s, flops.model, devices, device)
        hfu = metrics.utilization(tokens_per_s, flops.hardware, devices, device)
        eval_line = None
        if evaluating and not (bad and not engine.skips_bad_steps):  # not on a state a bad step spoiled
          last_eval, eval_line = evaluate(seconds / window_steps)
        for n, value in losses.items():
          logger.scalars(n, {"loss": value, "learning_rate": float(learning_rate(n - 1))})
        logger.scalars(step, {"tokens_per_s": tokens_per_s, "mfu": mfu, "hfu": hfu,
                              "step_seconds": seconds / window_steps, "skipped_steps": len(skipped)})
        logger.flush()
        if loss_log:
          loss_log.writelines(json.dumps({"step": n, "loss": value if math.isfinite(value) else None}) + "\n"
                              for n, value in losses.items())
          if eval_line:
            loss_log.write(json.dumps(eval_line) + "\n")
          loss_log.flush()
        if not history:
          logging.info("first step (compilation included): %.1f s, loss %.3f", seconds, losses[min(losses)])
        finite = [value for value in losses.values() if math.isfinite(value)]
        if finite:
          progress.set_description(metrics.progress_description(sum(finite) / len(finite), tokens_per_s, mfu, hfu,
                                                                last_eval))
        history.update(losses)
        pending, window_start, window_steps = [], time.perf_counter() - training_tail, 0
        training_tail = 0.0

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
        save(force=replaying_bad_step or timed)  # saved past the bad step, a next one in a row rewinds with no replay
        if stopping:
          break
      save(force=True)
      if stopping:
        saved = (f"saved {checkpointer.directory}/{step}; the same command resumes" if run_cfg.saves
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
