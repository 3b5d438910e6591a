import errno
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import make_batch
from models.presets import build, get_config
from sljax import checkpoint, steps
from sljax.checkpoint import (CheckpointCorruptError, Checkpointer, CheckpointMismatchError, CheckpointWriteError,
                              DiskSpaceError, StateHandler, abstract_like, check_disk, read_params, restore_params)
from sljax.memory import PeakResident
from sljax.mesh import make_mesh
from sljax.optim import OptimConfig, make_optimizer
from sljax.resume import check_resumable, resumed_moments
from sljax.schedule import EngineConfig


def make_state():
  device = jax.devices()[0]
  params = {"w": jnp.arange(6.0).reshape(2, 3), "norm": jnp.full((3,), 0.5, jnp.bfloat16)}
  return {
      "params": params,
      "opt_state": optax.adamw(1e-3).init(params),
      # How the offload engine keeps state: in page-locked host memory.
      "host": jax.device_put(jnp.arange(4.0), jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")),
  }


def test_round_trip_keeps_values_dtypes_shardings_and_meta(tmp_path):
  state = make_state()
  checkpointer = Checkpointer(str(tmp_path), save_every=1)
  checkpointer.save(7, state, {"data_step": 7, "model": "llama-tiny"})
  checkpointer.close()

  step, restored, meta = Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))
  assert step == 7 and meta == {"data_step": 7, "model": "llama-tiny"}
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    assert got.dtype == want.dtype and got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert restored["host"].sharding.memory_kind == "pinned_host"


def test_saves_every_k_steps_keeps_the_newest_and_restores_the_latest(tmp_path):
  state = make_state()
  checkpointer = Checkpointer(str(tmp_path), save_every=2, keep=2)
  saved = [checkpointer.save(step, state, {"data_step": step}) for step in range(1, 8)]
  assert saved == [False, True, False, True, False, True, False]
  assert checkpointer.save(7, state, {"data_step": 7}, force=True)
  assert not checkpointer.save(7, state, {"data_step": 7}, force=True)  # already there
  checkpointer.close()
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]
  step, _, meta = Checkpointer(str(tmp_path), save_every=2).restore_latest(abstract_like(state))
  assert step == 7 and meta["data_step"] == 7


def test_no_checkpoint_restores_none(tmp_path):
  assert Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(make_state())) is None


@pytest.mark.parametrize("change, difference", [
    ("shape", "params.w: float32[2, 3] saved, float32[3, 3] wanted"),
    ("structure", "params.extra: absent saved, float32[3] wanted")])
def test_mismatched_state_raises_value_error_naming_the_directory(tmp_path, change, difference):
  state = make_state()
  checkpointer = Checkpointer(str(tmp_path), save_every=1)
  checkpointer.save(1, state, {})
  checkpointer.close()
  other = make_state()
  if change == "shape":
    other["params"]["w"] = jnp.zeros((3, 3))
  else:
    other["params"]["extra"] = jnp.zeros(3)
  with pytest.raises(CheckpointMismatchError, match=str(tmp_path / "1")) as error:
    Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(other))
  assert difference in str(error.value) and "\n" not in str(error.value)


def save_steps(directory, state, steps):
  checkpointer = Checkpointer(str(directory), save_every=1, keep=len(steps))
  for step in steps:
    checkpointer.save(step, state, {"data_step": step})
  checkpointer.close()


def test_an_interrupted_save_never_replaces_the_last_good_checkpoint(tmp_path):
  state = make_state()
  save_steps(tmp_path, state, [1, 2])
  # What a save killed mid-write leaves: orbax writes into a temporary directory and renames it when complete.
  half_written = tmp_path / "3.orbax-checkpoint-tmp-1764493200000000"
  shutil.copytree(tmp_path / "2", half_written)
  for path in glob.glob(str(half_written / "state" / "**" / "d" / "*"), recursive=True):
    os.truncate(path, 0)
  checkpointer = Checkpointer(str(tmp_path), save_every=1)
  assert not half_written.exists()  # removed on opening: its bytes are free for the next save
  step, restored, _ = checkpointer.restore_latest(abstract_like(state))
  assert step == 2
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
  assert checkpointer.save(3, restored, {"data_step": 3})  # the next save of that step goes through
  checkpointer.close()
  assert Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))[0] == 3


def test_a_corrupt_checkpoint_raises_one_line_naming_it_and_deleting_it_restores_the_one_before(tmp_path):
  state = make_state()
  save_steps(tmp_path, state, [1, 2])
  for path in glob.glob(str(tmp_path / "2" / "state" / "**" / "d" / "*"), recursive=True):
    os.truncate(path, os.path.getsize(path) // 2)
  with pytest.raises(CheckpointCorruptError) as error:
    Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))
  message = str(error.value)
  assert message.startswith(f"checkpoint {tmp_path / '2'} cannot be read (") and "\n" not in message
  assert message.endswith("delete it to resume from the one before")
  shutil.rmtree(tmp_path / "2")
  assert Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))[0] == 1


def test_restores_into_another_mesh_resharded(tmp_path):
  devices = jax.devices()
  on = lambda n: NamedSharding(Mesh(np.array(devices[:n]), ("fsdp",)), P("fsdp"))
  state = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), on(2))}
  save_steps(tmp_path, state, [1])
  target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=on(4))}
  _, restored, _ = Checkpointer(str(tmp_path), save_every=1).restore_latest(target)
  assert restored["w"].sharding == on(4)
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(32.0).reshape(8, 4))


# ---- bounded memory, integrity, a disk that fills -------------------------------------------------------------------


def offload_placed_state(leaves: int, leaf_mib: int) -> dict:
  """Half the leaves in device memory, half in pinned host memory, as the offload engine keeps a state."""
  device = jax.devices()[0]
  kinds = {"device": jax.sharding.SingleDeviceSharding(device),
           "host": jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")}
  size = leaf_mib * 2**20 // 4
  return {kind: [jax.device_put(jnp.full((size,), i, jnp.float32), sharding) for i in range(leaves // 2)]
          for kind, sharding in kinds.items()}


@pytest.mark.slow
def test_save_and_restore_stay_within_the_staging_budget_on_a_state_many_times_larger(tmp_path, monkeypatch):
  monkeypatch.setattr(checkpoint, "MIN_PART_BYTES", 1)  # WRITERS at once, as the default budget has them
  budget = 40 * 2**20  # parts of 2 MiB: PARTS_PER_BUDGET x (WRITERS + 1) of them
  # A process's first save starts orbax's and tensorstore's thread pools and caches (~100 MiB, whatever the state's
  # size): done on a small state first, so that what is measured is the staging.
  Checkpointer(str(tmp_path / "warm"), save_every=1).save(1, offload_placed_state(leaves=2, leaf_mib=1), {})
  state = offload_placed_state(leaves=192, leaf_mib=1)  # 192 MiB: 5 budgets
  checkpointer = Checkpointer(str(tmp_path / "run"), save_every=1, staging_bytes=budget)
  with PeakResident(0.001) as saving:
    checkpointer.save(1, state, {})
  target = abstract_like(state)
  del state
  with PeakResident(0.001) as restoring:
    _, restored, _ = checkpointer.restore_latest(target)
    restored = jax.block_until_ready(restored)
  # Staging the whole state at once, as orbax alone does, would cost 192-384 MiB (5-10 budgets). Restoring allocates
  # the state itself (192 MiB); above that only the staging. Threads and allocator caches add noise: 3 budgets.
  assert saving.extra < 3 * budget, saving.extra / 2**20
  assert restoring.extra - 192 * 2**20 < 3 * budget, restoring.extra / 2**20
  assert len(glob.glob(str(tmp_path / "run" / "1" / "state" / "part_*"))) == 192 // 2
  np.testing.assert_array_equal(np.asarray(restored["host"][3]), np.full(2**18, 3, np.float32))
  assert restored["host"][3].sharding.memory_kind == "pinned_host"


def in_flight(events: list[tuple], start: str, end: str) -> int:
  """The most parts between their `start` and `end` event at once."""
  most, now = 0, 0
  for kind, _ in events:
    now += (kind == start) - (kind == end)
    most = max(most, now)
  return most


def test_parts_shrink_as_writers_grow_and_a_small_budget_gets_fewer_writers_not_tiny_parts():
  mib = 2**20
  handler = StateHandler()  # 4 GiB: PARTS_PER_BUDGET x (4 writers + 1) parts of 204.8 MiB
  assert (handler.writers, handler.part_bytes) == (4, 4 * 2**30 // 20)
  # A restore holds up to 3 part bytes per part in flight (a save 4): 6 parts fit, 5 read while one is placed.
  assert handler.readers == 5
  handler.close()
  assert [checkpoint.writers_for(gib * 2**30) for gib in (0.25, 0.5, 1, 2)] == [1, 1, 3, 4]
  handler = StateHandler(2**30)  # 3 writers of 64 MiB parts, the floor
  assert (handler.writers, handler.part_bytes) == (3, 64 * mib)
  handler.close()


@pytest.fixture
def kib_parts(monkeypatch) -> int:
  """A staging budget of 1 KiB parts, written WRITERS at a time (no floor under the part size)."""
  monkeypatch.setattr(checkpoint, "MIN_PART_BYTES", 1)
  return checkpoint.PARTS_PER_BUDGET * (checkpoint.WRITERS + 1) * 1024


def kib_arrays(count: int) -> dict:
  return {f"w{i:02d}": jnp.full((256,), i, jnp.float32) for i in range(count)}  # 1 KiB each: a part each


def slow_writes(monkeypatch, events: list, fail_at: int | None = None):
  """Each part's write takes 0.3 s (a slow disk) and is recorded: ("write", index) and ("written", index); the
  write of part `fail_at` fails (a full disk) after its time."""
  write_part = StateHandler._write_part

  def writing(self, directory, index, arrays):
    events.append(("write", index))
    time.sleep(0.3)
    if index == fail_at:
      events.append(("failed", index))
      raise OSError(errno.ENOSPC, "No space left on device")
    write_part(self, directory, index, arrays)
    events.append(("written", index))

  monkeypatch.setattr(StateHandler, "_write_part", writing)


def test_arrays_larger_than_a_part_are_written_fewer_at_once_within_the_bytes_of_writers_plus_one_parts(
    tmp_path, monkeypatch, kib_parts):
  """An array larger than a part is a part of its own (llama13b's fp32 embedding: three parts' worth): four of them
  written at once took a save on the H200 0.5 GiB past its staging budget. Held bytes (staged to written) are counted
  here from the parts themselves."""
  events, stage, held = [], checkpoint._stage, []

  def staging(view, runs):
    size = sum(run.nbytes for run in runs)
    events.append(("copy", size))
    return stage(view, runs)

  write_part = StateHandler._write_part

  def writing(self, directory, index, arrays):
    time.sleep(0.2)
    write_part(self, directory, index, arrays)
    events.append(("written", sum(np.asarray(a).nbytes for a in arrays)))

  monkeypatch.setattr(checkpoint, "_stage", staging)
  monkeypatch.setattr(StateHandler, "_write_part", writing)
  state = {f"w{i:02d}": jnp.full((768 if i % 2 else 256,), i, jnp.float32) for i in range(10)}  # 3 KiB, 1 KiB
  save_steps_with(tmp_path, state, staging_bytes=kib_parts)
  now = 0
  for kind, size in events:
    now += size if kind == "copy" else -size
    held.append(now)
  assert max(held) <= (checkpoint.WRITERS + 1) * 1024 and max(held) >= 4 * 1024  # the budget, and used
  restored = Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))[1]
  np.testing.assert_array_equal(np.asarray(restored["w07"]), np.full(768, 7, np.float32))


def test_a_save_writes_several_parts_at_once_while_the_next_is_copied_and_holds_writers_plus_one_at_most(
    tmp_path, monkeypatch, kib_parts):
  events, stage = [], checkpoint._stage

  def staging(view, runs):
    events.append(("copy", view.arrays.index(runs[0].arrays[0])))
    return stage(view, runs)

  monkeypatch.setattr(checkpoint, "_stage", staging)
  slow_writes(monkeypatch, events)
  state = kib_arrays(8)
  save_steps_with(tmp_path, state, staging_bytes=kib_parts)
  assert sorted(index for kind, index in events if kind == "written") == list(range(8))
  assert in_flight(events, "write", "written") == checkpoint.WRITERS  # written at once
  assert in_flight(events, "copy", "written") == checkpoint.WRITERS + 1  # and the next copied meanwhile
  manifest = json.loads((tmp_path / "1" / "state" / "manifest.json").read_text())
  assert [(entry["name"], entry["part"]) for entry in manifest["arrays"]] == [(f"w{i:02d}", i) for i in range(8)]
  monkeypatch.undo()
  restored = Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))[1]
  assert all(np.array_equal(np.asarray(restored[name]), np.asarray(state[name])) for name in state)


def slow_reads_and_places(monkeypatch, events: list):
  """Each part's read takes 0.2 s (a slow disk) and each array's placing 0.1 s (a slow transfer), recorded: ("read",
  part) when its read starts, ("verified", part) when it is read, ("place", value) and ("placed", value) around
  placing an array (of kib_arrays: its value names it)."""
  check_files, verify, place = checkpoint._check_files, checkpoint._verify, checkpoint._place

  def reading(directory, part, files):
    events.append(("read", part))
    time.sleep(0.2)
    check_files(directory, part, files)

  def verifying(entry, value):
    verify(entry, value)
    events.append(("verified", entry["part"]))

  def placing(value, target):
    events.append(("place", int(value[0])))
    time.sleep(0.1)
    placed = place(value, target)
    events.append(("placed", int(value[0])))
    return placed

  monkeypatch.setattr(checkpoint, "_check_files", reading)
  monkeypatch.setattr(checkpoint, "_verify", verifying)
  monkeypatch.setattr(checkpoint, "_place", placing)


def held_part_bytes(events: list[tuple]) -> float:
  """The most host memory a restore held at once, in part bytes of equal parts, by the cost the restore assumes:
  RESTORE_BYTES_PER_PART_BYTE while a part is read, 1 once it is read until it is placed."""
  cost, most, now = checkpoint.RESTORE_BYTES_PER_PART_BYTE, 0.0, 0.0
  for kind, _ in events:
    now += {"read": cost, "verified": 1 - cost, "placed": -1}.get(kind, 0)
    most = max(most, now)
  return most


def test_a_restore_reads_several_parts_at_once_in_order_within_its_bytes_and_no_reader_waits_for_the_caller(
    tmp_path, monkeypatch, kib_parts):
  state = kib_arrays(16)
  save_steps_with(tmp_path, state, staging_bytes=kib_parts)
  events = []
  slow_reads_and_places(monkeypatch, events)
  checkpointer = Checkpointer(str(tmp_path), save_every=1, staging_bytes=kib_parts)
  readers = checkpointer.state_handler.readers
  assert readers == 5  # 20 parts' worth of budget at 3 part bytes a part in flight: 6 parts, one of them placed
  restored = checkpointer.restore_latest(abstract_like(state))[1]
  assert [value for kind, value in events if kind == "placed"] == list(range(16))  # in manifest order
  assert in_flight(events, "read", "verified") == readers  # read at once
  # Placing (0.1 s a part) is slower than 5 readers (0.2 s a part each): readers whose part waits for the caller go
  # on to the next parts, as far as the bytes allow: more than readers + 1 parts between read and placed, never more
  # than 3 part bytes for each of readers parts.
  assert in_flight(events, "read", "placed") > readers + 1
  assert held_part_bytes(events) <= checkpoint.RESTORE_BYTES_PER_PART_BYTE * readers
  assert all(np.array_equal(np.asarray(restored[name]), np.asarray(state[name])) for name in state)


def test_a_checkpoint_of_larger_parts_is_read_fewer_at_a_time_within_the_same_bytes(tmp_path, monkeypatch, kib_parts):
  state = kib_arrays(16)
  save_steps_with(tmp_path, state, staging_bytes=4 * kib_parts)  # parts of 4 KiB, four arrays each
  assert len(glob.glob(str(tmp_path / "1" / "state" / "part_*"))) == 4
  events = []
  slow_reads_and_places(monkeypatch, events)
  restored = Checkpointer(str(tmp_path), save_every=1, staging_bytes=kib_parts).restore_latest(abstract_like(state))[1]
  assert [value for kind, value in events if kind == "placed"] == list(range(16))
  # readers + 1 parts of 1 KiB (6 KiB): one 4 KiB part placed and one read ahead, as a single reader would.
  events = [(kind, part) for kind, part in events if kind in ("read", "placed") and (kind == "read" or part % 4 == 3)]
  assert in_flight(events, "read", "placed") == 2
  assert all(np.array_equal(np.asarray(restored[name]), np.asarray(state[name])) for name in state)


def test_a_writer_that_fails_mid_save_leaves_nothing_partial_and_the_checkpoints_before_intact(
    tmp_path, monkeypatch, kib_parts):
  state = kib_arrays(8)
  save_steps_with(tmp_path, state, staging_bytes=kib_parts)
  before = {path: open(path, "rb").read() for path in glob.glob(str(tmp_path / "1" / "**"), recursive=True)
            if os.path.isfile(path)}
  events = []
  slow_writes(monkeypatch, events, fail_at=2)
  checkpointer = Checkpointer(str(tmp_path), save_every=1, keep=5, staging_bytes=kib_parts)
  with pytest.raises(CheckpointWriteError, match="failed: the disk is full"):
    checkpointer.save(2, {name: value + 1 for name, value in state.items()}, {})
  assert in_flight(events, "write", "written") >= 2  # the other writers were writing when part 2 failed
  started = {index for kind, index in events if kind == "write"}
  assert started == {index for kind, index in events if kind in ("written", "failed")}  # and finished first
  assert sorted(os.listdir(tmp_path)) == ["1"]
  assert before == {path: open(path, "rb").read() for path in glob.glob(str(tmp_path / "1" / "**"), recursive=True)
                    if os.path.isfile(path)}
  monkeypatch.undo()
  step, restored, _ = checkpointer.restore_latest(abstract_like(state))
  assert step == 1 and all(np.array_equal(np.asarray(restored[name]), np.asarray(state[name])) for name in state)
  assert checkpointer.save(2, state, {})  # the next save goes through


def save_steps_with(directory, state, staging_bytes: int):
  checkpointer = Checkpointer(str(directory), save_every=1, staging_bytes=staging_bytes)
  checkpointer.save(1, state, {"data_step": 1})
  checkpointer.close()


def data_files(step_dir) -> list[str]:
  files = glob.glob(str(step_dir / "state" / "part_*" / "**" / "d" / "*"), recursive=True)
  return sorted(files, key=os.path.getsize)


def test_random_bytes_in_a_data_file_fail_the_checksum_with_one_line_naming_the_checkpoint(tmp_path):
  state = {"w": jnp.arange(2.0**16)}
  save_steps(tmp_path, state, [1, 2])
  largest = data_files(tmp_path / "2")[-1]
  with open(largest, "r+b") as f:  # the array's bytes: parts are written uncompressed
    f.seek(os.path.getsize(largest) // 2)
    f.write(np.random.default_rng(0).bytes(4096))
  with pytest.raises(CheckpointCorruptError) as error:
    Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))
  assert str(error.value) == (f"checkpoint {tmp_path / '2'} cannot be read (w fails its checksum); delete it to "
                              f"resume from the one before")
  shutil.rmtree(tmp_path / "2")
  assert Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))[0] == 1


def test_a_checksum_that_does_not_match_is_caught(tmp_path):
  state = make_state()
  save_steps(tmp_path, state, [1])
  manifest = tmp_path / "1" / "state" / "manifest.json"
  stored = json.loads(manifest.read_text())
  stored["arrays"][0]["crc32"] ^= 1
  manifest.write_text(json.dumps(stored))
  with pytest.raises(CheckpointCorruptError, match=f"{stored['arrays'][0]['name']} fails its checksum"):
    Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(state))


def test_a_state_with_a_non_finite_value_is_never_saved(tmp_path):
  state = make_state()
  save_steps(tmp_path, state, [1])
  state["host"] = jax.device_put(jnp.array([0.0, jnp.nan, 2.0, 3.0]), state["host"].sharding)
  checkpointer = Checkpointer(str(tmp_path), save_every=1, keep=5)
  with pytest.raises(CheckpointWriteError) as error:
    checkpointer.save(2, state, {})
  assert str(error.value) == (f"step 2's training state holds a non-finite value (host): not saved; newest "
                              f"checkpoint {tmp_path / '1'}")
  assert sorted(os.listdir(tmp_path)) == ["1"]
  assert checkpointer.restore_latest(abstract_like(state))[0] == 1


def test_a_disk_that_fills_during_a_save_leaves_nothing_partial_and_the_last_checkpoint_intact(tmp_path, monkeypatch):
  state = make_state()
  save_steps(tmp_path, state, [1])
  write_part = StateHandler._write_part

  def fill_the_disk(self, directory, index, arrays):
    if index == 1:
      raise OSError(errno.ENOSPC, "No space left on device")
    write_part(self, directory, index, arrays)

  monkeypatch.setattr(StateHandler, "_write_part", fill_the_disk)
  checkpointer = Checkpointer(str(tmp_path), save_every=1, keep=5, staging_bytes=64)  # a part per array
  with pytest.raises(CheckpointWriteError) as error:
    checkpointer.save(2, state, {})
  message = str(error.value)
  assert message.startswith(f"saving step 2 to {tmp_path} failed: the disk is full (") and "\n" not in message
  assert message.endswith(f"nothing partial was left, newest checkpoint {tmp_path / '1'}")
  assert sorted(os.listdir(tmp_path)) == ["1"]
  monkeypatch.undo()
  assert checkpointer.restore_latest(abstract_like(state))[0] == 1
  assert checkpointer.save(2, state, {})  # the next save goes through


def test_a_real_full_disk(tmp_path):
  mount = tmp_path / "small"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here")
  try:
    small = {"w": jnp.ones(1000)}
    big = {"w": jnp.ones(1000), "x": jnp.ones(2**19)}  # 2 MiB: more than the disk
    checkpointer = Checkpointer(str(mount), save_every=1, keep=5)
    checkpointer.save(1, small, {})
    with pytest.raises(CheckpointWriteError, match="failed: the disk is full"):
      checkpointer.save(2, big, {})
    assert sorted(os.listdir(mount)) == ["1"]
    assert checkpointer.restore_latest(abstract_like(small))[0] == 1
    checkpointer.close()
  finally:
    subprocess.run(["umount", str(mount)])


def test_the_disk_is_checked_for_what_the_run_keeps(tmp_path, monkeypatch):
  free = lambda gb: monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=int(gb * 1e9)))
  free(10)
  check_disk(str(tmp_path / "checkpoints"), int(3e9), keep=2, saves=5)  # 3 at once: 9 GB
  with pytest.raises(DiskSpaceError) as error:
    check_disk(str(tmp_path / "checkpoints"), int(4e9), keep=2, saves=5)
  assert str(error.value).startswith(f"checkpoints need 12.0 GB free under {tmp_path / 'checkpoints'} (3 of 4.0 GB")
  assert "but 10.0 GB is free; keep fewer (--keep_checkpoints=1)" in str(error.value)
  assert "(--checkpoint_every=0)" in str(error.value) and not (tmp_path / "checkpoints").exists()
  check_disk(str(tmp_path / "checkpoints"), int(4e9), keep=2, saves=1)  # a single save: 2 at once at most


def test_the_disk_check_counts_a_killed_saves_leftovers_as_free(tmp_path, monkeypatch):
  """A run killed while saving leaves orbax's temporary directory; the same command again must not be refused for
  the space it takes (the Checkpointer removes it before writing). Seen on the H200: 4 GB left, the rerun refused."""
  monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=int(5e9)))
  directory = tmp_path / "checkpoints"
  (directory / "2").mkdir(parents=True)
  left = directory / "4.orbax-checkpoint-tmp-1764493200000000" / "state"
  left.mkdir(parents=True)
  (left / "part").write_bytes(b"\0" * 2_000_000)
  check_disk(str(directory), int(7e6), keep=1, saves=1)  # 5 GB + the 2 MB left over
  with pytest.raises(DiskSpaceError, match="but 5.0 GB is free"):
    check_disk(str(directory), int(6e9), keep=1, saves=1)


# ---- reading without a training state -------------------------------------------------------------------------------


def test_read_params_reads_the_model_params_of_either_engines_state_by_layer_range(tmp_path):
  """read_params' contract, which sljax.export writes from: .meta, .num_layers, outer() and layers(start, stop) as
  host numpy arrays equal to the saved params, from the device engine's state and from the offload engine's (layer
  groups of 2, 1 and 2 layers, whatever range is asked across them), with no optimizer state in what is returned."""
  from sljax.checkpoint import read_params

  rng = np.random.default_rng(0)
  layers = {"q_proj": {"kernel": rng.normal(size=(5, 4, 4)).astype(np.float32)},
            "norm": {"scale": rng.normal(size=(5, 4)).astype(np.float32)}}
  outer = {"embed_tokens": {"embedding": rng.normal(size=(8, 4)).astype(np.float32)}}
  groups = [jax.tree.map(lambda x, a=a, b=b: x[a:b], layers) for a, b in ((0, 2), (2, 3), (3, 5))]
  states = {"device": {"params": {"outer": outer, "layers": layers}, "opt_state": {"mu": {"outer": outer}}},
            "offload": {"step": np.int32(3), "outer": outer, "outer_opt": {"mu": outer},
                        "groups": [{"master": g, "opt": {"mu": g}} for g in groups]}}
  for name, state in states.items():
    checkpointer = Checkpointer(str(tmp_path / name / "checkpoints"), save_every=1, staging_bytes=4 * 200)
    checkpointer.save(3, jax.tree.map(jnp.asarray, state), {"model_config": {"num_layers": 5}, "run": name})
    checkpointer.close()
    reader = read_params(str(tmp_path / name))
    assert reader.meta == {"model_config": {"num_layers": 5}, "run": name} and reader.num_layers == 5, name
    assert jax.tree.structure(reader.outer()) == jax.tree.structure(outer)
    for got, want in zip(jax.tree.leaves(reader.outer()), jax.tree.leaves(outer)):
      assert isinstance(got, np.ndarray)
      np.testing.assert_array_equal(got, want)
    for start, stop in ((0, 5), (0, 1), (1, 4), (2, 3), (4, 5)):
      got = reader.layers(start, stop)
      assert jax.tree.structure(got) == jax.tree.structure(layers), (name, start, stop)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(layers)):
        assert isinstance(a, np.ndarray)
        np.testing.assert_array_equal(a, b[start:stop])
    for start, stop in ((0, 6), (3, 3), (-1, 2)):
      with pytest.raises(ValueError, match=f"layers {start}..{stop} are outside the checkpoint's 5"):
        reader.layers(start, stop)
  with pytest.raises(ValueError, match="holds no checkpoint"):
    read_params(str(tmp_path / "nothing"))
  save_steps(tmp_path / "adapters", {"adapters": {"a": jnp.ones(3)}, "opt": {"a": jnp.ones(3)}}, [1])
  with pytest.raises(ValueError, match="holds no model parameters sljax knows \\(keys: adapters, opt\\)"):
    read_params(str(tmp_path / "adapters"))


# ---- any placement resumes a checkpoint (sljax.checkpoint_layout) ---------------------------------------------------


@functools.cache
def placement_model(dtype: str = "bfloat16"):
  # bf16 compute: a host group keeps a compute copy of its weights, which a checkpoint must not hold.
  return build(get_config("llama-tiny", dict(num_layers=4, hidden_size=32, intermediate_size=48, num_heads=2,
                                             num_kv_heads=1, dtype=dtype)))


# One step object per placement, model and optimizer, shared by the tests: each traces its jitted calls once.
@functools.cache
def placed_step(model, name: str, clip: float = 0.0, moments: str = "float32") -> steps.StepFunctions:
  """The training step of one placement of `model`: the engine, its layer groups, memory and mesh."""
  optim = OptimConfig(learning_rate=1e-2, warmup_steps=1, decay_steps=8, grad_clip_norm=clip, moments_dtype=moments)
  offload = lambda mesh=None, **cfg: steps.offloaded(model, optim, EngineConfig(grad_clip_norm=clip, **cfg), mesh)
  return {
      "offload, groups of 1 and a tail of 1, state on host": lambda: offload(live_layers=1, tail_layers=1,
                                                                             sub_batches=2),
      "offload, groups of 2, one group's state on the device": lambda: offload(live_layers=2, sub_batches=2,
                                                                              device_state_groups=1),
      "device": lambda: steps.all_on_device(model, make_optimizer(optim)),
      "offload over fsdp:2": lambda: offload(make_mesh({"fsdp": 2}), live_layers=2),
      "device over data:2": lambda: steps.all_on_device(model, make_optimizer(optim), mesh=make_mesh({"data": 2})),
  }[name]()


ONE_DEVICE_HOST = "offload, groups of 1 and a tail of 1, state on host"
TWO_GROUPS = "offload, groups of 2, one group's state on the device"


def placement_batches(count: int) -> list[dict]:
  rng = np.random.default_rng(0)
  return [make_batch(rng, 4) for _ in range(count)]


# Parts of 16 KiB: the tiny model's stacked layer leaves (24 KiB) are saved a slice of layers at a time from device
# memory, and restored into it in chunks joined on the device. The tests whose point is elsewhere (the run carried
# on, the arrays a checkpoint holds, a refusal) save the state in one part: each part is an orbax checkpoint of its own,
# and 37 of them cost a save 1 s of CPU and a restore 0.3 s, one 0.2 s each.
PLACEMENT_STAGING = 8 * 16 * 2**10
ONE_PART_STAGING = 8 * checkpoint.MIN_PART_BYTES  # one writer, parts of 64 MiB


def save_placed(directory, step_functions, state, step: int = 1, staging_bytes: int = PLACEMENT_STAGING):
  checkpointer = Checkpointer(str(directory), save_every=1, staging_bytes=staging_bytes)
  checkpointer.save(step, step_functions.checkpoint(step_functions.settle(state)), {"data_step": step})
  checkpointer.close()


def restore_placed(directory, step_functions, staging_bytes: int = PLACEMENT_STAGING):
  checkpointer = Checkpointer(str(directory), save_every=1, staging_bytes=staging_bytes)
  restored = checkpointer.restore_latest(step_functions.checkpoint_target(jax.random.key(0)))
  checkpointer.close()
  return restored


def saved_arrays(step_dir) -> dict[str, tuple]:
  return {entry["name"]: (entry["dtype"], entry["shape"], entry["crc32"])
          for entry in json.loads((step_dir / "state" / "manifest.json").read_text())["arrays"]}


@pytest.mark.slow
def test_an_engine_checkpoint_holds_each_layers_master_weights_and_optimizer_state_and_no_compute_copy(tmp_path):
  model = placement_model()
  offload = placed_step(model, ONE_DEVICE_HOST)
  state = offload.init(jax.random.key(0))
  assert "weights" in state["groups"][0]  # what the host groups keep, and a checkpoint does not
  save_placed(tmp_path, offload, state, staging_bytes=ONE_PART_STAGING)
  arrays = saved_arrays(tmp_path / "1")
  for path, x in jax.tree_util.tree_flatten_with_path(state["groups"][2]["master"])[0]:  # group 2 is layer 2
    leaf = ".".join(str(entry.key) for entry in path)
    assert arrays[f"layers.2.{leaf}"][1] == list(x.shape[1:])  # no leading layer axis
    assert arrays[f"layers_opt.2.mu.{leaf}"][1] == arrays[f"layers_opt.2.nu.{leaf}"][1] == list(x.shape[1:])
  assert sorted({name.split(".")[0] for name in arrays}) == ["layers", "layers_opt", "opt_scalars", "outer",
                                                             "outer_opt", "step"]
  assert sorted({int(name.split(".")[1]) for name in arrays if name.startswith("layers")}) == [0, 1, 2, 3]
  assert not [name for name in arrays if "weights" in name]
  assert [name for name in arrays if name.startswith("opt_scalars")] == ["opt_scalars.0.count", "opt_scalars.1.count"]
  master_bytes = 4 * model.cfg.param_count()
  saved = sum(np.prod(shape, dtype=np.int64) * np.dtype(dtype).itemsize for dtype, shape, _ in arrays.values())
  assert saved < 3 * master_bytes + 64  # master + two fp32 moments (and the scalars): no compute copy


@pytest.mark.slow
@pytest.mark.parametrize("saved, restored, clip", [
    (ONE_DEVICE_HOST, "device", 0.0),
    ("device", TWO_GROUPS, 0.0),
    (ONE_DEVICE_HOST, TWO_GROUPS, 1e-3),  # clipping: the state settled first
    (ONE_DEVICE_HOST, "offload over fsdp:2", 0.0),  # 1 device to a 2-device mesh
    ("device", "device over data:2", 0.0),
])
def test_any_placement_restores_a_checkpoint_to_the_same_arrays(tmp_path, saved, restored, clip):
  """Restored into another engine, layer grouping, memory placement or mesh, a state saves back the arrays it was
  restored from, bit for bit (each array's CRC-32)."""
  model = placement_model()
  first = placed_step(model, saved, clip)
  state, _ = first.step(first.init(jax.random.key(0)), placement_batches(1)[0])  # optimizer state worth saving
  save_placed(tmp_path / "saved", first, state)
  second = placed_step(model, restored, clip)
  step, state, _ = restore_placed(tmp_path / "saved", second)
  assert step == 1
  save_placed(tmp_path / "again", second, state)
  assert saved_arrays(tmp_path / "again" / "1") == saved_arrays(tmp_path / "saved" / "1")


@pytest.mark.slow
@pytest.mark.parametrize("saved, restored, clip, rtol", [
    (ONE_DEVICE_HOST, ONE_DEVICE_HOST, 0.0, 0),  # the same math: bit-equal
    (ONE_DEVICE_HOST, "device", 0.0, 1e-5),  # another engine: other reduction orders
    ("device", TWO_GROUPS, 0.0, 1e-5),
    (ONE_DEVICE_HOST, TWO_GROUPS, 1e-3, 1e-5),  # clipping on, the global norm summed over other groups
    (ONE_DEVICE_HOST, "offload over fsdp:2", 0.0, 1e-5),  # the gradient reduce-scattered over 2 devices
])
def test_the_steps_after_a_restore_into_another_placement_continue_the_run(tmp_path, saved, restored, clip, rtol):
  """In fp32: in bf16 the engines' own sums differ by more (their gradients' rounding, which Adam's first steps
  amplify), while the arrays restored are the same either way (the test above)."""
  model = placement_model("float32")
  batches = placement_batches(4)
  first = placed_step(model, saved, clip)
  state = first.init(jax.random.key(0))
  for batch in batches[:2]:
    state, _ = first.step(state, batch)
  state = first.settle(state)
  save_placed(tmp_path, first, state, step=2, staging_bytes=ONE_PART_STAGING)
  uninterrupted = []
  for batch in batches[2:]:  # the second of them needs the optimizer state too
    state, loss = first.step(state, batch)
    uninterrupted.append(float(loss))
  # Into another engine object even for the same placement: the restored state alone must carry the run on.
  second = (placed_step if restored != saved else placed_step.__wrapped__)(model, restored, clip)
  _, state, _ = restore_placed(tmp_path, second, staging_bytes=ONE_PART_STAGING)
  resumed = []
  for batch in batches[2:]:
    state, loss = second.step(state, batch)
    resumed.append(float(loss))
  if rtol:
    np.testing.assert_allclose(resumed, uninterrupted, rtol=rtol)
  else:
    assert resumed == uninterrupted


@pytest.mark.slow
def test_a_first_moment_saved_in_bf16_restores_as_fp32_and_back(tmp_path, caplog):
  model = placement_model()
  bf16 = placed_step(model, ONE_DEVICE_HOST, moments="bfloat16")
  state, _ = bf16.step(bf16.init(jax.random.key(0)), placement_batches(1)[0])
  save_placed(tmp_path / "bf16", bf16, state)
  fp32 = placed_step(model, TWO_GROUPS, moments="float32")
  _, restored, _ = restore_placed(tmp_path / "bf16", fp32)
  assert "optimizer state cast bfloat16 -> float32" in caplog.text
  assert {x.dtype for x in jax.tree.leaves(restored["groups"][0]["opt"][0].mu)} == {jnp.dtype(jnp.float32)}
  save_placed(tmp_path / "fp32", fp32, restored)
  back = restore_placed(tmp_path / "fp32", placed_step(model, ONE_DEVICE_HOST, moments="bfloat16"))[1]
  save_placed(tmp_path / "again", bf16, back)  # bf16 -> fp32 is exact, so fp32 -> bf16 gives the saved values
  assert saved_arrays(tmp_path / "again" / "1") == saved_arrays(tmp_path / "bf16" / "1")


@pytest.mark.slow
@pytest.mark.parametrize("restored", ["device", TWO_GROUPS])
def test_8bit_moments_restore_into_another_placement_bit_for_bit(tmp_path, restored):
  """Their codes (int8 m, uint8 v) and fp32 scales are optimizer leaves like any: saved per layer, restored into
  another engine or grouping as they were. A run with float moments cannot restore them (no cast between codes and
  floats): its request is refused before anything is allocated (sljax.resume.resumed_moments), a library caller's
  restore here."""
  model = placement_model()
  first = placed_step(model, ONE_DEVICE_HOST, moments="int8")
  state, _ = first.step(first.init(jax.random.key(0)), placement_batches(1)[0])
  save_placed(tmp_path / "saved", first, state)
  arrays = saved_arrays(tmp_path / "saved" / "1")
  kinds = {(name.split(".")[2], name.split(".")[-1], dtype) for name, (dtype, _, _) in arrays.items()
           if name.startswith("layers_opt.")}
  assert kinds == {("mu", "codes", "int8"), ("nu", "codes", "uint8"), ("mu", "scales", "float32"),
                   ("nu", "scales", "float32")}
  second = placed_step(model, restored, moments="int8")
  step, state, _ = restore_placed(tmp_path / "saved", second)
  assert step == 1
  save_placed(tmp_path / "again", second, state)
  assert saved_arrays(tmp_path / "again" / "1") == arrays
  with pytest.raises(CheckpointMismatchError, match="holds another training state than this run's"):
    restore_placed(tmp_path / "saved", placed_step(model, restored, moments="float32"))


@pytest.mark.parametrize("saved, asked, refused", [
    ("int8", {"moments_dtype": "float32"}, True), ("bfloat16", {"moments_dtype": "int8"}, True),
    ("bfloat16", {"moments_dtype": "float32"}, False), ("int8", {}, False)])
def test_a_resume_asking_other_moments_than_8bit_ones_saved_is_refused_in_one_line(tmp_path, saved, asked, refused):
  checkpointer = Checkpointer(str(tmp_path), save_every=1)
  checkpointer.save(1, {"w": jnp.ones(3)}, {"optim": {"moments_dtype": saved}})
  checkpointer.close()
  request = SimpleNamespace(optim=asked)
  if not refused:
    assert resumed_moments(request, str(tmp_path)) == (None if asked else saved)
    return
  with pytest.raises(ValueError) as error:
    resumed_moments(request, str(tmp_path))
  assert str(error.value) == (
      f"checkpoint {tmp_path / '1'} holds {saved} Adam moments, and this run asks for {asked['moments_dtype']}: a "
      f"restore casts only between float dtypes; resume with --moments_dtype={saved}, or use another --workdir")


@pytest.mark.slow
def test_params_read_back_from_a_checkpoint_of_either_format_are_the_models(tmp_path):
  model = placement_model()
  offload = placed_step(model, TWO_GROUPS)
  state, _ = offload.step(offload.init(jax.random.key(0)), placement_batches(1)[0])
  state = offload.settle(state)
  params = jax.device_get(engine_params(offload, state))
  save_placed(tmp_path / "new", offload, state)
  save_placed(tmp_path / "old", steps.StepFunctions(*offload[:5]), state)  # the state as held: format 1's layout
  as_format_1(tmp_path / "old" / "1")
  for name in ("new", "old"):
    got = restore_params(str(tmp_path / name))
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for want, value in zip(jax.tree.leaves(params), jax.tree.leaves(got)):
      np.testing.assert_array_equal(value, want)
    middle = read_params(str(tmp_path / name)).layers(1, 3)
    for want, value in zip(jax.tree.leaves(params["layers"]), jax.tree.leaves(middle), strict=True):
      np.testing.assert_array_equal(value, want[1:3])


def as_format_1(step_dir):
  manifest = step_dir / "state" / "manifest.json"
  stored = json.loads(manifest.read_text())
  manifest.write_text(json.dumps({**stored, "format": 1}))


def engine_params(step_functions, state):
  return step_functions.step.__self__.params(state)  # the offload engine whose step it is


@pytest.mark.slow
def test_a_format_1_engine_checkpoint_is_refused_in_one_line_that_says_what_to_do(tmp_path):
  model = placement_model()
  offload = placed_step(model, TWO_GROUPS)
  save_placed(tmp_path / "checkpoints", steps.StepFunctions(*offload[:5]), offload.init(jax.random.key(0)),
              staging_bytes=ONE_PART_STAGING)
  as_format_1(tmp_path / "checkpoints" / "1")
  with pytest.raises(ValueError) as error:
    check_resumable(str(tmp_path))
  assert str(error.value) == (
      f"checkpoint {tmp_path / 'checkpoints' / '1'} is in sljax's checkpoint format 1, which held the engine's memory "
      f"layout and which this sljax does not resume: finish that run with the sljax that wrote it, or start afresh in "
      f"another --workdir")
  with pytest.raises(CheckpointMismatchError, match=re.escape(str(error.value))):  # a library caller's restore
    restore_placed(tmp_path / "checkpoints", offload, staging_bytes=ONE_PART_STAGING)
