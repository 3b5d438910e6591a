"""LLaMA and OPT on small random configs: shapes, jit, remat, causality, loss, layer groups, param counts, presets."""

import dataclasses
import functools
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import presets
from models.config import ModelConfig

from helpers import rel_error


def _llama(seed: int, queries_per_kv_head: int) -> ModelConfig:
  rng = random.Random(seed)
  kv_heads, head_dim = rng.choice([1, 2]), rng.choice([4, 8])
  heads = kv_heads * queries_per_kv_head
  return ModelConfig(
      family="llama", vocab_size=rng.randint(16, 128), hidden_size=heads * head_dim,
      intermediate_size=rng.randint(8, 64), num_layers=rng.randint(2, 4), num_heads=heads, num_kv_heads=kv_heads,
      max_positions=32, norm_eps=rng.choice([1e-5, 1e-6]), rope_theta=10 ** rng.uniform(2, 5),
      dtype="float32", param_dtype="float32", attention="xla")


def _opt(seed: int, layer_norm_before: bool, project: bool) -> ModelConfig:
  rng = random.Random(seed)
  heads, head_dim = rng.choice([2, 3, 4]), rng.choice([4, 8])
  hidden = heads * head_dim
  return ModelConfig(
      family="opt", vocab_size=rng.randint(16, 128), hidden_size=hidden, intermediate_size=rng.randint(8, 64),
      num_layers=rng.randint(2, 4), num_heads=heads, num_kv_heads=heads, max_positions=32,
      word_embed_proj_dim=rng.choice([n for n in range(4, 24) if n != hidden]) if project else 0,
      layer_norm_before=layer_norm_before, dtype="float32", param_dtype="float32", attention="xla")


CONFIGS = {
    "llama-gqa": _llama(0, 2),  # grouped-query attention; plain multi-head is covered by test_hf
    "opt-pre": _opt(1, True, False),
    "opt-350m-shape": _opt(2, False, True),
}
# The first config in the fast tier (-m "not slow"), the others with the slow tests.
FIRST_FAST = [name if n == 0 else pytest.param(name, marks=pytest.mark.slow) for n, name in enumerate(CONFIGS)]


@functools.cache
def _setup(name: str):
  """(model, params, tokens_BxS, batch) for a named config, built once."""
  cfg = CONFIGS[name]
  seed = list(CONFIGS).index(name)
  model = presets.build(cfg)
  params = jax.jit(model.init)(jax.random.key(seed, impl="rbg"))  # rbg: XLA:CPU compiles it faster than threefry
  key_tokens, key_targets, key_weights = jax.random.split(jax.random.key(seed + 100), 3)
  tokens_BxS = jax.random.randint(key_tokens, (2, 11), 0, cfg.vocab_size)
  batch = {
      "inputs": tokens_BxS,
      "targets": jax.random.randint(key_targets, tokens_BxS.shape, 0, cfg.vocab_size),
      "weights": (jax.random.uniform(key_weights, tokens_BxS.shape) < 0.7).astype(jnp.float32).at[0, 0].set(1.0),
  }
  return model, params, tokens_BxS, batch


def _jitted(name: str, **overrides):
  """Compiled forward, loss and value_and_grad(loss) of a named config with overrides, shared across tests (by the
  config they make: test_shapes_and_finite's dtype=float32 is the others' config)."""
  return _jitted_config(dataclasses.replace(CONFIGS[name], **overrides))


@functools.cache
def _jitted_config(cfg: ModelConfig):
  model = presets.build(cfg)
  return jax.jit(model.forward), jax.jit(model.loss), jax.jit(jax.value_and_grad(model.loss))


def _assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=rtol, atol=atol), actual, expected)


def _count(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shapes_and_finite(name, dtype):
  _, params, tokens_BxS, batch = _setup(name)  # float32 params; dtype only sets the compute dtype
  model = presets.build(dataclasses.replace(CONFIGS[name], dtype=dtype))
  forward, loss, _ = _jitted(name, dtype=dtype)
  cfg = model.cfg
  h_BxSxD = jax.eval_shape(model.embed, params["outer"], tokens_BxS)
  assert h_BxSxD.shape == (*tokens_BxS.shape, cfg.hidden_size)
  assert jax.eval_shape(model.layers, params["layers"], h_BxSxD) == jax.ShapeDtypeStruct(h_BxSxD.shape, dtype)
  logits_BxSxV = forward(params, tokens_BxS)
  assert logits_BxSxV.shape == (*tokens_BxS.shape, cfg.vocab_size) and logits_BxSxV.dtype == jnp.dtype(dtype)
  assert jnp.all(jnp.isfinite(logits_BxSxV)) and jnp.isfinite(loss(params, batch))


@pytest.mark.parametrize("name", CONFIGS)
def test_param_count_of_init(name):
  model, params, _, _ = _setup(name)
  cfg = model.cfg
  assert _count(params) == cfg.param_count()
  assert _count(params["outer"]) == cfg.outer_param_count()
  assert _count(jax.tree.map(lambda x: x[0], params["layers"])) == cfg.layer_param_count()


@pytest.mark.parametrize("name", FIRST_FAST)
def test_jit_matches_eager(name):
  model, params, tokens_BxS, batch = _setup(name)
  forward, loss, _ = _jitted(name)
  _assert_trees_close(forward(params, tokens_BxS), model.forward(params, tokens_BxS))
  _assert_trees_close(loss(params, batch), model.loss(params, batch))


@pytest.mark.parametrize("name", FIRST_FAST)
def test_remat_matches_no_remat(name):
  _, params, _, batch = _setup(name)
  assert CONFIGS[name].remat
  loss, grads = _jitted(name)[2](params, batch)
  expected_loss, expected_grads = _jitted(name, remat=False)[2](params, batch)
  _assert_trees_close((loss, grads), (expected_loss, expected_grads))
  assert all(jnp.any(g != 0) for g in jax.tree.leaves(grads["layers"]))


@pytest.mark.parametrize("name, kept_wide, kept_hidden", [("llama-gqa", 2, 2),
                                                          pytest.param("opt-pre", 1, 4, marks=pytest.mark.slow)])
def test_a_layer_keeps_its_matmuls_activations_and_no_norm_or_activation_internals(monkeypatch, name, kept_wide,
                                                                                    kept_hidden):
  """Without remat, a layer's backward keeps, of its [B, S, F]-wide activations, only the matmuls' outputs (LLaMA's
  gate and up, OPT's fc1: SwiGLU's product or ReLU's output, the down projection's input, is recomputed from them), no
  [B, S, D] activation in fp32 (the norms' internals are recomputed from their bf16 input) and no copy of the
  attention's output; its gradient is the one autodiff gives when it keeps everything."""
  cfg = dataclasses.replace(CONFIGS[name], num_layers=1, dtype="bfloat16", remat=False)
  assert cfg.intermediate_size != cfg.hidden_size
  model, (_, params, tokens_BxS, _) = presets.build(cfg), _setup(name)
  layer = jax.tree.map(lambda x: x[:1], params["layers"])
  h_BxSxD = model.embed(params["outer"], tokens_BxS).astype(jnp.bfloat16)
  probe_BxSxD = jax.random.normal(jax.random.key(1), h_BxSxD.shape, jnp.bfloat16)  # a linear loss keeps nothing
  loss = lambda layer, h: jnp.sum((model.layers(layer, h) * probe_BxSxD).astype(jnp.float32))
  # What the backward keeps: the vjp's residuals, of which the [.., S, width] ones are activations (S = 11 is no width).
  kept = [a for a in jax.eval_shape(lambda *args: jax.tree.leaves(jax.vjp(loss, *args)[1]), layer, h_BxSxD)
          if a.ndim >= 3 and a.shape[-2] == tokens_BxS.shape[1]]
  wide = [a for a in kept if a.shape[-1] == cfg.intermediate_size]
  assert len(wide) == kept_wide and all(a.dtype == jnp.bfloat16 for a in wide)
  assert not [a for a in kept if a.dtype == jnp.float32 and a.shape[-2:] == h_BxSxD.shape[-2:]]
  # [B, S, D] (with the layers' axis): the layer's input and the attention's residual sum, and OPT's norms' outputs
  # (LLaMA recomputes them with the norms, as their projections' inputs); the attention's output is kept once, as it
  # left the attention
  assert len([a for a in kept if a.shape[-1] == cfg.hidden_size and a.ndim == 4]) == kept_hidden

  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(layer, h_BxSxD)
  monkeypatch.setattr(nn, "remat", lambda fn, **_: fn)  # autodiff keeps what it likes
  expected = jax.jit(jax.grad(loss, argnums=(0, 1)))(layer, h_BxSxD)
  assert rel_error(grads, expected) <= 1e-2  # bf16's rounding: XLA fuses the recomputed ops differently


@pytest.mark.parametrize("name", CONFIGS)
def test_causal(name):
  model, params, tokens_BxS, _ = _setup(name)
  forward = _jitted(name)[0]
  t = 4

  # Changing the tokens after t leaves the logits up to t bit-identical.
  later_BxS = tokens_BxS.at[:, t + 1:].set((tokens_BxS[:, t + 1:] + 1) % model.cfg.vocab_size)
  np.testing.assert_array_equal(forward(params, later_BxS)[:, :t + 1], forward(params, tokens_BxS)[:, :t + 1])

  # The gradient of the logits at t w.r.t. the embedded inputs is exactly zero after t, and nonzero up to t.
  def logits_at_t(h_BxSxD):
    return model.logits(params["outer"], model.layers(params["layers"], h_BxSxD))[:, t].sum()

  grad_BxSxD = jax.jit(jax.grad(logits_at_t))(model.embed(params["outer"], tokens_BxS))
  assert jnp.all(grad_BxSxD[:, t + 1:] == 0)
  assert jnp.all(jnp.any(grad_BxSxD[:, :t + 1] != 0, axis=-1))


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_is_mean_cross_entropy_of_forward(name):
  _, params, tokens_BxS, batch = _setup(name)
  forward, loss, _ = _jitted(name)
  log_probs_BxSxV = jax.nn.log_softmax(forward(params, tokens_BxS))
  losses_BxS = -jnp.take_along_axis(log_probs_BxSxV, batch["targets"][..., None], axis=-1)[..., 0]
  expected = jnp.sum(losses_BxS * batch["weights"]) / jnp.sum(batch["weights"])
  np.testing.assert_allclose(loss(params, batch), expected, rtol=1e-6)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_groups_compose(name):
  model, params, tokens_BxS, _ = _setup(name)
  layers = jax.jit(model.layers)
  h_BxSxD = model.embed(params["outer"], tokens_BxS)
  all_at_once_BxSxD = layers(params["layers"], h_BxSxD)
  for i in range(1, model.cfg.num_layers):
    first = jax.tree.map(lambda x: x[:i], params["layers"])
    rest = jax.tree.map(lambda x: x[i:], params["layers"])
    _assert_trees_close(layers(rest, layers(first, h_BxSxD)), all_at_once_BxSxD)


def test_param_count_of_presets():
  published = {"llama7b": 6_738_415_616, "opt-125m": 125_239_296, "opt-350m": 331_196_416}  # Hugging Face counts
  for name, cfg in presets.PRESETS.items():
    shapes = jax.eval_shape(presets.build(cfg).init, jax.random.key(0))  # init's exact tree, nothing allocated
    assert _count(shapes) == cfg.param_count(), name
    assert cfg.param_count() == published.get(name, cfg.param_count()), name


def test_get_config():
  cfg = presets.get_config("llama-tiny", ["num_layers=2", "remat=false", "dtype=float32"])
  assert (cfg.num_layers, cfg.remat, cfg.dtype) == (2, False, "float32")
  assert presets.get_config("opt-350m", {"num_layers": 3}).num_layers == 3
  with pytest.raises(ValueError, match="unknown model 'llama-8t'"):
    presets.get_config("llama-8t")
  with pytest.raises(ValueError, match="unknown model field 'num_layer'"):
    presets.get_config("llama-tiny", ["num_layer=2"])
  with pytest.raises(ValueError, match="wants a int"):
    presets.get_config("llama-tiny", ["num_layers=two"])
