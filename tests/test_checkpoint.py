import errno
import glob
import json
import os
import shutil
import subprocess
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sljax.checkpoint import (CheckpointCorruptError, Checkpointer, CheckpointMismatchError, CheckpointWriteError,
                              DiskSpaceError, StateHandler, abstract_like, check_disk)
from sljax.memory import PeakResident


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
def test_save_and_restore_stay_within_the_staging_budget_on_a_state_many_times_larger(tmp_path):
  budget = 32 * 2**20
  # A process's first save starts orbax's and tensorstore's thread pools and caches (~100 MiB, whatever the state's
  # size): done on a small state first, so that what is measured is the staging.
  Checkpointer(str(tmp_path / "warm"), save_every=1).save(1, offload_placed_state(leaves=2, leaf_mib=1), {})
  state = offload_placed_state(leaves=48, leaf_mib=8)  # 384 MiB: 12 budgets
  checkpointer = Checkpointer(str(tmp_path / "run"), save_every=1, staging_bytes=budget)
  with PeakResident(0.001) as saving:
    checkpointer.save(1, state, {})
  target = abstract_like(state)
  del state
  with PeakResident(0.001) as restoring:
    _, restored, _ = checkpointer.restore_latest(target)
    restored = jax.block_until_ready(restored)
  # Staging the whole state at once, as orbax alone does, would cost 384-768 MiB. Restoring allocates the state itself
  # (384 MiB); above that only the staging. Threads and allocator caches add noise: 3 budgets.
  assert saving.extra < 3 * budget, saving.extra / 2**20
  assert restoring.extra - 384 * 2**20 < 3 * budget, restoring.extra / 2**20
  assert len(glob.glob(str(tmp_path / "run" / "1" / "state" / "part_*"))) >= 12 * 4 - 4
  np.testing.assert_array_equal(np.asarray(restored["host"][3]), np.full(2**21, 3, np.float32))
  assert restored["host"][3].sharding.memory_kind == "pinned_host"


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
