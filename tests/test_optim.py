import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sljax.optim import OptimConfig, learning_rate_schedule, make_optimizer


def test_schedule_warms_up_then_decays_to_the_floor():
  schedule = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1))
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10), schedule(60), schedule(110), schedule(500)],
                             [0.0, 0.5, 1.0, 0.55, 0.1, 0.1], atol=1e-6)


def test_linear_decay_falls_in_a_straight_line_to_the_floor():
  schedule = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1,
                                                decay_shape="linear"))
  np.testing.assert_allclose([schedule(10), schedule(35), schedule(60), schedule(110), schedule(500)],
                             [1.0, 0.775, 0.55, 0.1, 0.1], atol=1e-6)


@pytest.mark.parametrize("warmup_steps", [0, 5])
def test_no_decay_keeps_the_peak_after_warmup(warmup_steps):
  schedule = learning_rate_schedule(OptimConfig(learning_rate=2.0, warmup_steps=warmup_steps))
  assert float(schedule(warmup_steps)) == 2.0 and float(schedule(10_000)) == 2.0


def test_first_moment_dtype():
  state = make_optimizer(OptimConfig(moments_dtype="bfloat16")).init({"w": jnp.ones(4)})
  adam = next(s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu"))
  assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.float32


@pytest.mark.parametrize("grad_clip_norm, step", [(0.0, -1.0), (1.0, -1 / 3)])
def test_clipping_comes_before_adam(grad_clip_norm, step):
  # Adam's first update is lr * g / (|g| + eps): with eps = 1 it shows whether g was clipped to norm 1 (0.5 each).
  cfg = OptimConfig(learning_rate=1.0, warmup_steps=0, weight_decay=0.0, eps=1.0, grad_clip_norm=grad_clip_norm)
  optimizer, params = make_optimizer(cfg), {"w": jnp.ones(4)}
  updates, _ = optimizer.update({"w": jnp.full(4, 1e6)}, optimizer.init(params), params)
  np.testing.assert_allclose(updates["w"], step, rtol=1e-5)


@pytest.mark.parametrize("field, value", [
    ("learning_rate", 0.0), ("learning_rate", float("nan")), ("learning_rate", float("inf")), ("warmup_steps", -1),
    ("min_lr_ratio", 2.0), ("min_lr_ratio", float("nan")), ("grad_clip_norm", -1.0), ("grad_clip_norm", float("inf")),
    ("b1", 1.0), ("b2", -0.1), ("b2", float("nan")), ("eps", float("nan")), ("weight_decay", -0.1),
    ("decay_shape", "exponential"), ("moments_dtype", "float7"), ("moments_dtype", "int8")])
def test_bad_values_raise(field, value):
  with pytest.raises(ValueError):
    OptimConfig(**{field: value})
