import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sljax.checkpoint import CheckpointCorruptError, Checkpointer, CheckpointMismatchError, abstract_like


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
