import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sljax.checkpoint import Checkpointer, abstract_like


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


@pytest.mark.parametrize("change", ["shape", "structure"])
def test_mismatched_state_raises_value_error_naming_the_directory(tmp_path, change):
  state = make_state()
  checkpointer = Checkpointer(str(tmp_path), save_every=1)
  checkpointer.save(1, state, {})
  checkpointer.close()
  other = make_state()
  if change == "shape":
    other["params"]["w"] = jnp.zeros((3, 3))
  else:
    other["params"]["extra"] = jnp.zeros(3)
  with pytest.raises(ValueError, match=str(tmp_path)) as error:
    Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract_like(other))
  assert "\n" not in str(error.value)
