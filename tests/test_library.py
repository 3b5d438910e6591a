"""sljax as a library: a model of one's own (examples/own_model.py, plain jax.numpy) trains as plain jax.grad + optax
on the full batch does, plans, and generates; a model short of the contract is one error naming what it lacks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sljax
from examples.own_model import GPT, GPTConfig, random_batch
from sljax.generate import OffloadConfig, OffloadedGenerator, SamplingConfig, generate_on_device
from sljax.generate_plan import generation_sizes, plan

from helpers import flat, reference_steps

HUGE = sljax.Budget(device_bytes=1 << 50, host_bytes=1 << 50)
MODEL = GPT(GPTConfig(vocab_size=64, hidden_size=32, num_heads=2, num_layers=3, max_positions=32))


@functools.cache
def params_of(outer_seed: int, layers_seed: int) -> dict:
  """The model's params from two seeds, jitted once (op by op, its init compiled a kernel per operation and shape)."""
  init = jax.jit(lambda outer_key, layers_key: {"outer": MODEL.init_outer(outer_key),
                                                "layers": MODEL.init_layers(jax.random.split(layers_key, 3))})
  return init(jax.random.key(outer_seed), jax.random.key(layers_seed))


def engine_steps(optimizer, params, batches, **engine_cfg):
  engine = sljax.Engine(MODEL, optimizer, sljax.EngineConfig(**engine_cfg))
  state, losses = engine.from_params(params), []
  for batch in batches:
    state, loss = engine.step(state, batch)
    losses.append(float(loss))
  return losses, engine.params(state)


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(0)
  batches = [random_batch(rng, 8, 16, MODEL.cfg.vocab_size) for _ in range(3)]
  for batch in batches:
    batch["weights"] = (rng.random(batch["weights"].shape) > 0.3).astype(np.float32)
  params = params_of(1, 2)
  return params["outer"], params["layers"], batches


def test_own_model_trains_as_plain_jax_grad_on_the_full_batch(setup):
  outer, layers, batches = setup
  params = {"outer": outer, "layers": layers}
  split = dict(sub_batches=2, live_layers=2, activations_on_host=True, device_state_groups=1)
  # SGD with learning rate 1: params - update is the gradient, compared directly.
  want_losses, want = reference_steps(MODEL, optax.sgd(1.0), 0.0, params, batches[:1])  # plain jax.grad + optax
  got_losses, got = engine_steps(optax.sgd(1.0), params, batches[:1], **split)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
  grads = lambda new: flat(params) - flat(new)
  assert np.linalg.norm(grads(got) - grads(want)) <= 1e-5 * np.linalg.norm(grads(want))
  # AdamW over 3 steps, elementwise: an eps of 1e-3 keeps the update Lipschitz in the gradient (|d update / d g| <=
  # lr / eps), so rounding-sized gradient differences stay rounding-sized in the params.
  adamw = optax.adamw(1e-2, eps=1e-3, weight_decay=0.1)
  want_losses, want = reference_steps(MODEL, adamw, 0.0, params, batches)
  got_losses, got = engine_steps(adamw, params, batches, **split)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
  np.testing.assert_allclose(flat(got), flat(want), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_own_model_plans_from_its_shapes():
  sizes = sljax.model_sizes(MODEL)
  layer = jax.eval_shape(MODEL.init_layers, jax.random.split(jax.random.key(0), 1))
  d, f = 32, 128
  assert sizes.layer_params == 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
  assert sizes.layer_params == sum(x.size for x in jax.tree.leaves(layer))
  assert sizes.outer_params == (64 + 32) * d + 2 * d and sizes.hidden == d
  assert sizes.kv_bytes_per_token == 2 * d * 4  # k and v, fp32
  plan = sljax.make_plan(MODEL, 16, 8, HUGE, sub_batches=2)
  assert plan.engine.sub_batches == 2 and plan.device_bytes["resident group state"] == 3 * sizes.layer_params * (4 + 8)  # master + AdamW


@pytest.mark.slow
def test_own_model_generates_as_the_plain_loop():
  params = params_of(3, 4)
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  sampling = SamplingConfig(max_new_tokens=4)
  want = generate_on_device(MODEL, params, prompts, sampling)
  generator = OffloadedGenerator(MODEL, OffloadConfig(sub_batches=2, live_layers=2, resident_layers=1))
  got = generator.generate(generator.load(jax.tree.map(np.asarray, params)), prompts, sampling)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  # The first token is the argmax of the full forward pass's last logits (the cache changes nothing).
  tokens = jnp.asarray([prompts[0]])
  logits = MODEL.logits(params["outer"], MODEL.layers(params["layers"], MODEL.embed(params["outer"], tokens)))
  assert want.tokens[0, 0] == int(jnp.argmax(logits[0, -1]))


class _NoHead:
  cfg = GPTConfig()
  init_outer, init_layers, embed, layers = GPT.init_outer, GPT.init_layers, GPT.embed, GPT.layers


class _Trains(_NoHead):  # trains, but cannot generate
  cfg = type("TrainingConfig", (), {"num_layers": 2, "dtype": "float32", "param_dtype": "float32"})()
  head_loss = GPT.head_loss


def test_a_model_short_of_the_contract_is_one_error_naming_what_it_lacks():
  with pytest.raises(TypeError, match=r"^model\.head_loss missing: _NoHead is not a models\.common\.TrainingModel"):
    sljax.Engine(_NoHead(), optax.sgd(1.0), sljax.EngineConfig())
  with pytest.raises(TypeError, match=r"^model\.head_loss missing"):
    sljax.make_plan(_NoHead(), 8, 4, HUGE)
  with pytest.raises(TypeError, match=r"^model\.cfg\.max_positions, model\.init_cache, model\.layers_cached, "
                                      r"model\.logits missing: .* not a models\.common\.GenerationModel"):
    OffloadedGenerator(_Trains(), OffloadConfig())
  no_layers = type("NoLayers", (), {"cfg": GPTConfig(), "embed": lambda self, tokens: tokens})
  with pytest.raises(TypeError, match=r"^model\.init_outer, model\.init_layers, model\.embed taking 2 positional "
                                      r"arguments, model\.layers, model\.head_loss missing"):
    sljax.Engine(no_layers(), optax.sgd(1.0), sljax.EngineConfig())


def test_params_are_the_callers_after_later_steps(setup):
  outer, layers, batches = setup
  engine = sljax.Engine(MODEL, optax.adamw(1e-3), sljax.EngineConfig(sub_batches=2, live_layers=3))  # one group
  state = engine.from_params({"outer": outer, "layers": layers})
  before = engine.params(state)
  kept = jax.tree.map(np.array, before)
  state, _ = engine.step(state, batches[0])  # consumes (donates) the state params were taken from
  state, _ = engine.step(state, batches[1])
  for got, want in zip(jax.tree.leaves(before), jax.tree.leaves(kept)):
    np.testing.assert_array_equal(np.asarray(got), want)


def test_loss_is_the_weighted_mean(setup):
  """sum(w l) / sum(w): scaling every weight changes nothing (dividing by max(sum(w), 1) did for sum(w) < 1), and a
  batch with no weight has loss 0."""
  outer, layers, batches = setup
  params = {"outer": outer, "layers": layers}
  engine = sljax.Engine(MODEL, optax.sgd(0.0), sljax.EngineConfig(sub_batches=2, live_layers=2))
  losses = {}
  for scale in (1.0, 0.01, 0.0):
    batch = dict(batches[0], weights=batches[0]["weights"] * np.float32(scale))
    _, losses[scale] = engine.step(engine.from_params(params), batch)
  h = MODEL.layers(layers, MODEL.embed(outer, batches[0]["inputs"]))
  token_losses = optax.softmax_cross_entropy_with_integer_labels(MODEL.logits(outer, h), batches[0]["targets"])
  weights = batches[0]["weights"]
  np.testing.assert_allclose(float(losses[1.0]), float(jnp.sum(token_losses * weights) / weights.sum()), rtol=1e-6)
  np.testing.assert_allclose(float(losses[0.01]), float(losses[1.0]), rtol=1e-6)
  assert float(losses[0.0]) == 0.0


def test_own_model_plans_its_generation_from_its_shapes():
  """The generation planner reads a model of the contract as it reads the presets: weights, cache, the attention
  scores' and the MLP's widths from the params' shapes and one traced layer, no config field beyond the contract's."""
  sizes = generation_sizes(MODEL)
  d, f, heads = 32, 128, 2  # the GPT's MLP is 4 x d wide
  assert (sizes.hidden, sizes.ffn, sizes.heads) == (d, f, heads)
  assert sizes.layer_params == sljax.model_sizes(MODEL).layer_params and sizes.kv_bytes_per_token == 2 * d * 4
  assert sizes.head_flops_per_token == 2 * 64 * d  # tied head: vocab x width
  chosen = plan(MODEL, 8, 4, 1 << 40, 1 << 40, batch=2)
  assert chosen.offload.resident_layers == 3 and "3 of 3 layers resident" in chosen.describe(MODEL)
  prompts, sampling = [[1, 2, 3], [4, 5]], SamplingConfig(max_new_tokens=4)
  params = params_of(3, 4)
  generator = OffloadedGenerator(MODEL, chosen.offload)
  got = generator.generate(generator.load(jax.tree.map(np.asarray, params)), prompts, sampling)
  np.testing.assert_array_equal(got.tokens, generate_on_device(MODEL, params, prompts, sampling).tokens)
