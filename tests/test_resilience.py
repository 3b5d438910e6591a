"""What a run survives: SIGKILL and resume, SIGTERM / SIGINT, non-finite steps, broken or foreign checkpoints."""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sljax.steps
from sljax import launch, trainer
from sljax.checkpoint import StateHandler, read_arrays
from sljax.data import make_source

from helpers import REPO, TINY, train_in_process

ENGINES = {"device": ["--engine=device"], "offload": ["--engine=offload", "--sub_batches=2", "--live_layers=1"]}
STEPS = 15
# Every run here, whatever its length, decays its learning rate over the uninterrupted runs' STEPS: the schedule is
# compiled into the step, so with one schedule an engine's step compiles once, in the first run (train.py processes
# and in-process runs share conftest.py's compilation cache).
SCHEDULE = [f"--decay_steps={STEPS}"]


def run_args(workdir, engine: str) -> list[str]:
  """The flags (beside TINY and SCHEDULE) of every run of the kill/stop/resume test and of its uninterrupted runs."""
  return [f"--steps={STEPS}", "--checkpoint_every=3", f"--loss_log={workdir}.jsonl", *ENGINES[engine]]


def command(workdir, engine: str) -> list[str]:
  return [sys.executable, "train.py", f"--workdir={workdir}", *TINY, *SCHEDULE, *run_args(workdir, engine)]


def train(workdir, *args) -> dict[int, float]:
  return train_in_process(workdir, *SCHEDULE, *args)


@pytest.fixture(scope="module")
def runs():
  """Starts train.py processes, their stderr appended to <workdir>.stderr."""

  def run(workdir, engine: str) -> subprocess.Popen:
    with open(f"{workdir}.stderr", "a") as stderr:
      return subprocess.Popen(command(workdir, engine), cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)

  return run


def errors(workdir) -> str:
  with open(f"{workdir}.stderr") as f:
    return f.read()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, str]:
  """Workdir of an uninterrupted run of `command` for each engine. In this process: its losses are a train.py
  process's, without the 6 s of CPU (2 cores) that starting one takes."""
  workdirs = {engine: tmp_path_factory.mktemp(engine) / "run" for engine in ENGINES}
  for engine, workdir in workdirs.items():
    train(workdir, *run_args(workdir, engine))
  return workdirs


def logged(workdir) -> list[tuple[int, float]]:
  """(step, loss) of every line the runs in `workdir` logged, resumed runs' repeats included."""
  if not os.path.exists(f"{workdir}.jsonl"):
    return []
  with open(f"{workdir}.jsonl") as f:
    return [(line["step"], line["loss"]) for line in map(json.loads, f)]


def wait_for_step(process: subprocess.Popen, workdir, step: int, lines_before: int):
  """Returns once `process` has logged `step` (or a later one)."""
  while not any(n >= step for n, _ in logged(workdir)[lines_before:]):
    assert process.poll() is None, f"the run ended before step {step}:\n{errors(workdir)}"
    time.sleep(0.005)


def stop_twice(process: subprocess.Popen, workdir, stop: signal.Signals):
  """Sends `stop`, then again 20-100 ms after the run says it is stopping. Python runs its handler once for signals
  that arrive before it runs: on a loaded machine two sent 20 ms apart could be one."""
  process.send_signal(stop)
  deadline = time.monotonic() + 30
  while (f"sljax: {stop.name}: finishing the step in flight" not in errors(workdir)
         and time.monotonic() < deadline and process.poll() is None):
    time.sleep(0.001)
  time.sleep(random.uniform(0.02, 0.1))
  process.send_signal(stop)


@pytest.mark.slow
@pytest.mark.parametrize("engine, stop", [("device", signal.SIGTERM), ("offload", signal.SIGINT)],
                         ids=["device-SIGTERM", "offload-SIGINT"])
def test_killed_and_stopped_runs_resume_with_the_losses_of_an_uninterrupted_run(tmp_path, runs, uninterrupted,
                                                                                engine, stop):
  expected = dict(logged(uninterrupted[engine]))
  assert sorted(expected) == list(range(1, STEPS + 1))
  workdir = tmp_path / "run"

  kill_at = random.randint(2, STEPS // 3)
  killed = runs(workdir, engine)
  wait_for_step(killed, workdir, kill_at, 0)
  killed.kill()
  assert killed.wait() == -signal.SIGKILL

  stop_at = random.randint(STEPS // 3 + 2, STEPS // 2)
  lines_before = len(logged(workdir))
  stopped = runs(workdir, engine)
  wait_for_step(stopped, workdir, stop_at, lines_before)
  stop_twice(stopped, workdir, stop)  # as a scheduler repeats its signal: the second lets the save finish
  assert stopped.wait() == 0, errors(workdir)
  assert f"sljax: {stop.name} again: still stopping cleanly" in errors(workdir)
  last = logged(workdir)[-1][0]
  saved = os.path.join(workdir, "checkpoints", str(last))
  assert f"{stop.name}: stopped after step {last}; saved {saved}; the same command resumes" in errors(workdir)
  assert os.path.isdir(saved) and last < STEPS

  # The same command again, in this process: the resume reads only what the stopped process left on disk.
  train(workdir, *run_args(workdir, engine))
  losses = logged(workdir)
  assert {n for n, _ in losses} == set(expected), f"killed after step {kill_at}, stopped after step {last}"
  for n, loss in losses:  # every run's lines, the steps that resumed runs repeated included
    np.testing.assert_allclose(loss, expected[n], rtol=1e-6, err_msg=f"step {n}, killed after step {kill_at}")


class Exited(BaseException):
  """What trainer._exit_now raises in these tests instead of ending the process."""


def exit_raises(monkeypatch):
  def exit_now(code):
    raise Exited(code)

  monkeypatch.setattr(trainer, "_exit_now", exit_now)


def test_a_second_stop_signal_is_answered_and_a_third_aborts_saying_what_is_lost(monkeypatch, capfd):
  exit_raises(monkeypatch)
  before = signal.getsignal(signal.SIGINT)  # Python's own, or SIG_IGN where a shell started the suite in the background
  with trainer.StopSignal() as stop:
    stop.step, stop.saved = 7, 5
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.received == "SIGTERM"
    os.kill(os.getpid(), signal.SIGINT)  # 20-100 ms later, say: once it killed the run and lost steps 6 and 7
    assert stop.received == "SIGTERM"
    stop.step = 8
    with pytest.raises(Exited) as exited:
      os.kill(os.getpid(), signal.SIGINT)
  assert exited.value.args == (128 + signal.SIGINT,)
  assert capfd.readouterr().err.splitlines() == [
      "sljax: SIGTERM: finishing the step in flight, then saving it; a third signal aborts at once",
      "sljax: SIGINT again: still stopping cleanly; one more aborts at once and loses the steps since checkpoint 5, "
      "up to step 7",
      "sljax: SIGINT a third time: aborted; lost: the steps since checkpoint 5, up to step 8"]
  assert signal.getsignal(signal.SIGINT) is before  # the handlers before it are back


def test_a_signal_outside_the_step_loop_ends_the_process_at_once_in_one_line(monkeypatch, capfd):
  exit_raises(monkeypatch)
  with pytest.raises(Exited) as exited, trainer.ExitOnSignal():
    os.kill(os.getpid(), signal.SIGTERM)
  assert exited.value.args == (128 + signal.SIGTERM,)
  assert capfd.readouterr().err == ("sljax: SIGTERM outside the step loop (start-up, or after the last save): exiting "
                                    "at once; nothing is lost (no step is in flight, no checkpoint is being written)\n")
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def copy_run(source, workdir) -> str:
  """A copy of a finished run's workdir; returns its newest checkpoint's directory."""
  shutil.copytree(source, workdir)
  newest = max(int(name) for name in os.listdir(workdir / "checkpoints"))
  return str(workdir / "checkpoints" / str(newest))


@pytest.mark.slow
def test_corrupt_checkpoint_fails_with_one_line_naming_it(tmp_path, uninterrupted):
  newest = copy_run(uninterrupted["device"], tmp_path / "run")
  with open(os.path.join(newest, "state", "manifest.json"), "r+b") as f:
    f.truncate(100)
  with pytest.raises(SystemExit) as error:
    train(tmp_path / "run", f"--steps={2 * STEPS}", "--checkpoint_every=3", *ENGINES["device"])
  assert str(error.value).startswith(f"sljax: checkpoint {newest} cannot be read (")
  assert str(error.value).endswith("); delete it to resume from the one before") and "\n" not in str(error.value)


@pytest.mark.slow
def test_checkpoint_of_another_model_fails_with_one_line_naming_it(tmp_path, uninterrupted):
  newest = copy_run(uninterrupted["device"], tmp_path / "run")
  with pytest.raises(SystemExit) as error:
    train(tmp_path / "run", f"--steps={2 * STEPS}", "--checkpoint_every=3", "--set=num_layers=3")
  assert str(error.value).startswith(f"sljax: checkpoint {newest} holds another training state than this run's: ")
  assert str(error.value).endswith("; use another --workdir") and "\n" not in str(error.value)


def saved_states(workdir) -> dict[int, list[np.ndarray]]:
  """Every checkpoint's training state, as numpy arrays in manifest order, by step."""
  return {int(name): list(read_arrays(str(workdir / "checkpoints" / name)).values())
          for name in os.listdir(workdir / "checkpoints")}


class BadBatches:
  """A data source whose batches for `steps` (1-based, as the trainer counts them) make the loss NaN."""

  def __init__(self, source, steps: set[int]):
    self.source, self.cfg, self.steps = source, source.cfg, steps

  def batch(self, step: int) -> dict[str, np.ndarray]:
    batch = self.source.batch(step)
    return dict(batch, weights=batch["weights"] * np.nan) if step + 1 in self.steps else batch


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["device", "offload"])
def test_bad_steps_are_skipped_never_saved_and_stop_the_run_when_in_a_row(tmp_path, monkeypatch, engine):
  monkeypatch.setattr(launch, "make_source", lambda *args: BadBatches(make_source(*args), {3, 5, 6, 7}))
  with pytest.raises(SystemExit) as stopped:
    train(tmp_path / "run", "--steps=10", "--checkpoint_every=1", "--keep_checkpoints=10",
                     "--stop_after_bad_steps=3", f"--loss_log={tmp_path}/losses.jsonl", *ENGINES[engine])
  checkpoints = tmp_path / "run" / "checkpoints"
  assert str(stopped.value) == (f"sljax: steps 5-7, 3 in a row, had a non-finite loss or gradient: stopped (newest "
                                f"checkpoint, with none of their updates: {checkpoints / '6'})")
  with open(tmp_path / "losses.jsonl") as f:
    losses = {line["step"]: np.nan if line["loss"] is None else line["loss"] for line in map(json.loads, f)}
  assert sorted(losses) == list(range(1, 8))
  assert [n for n, loss in losses.items() if not np.isfinite(loss)] == [3, 5, 6, 7]

  states = saved_states(tmp_path / "run")
  assert sorted(states) == [1, 2, 3, 4, 5, 6]
  assert all(np.isfinite(x).all() for state in states.values() for x in state)
  for before, after in [(2, 3), (4, 5), (5, 6)]:  # a skipped step leaves the state as it was
    for x, y in zip(states[before], states[after], strict=True):
      np.testing.assert_array_equal(x, y)
  assert not all(np.array_equal(x, y) for x, y in zip(states[3], states[4]))
  with open(checkpoints / "6" / "meta" / "metadata") as f:
    assert json.load(f)["skipped_steps"] == [3, 5, 6]


def test_a_finite_loss_with_a_non_finite_gradient_is_a_bad_step_too():
  # d sqrt(w) / dw at w = 0 is infinite while sqrt(0) is 0.
  model = SimpleNamespace(init=lambda key: {"w": jnp.zeros(3)}, loss=lambda params, batch: jnp.sqrt(params["w"]).sum())
  engine = sljax.steps.all_on_device(model, optax.adam(0.1))
  state = engine.init(jax.random.key(0))
  before = jax.tree.map(np.asarray, state)
  state, loss = engine.step(state, {})
  assert np.isnan(loss)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_workdir_is_refused_before_anything_is_written(tmp_path):
  tmp_path.chmod(0o500)
  try:
    with pytest.raises(ValueError, match=f"workdir {tmp_path / 'run'} is not writable: {tmp_path} is read-only here"):
      trainer.check_workdir(str(tmp_path / "run"))
  finally:
    tmp_path.chmod(0o700)


def slowed_steps(monkeypatch, on_dispatch):
  """Makes the all-on-device engine's steps slow on the device (the dispatch stays fast) and calls
  `on_dispatch(step, losses so far)` after each dispatch."""
  make_engine = sljax.steps.all_on_device

  @jax.jit
  def slow(loss):
    x = jnp.full((256, 256), loss / 1e3)
    x = jax.lax.fori_loop(0, 40, lambda _, x: jnp.tanh(x @ x), x)
    return loss + 0 * x[0, 0]

  def engine(*args, **kwargs):
    inner, losses = make_engine(*args, **kwargs), []

    def step(state, batch):
      state, loss = inner.step(state, batch)
      losses.append(slow(loss))
      on_dispatch(len(losses), losses)
      return state, losses[-1]

    return inner._replace(step=step)

  monkeypatch.setattr(sljax.steps, "all_on_device", engine)


@pytest.mark.slow
def test_the_loop_runs_at_most_one_step_ahead_of_the_device(tmp_path, monkeypatch):
  in_flight = []
  slowed_steps(monkeypatch, lambda n, losses: in_flight.append(sum(not loss.is_ready() for loss in losses)))
  train(tmp_path / "run", "--steps=12", "--log_every=12", "--checkpoint_every=0", *ENGINES["device"])
  assert max(in_flight) <= 2, in_flight  # the step just dispatched and the one before it


def test_sigterm_stops_after_the_step_in_flight_and_saves_it(tmp_path, monkeypatch):
  done_at_signal = []

  def signal_when_3_steps_are_done(losses):  # as a signal from outside arrives: while the device computes
    while sum(loss.is_ready() for loss in list(losses)) < 3:
      time.sleep(0.001)
    done_at_signal.append(sum(loss.is_ready() for loss in list(losses)))
    os.kill(os.getpid(), signal.SIGTERM)

  def on_dispatch(n, losses):
    if n == 1:
      threading.Thread(target=signal_when_3_steps_are_done, args=(losses,), daemon=True).start()

  slowed_steps(monkeypatch, on_dispatch)
  history = train(tmp_path / "run", "--steps=20", "--log_every=10", "--checkpoint_every=10",
                             *ENGINES["device"])
  last = max(history)
  assert last <= done_at_signal[0] + 2, (done_at_signal, last)  # the steps in flight then, no more
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [str(last)]


def test_a_disk_too_small_for_the_checkpoints_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=10**5))
  with pytest.raises(SystemExit) as error:
    train(tmp_path / "run", "--steps=10", "--checkpoint_every=5", *ENGINES["device"])
  message = str(error.value)
  assert message.startswith(f"sljax: checkpoints need ") and f"under {tmp_path / 'run' / 'checkpoints'}" in message
  assert message.endswith("or train without checkpoints (--checkpoint_every=0)") and "\n" not in message
  assert not (tmp_path / "run").exists()
  assert sorted(train(tmp_path / "run", "--steps=2", "--checkpoint_every=0", *ENGINES["device"])) == [1, 2]
  assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("steps,saves", [(2, 1), pytest.param(3, 2, marks=pytest.mark.slow),
                                         pytest.param(4, 2, marks=pytest.mark.slow)])
def test_the_disk_check_counts_the_saves_the_run_makes(tmp_path, monkeypatch, steps, saves):
  """Every 2 steps, and the last step's unless it is one of them: a disk that holds one checkpoint suits a run that
  saves once (it was once asked for two)."""
  counted = []
  monkeypatch.setattr(trainer, "check_disk", lambda *args, saves: counted.append(saves))
  train(tmp_path / "run", f"--steps={steps}", "--checkpoint_every=2", *ENGINES["device"])
  assert counted == [saves] and len(os.listdir(tmp_path / "run" / "checkpoints")) == min(saves, 2)


@pytest.mark.slow
def test_a_resumed_run_counts_only_the_saves_after_its_checkpoint(tmp_path, monkeypatch):
  """The same command after a kill resumes at its newest checkpoint: it makes the saves after that one, not the whole
  run's (on the H200 a rerun was refused for room it did not need)."""
  train(tmp_path / "run", "--steps=4", "--checkpoint_every=2", *ENGINES["device"])
  counted = []
  monkeypatch.setattr(trainer, "check_disk", lambda *args, saves: counted.append(saves))
  train(tmp_path / "run", "--steps=7", "--checkpoint_every=2", *ENGINES["device"])
  assert counted == [2]  # steps 6 and 7 (the last), not 2, 4, 6 and 7


def test_a_run_whose_updates_poison_the_state_saves_nothing_and_says_so(tmp_path, monkeypatch):
  make_engine = sljax.steps.all_on_device

  def poisoning(*args, **kwargs):  # finite loss and gradient, non-finite update (a NaN learning rate does this)
    inner = make_engine(*args, **kwargs)
    poison = jax.jit(lambda state: jax.tree.map(lambda x: x * np.nan if x.dtype.kind == "f" else x, state))
    return inner._replace(step=lambda state, batch: (lambda out: (poison(out[0]), out[1]))(inner.step(state, batch)))

  monkeypatch.setattr(sljax.steps, "all_on_device", poisoning)
  with pytest.raises(SystemExit) as error:
    train(tmp_path / "run", "--steps=2", "--checkpoint_every=1", *ENGINES["device"])
  assert str(error.value).startswith("sljax: step 1's training state holds a non-finite value (")
  assert str(error.value).endswith("not saved; newest checkpoint none yet")
  assert not os.listdir(tmp_path / "run" / "checkpoints")


def test_a_disk_that_fills_during_a_save_is_one_line_and_a_non_zero_exit(tmp_path, monkeypatch):
  def full(self, directory, index, arrays):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(StateHandler, "_write_part", full)
  with pytest.raises(SystemExit) as error:
    train(tmp_path / "run", "--steps=2", "--checkpoint_every=2", *ENGINES["device"])
  message = str(error.value)
  assert message.startswith(f"sljax: saving step 2 to {tmp_path / 'run' / 'checkpoints'} failed: the disk is full (")
  assert message.endswith("nothing partial was left, newest checkpoint none yet") and "\n" not in message
  assert not os.listdir(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("make, says", [
    (lambda tmp: "gs://bucket/run", "is a URL; sljax writes to a local or mounted filesystem"),
    (lambda tmp: str(tmp / "a\0b"), "holds a NUL byte"),
    (lambda tmp: str(tmp / ("x" * 300) / "run"), "is longer than the 255 bytes the filesystem allows"),
    (lambda tmp: (os.symlink(tmp / "nowhere", tmp / "link"), str(tmp / "link" / "run"))[1], "is a broken link"),
    (lambda tmp: ((tmp / "file").write_text(""), str(tmp / "file" / "run"))[1], "is not a directory"),
], ids=["url", "nul", "long-name", "broken-link", "through-a-file"])
def test_a_workdir_that_cannot_be_made_is_refused_in_one_line(tmp_path, make, says):
  with pytest.raises(ValueError, match=says):
    trainer.check_workdir(make(tmp_path))


def hooked_steps(monkeypatch, after_step):
  """Calls `after_step(n)` after the all-on-device engine's n-th step call (1-based) returns its outputs."""
  make_engine = sljax.steps.all_on_device

  def engine(*args, **kwargs):
    inner, calls = make_engine(*args, **kwargs), [0]

    def step(state, batch):
      out = inner.step(state, batch)
      calls[0] += 1
      after_step(calls[0])
      return out

    return inner._replace(step=step)

  monkeypatch.setattr(sljax.steps, "all_on_device", engine)


@pytest.mark.slow
@pytest.mark.parametrize("every", [0, 5])
def test_checkpoint_minutes_keeps_the_newest_save_within_them_plus_one_step(tmp_path, monkeypatch, every):
  """Each step takes a second of a fake clock; --checkpoint_minutes=0.05 is 3 of them. Whenever the run is killed
  (at any step) and when it is stopped by SIGTERM (after step 8), the newest checkpoint's state is at most 3 s plus
  one step older than the run's."""
  now, ages = [0.0], []
  monkeypatch.setattr(trainer, "clock", lambda: now[0])
  checkpoints = tmp_path / "run" / "checkpoints"

  def after_step(n):
    now[0] = float(n)  # the state after step n exists at time n
    saved = [int(name) for name in os.listdir(checkpoints) if name.isdigit()] if checkpoints.exists() else []
    ages.append(n - 1 - max(saved, default=0))  # what a kill now leaves: step n - 1 is done, max(saved) saved
    if n == 8:
      os.kill(os.getpid(), signal.SIGTERM)

  hooked_steps(monkeypatch, after_step)
  history = train(tmp_path / "run", "--steps=12", "--log_every=100", f"--checkpoint_every={every}",
                  "--checkpoint_minutes=0.05", "--keep_checkpoints=10", *ENGINES["device"])
  assert sorted(history) == list(range(1, 9))
  saved = sorted(int(name) for name in os.listdir(checkpoints))
  assert saved == ([3, 6, 8] if every == 0 else [3, 5, 8])  # 5: --checkpoint_every; 8: the SIGTERM's save
  assert max(ages) <= 3 + 1, ages


def test_a_second_sigterm_soon_after_the_first_lets_the_save_finish(tmp_path, monkeypatch, capfd, caplog):
  def after_step(n):
    if n == 4:
      def twice():  # from outside, as a scheduler's repeated SIGTERM arrives: while the step or the save runs
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(random.uniform(0.02, 0.1))
        os.kill(os.getpid(), signal.SIGTERM)
      threading.Thread(target=twice, daemon=True).start()

  hooked_steps(monkeypatch, after_step)
  history = train(tmp_path / "run", "--steps=40", "--log_every=100", "--checkpoint_every=100", *ENGINES["device"])
  last = max(history)
  assert 4 <= last < 40 and sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [str(last)]
  errors = capfd.readouterr().err
  assert "sljax: SIGTERM: finishing the step in flight, then saving it" in errors
  assert "sljax: SIGTERM again: still stopping cleanly; one more aborts at once and loses the steps since the start" \
         in errors
  assert f"SIGTERM: stopped after step {last}; saved" in caplog.text


# Takes the workdir lock as a run does (an flock on <workdir>/lock, its holder written in it), says so, and waits.
HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], "lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, f"pid {os.getpid()} on a test host".encode())
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_second_run_in_a_live_runs_workdir_is_refused_and_a_killed_runs_lock_blocks_nothing(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(workdir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(SystemExit) as refused:
      train(workdir, "--steps=2", "--checkpoint_every=1", *ENGINES["device"])
    assert str(refused.value) == (
        f"sljax: workdir {workdir} is in use by another run (pid {holder.pid} on a test host): two runs in one workdir "
        f"would save over each other's checkpoints; wait for it to end, or give this run another --workdir")
    assert os.listdir(workdir) == ["lock"]  # nothing read or written: the live run's checkpoints are its own
  finally:
    holder.kill()  # as a run dies: the kernel drops its flock, the file stays
    holder.wait()
  assert sorted(train(workdir, "--steps=2", "--checkpoint_every=1", *ENGINES["device"])) == [1, 2]
  assert (workdir / "lock").read_text().startswith(f"pid {os.getpid()} on ")
  assert sorted(train(workdir, "--steps=3", "--checkpoint_every=1", *ENGINES["device"])) == [3]  # released: resumes


def start_train_py(workdir, *args) -> subprocess.Popen:
  """train.py on the tiny model; stdout a pipe (unbuffered), stderr appended to <workdir>.stderr."""
  with open(f"{workdir}.stderr", "a") as stderr:
    return subprocess.Popen([sys.executable, "train.py", f"--workdir={workdir}", *TINY, *SCHEDULE, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_ends_train_py_in_one_line(tmp_path, stop):
  """Sent as the plan is printed, the signal lands in the start-up (init, restore, compiles) or, rarely, in the
  first step: one line and rc 128 + n, or the step finished, saved and rc 0; never a traceback, a segfault or a
  signal swallowed while the run trains on."""
  workdir = tmp_path / "run"
  process = start_train_py(workdir, f"--steps={STEPS}", "--checkpoint_every=3", *ENGINES["offload"])
  for line in process.stdout:
    if line.startswith("recipe of"):
      break
  time.sleep(random.uniform(0, 0.2))
  process.send_signal(stop)
  process.stdout.read()
  code, text = process.wait(), errors(workdir)
  assert "Traceback" not in text and code in (0, 128 + stop), (code, text)
  if code == 0:
    assert f"{stop.name}: stopped after step 1; saved" in text, text
  else:
    assert text.splitlines()[-1] == (f"sljax: {stop.name} outside the step loop (start-up, or after the last save): "
                                     f"exiting at once; nothing is lost (no step is in flight, no checkpoint is "
                                     f"being written)"), text
    assert not os.path.isdir(workdir / "checkpoints") or not os.listdir(workdir / "checkpoints")
