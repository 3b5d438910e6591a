"""LoRA: an engine step of the adapters equals a plain full-batch jax.grad + optax step of them; the base never
changes; adapters start as the identity and merge into the kernels."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.presets import build, get_config
import sljax.lora.engine
import sljax.lora.plan
from sljax.checkpoint import Checkpointer
from sljax.lora.checkpoint import MergedWeights, RandomBase, restore_view
from sljax.lora.engine import LoraEngine, LoraEngineConfig, lora_flops_per_token, lora_layer_flops
from sljax.lora.model import LoraConfig, LoraModel, join_adapters, merge, split_adapters
from sljax.footprint import GPU_MARGIN_BYTES, MARGIN, SCRATCH
from sljax.lora.plan import STREAMED_IN_FLIGHT, held_layer_bytes, plan_lora
from sljax.machines import GIB, H200, Budget
from sljax.memory import HOST, InFlight, Placement, tree_bytes
from sljax.mesh import make_mesh
from sljax.quant import QuantConfig, dequantize_layers, quantize_layers
from sljax.sizes import model_sizes

from helpers import (benchmark_smoke, flat, has_provenance, in_layer_groups, inputs_fetched_one_call_ahead, make_batch,
                     optimizer_step, record_calls, rel_error)

SHAPES = {  # few shapes, so examples reuse compiled calls; values, placement, rank scale and optimizer vary freely
    "llama": dict(family="llama", num_heads=4, num_kv_heads=2, hidden_size=32, intermediate_size=40, num_layers=4),
    "opt": dict(family="opt", num_heads=2, hidden_size=16, intermediate_size=24, num_layers=3),
}
TARGETS = {"llama": ("q_proj", "v_proj", "down_proj"), "opt": ()}  # some projections; every one


@functools.cache
def _model(family: str, rank: int, dtype: str = "float32", num_layers: int | None = None,
           base_bits: int = 0) -> LoraModel:
  shape = dict(SHAPES[family], num_layers=num_layers or SHAPES[family]["num_layers"])
  base = build(get_config("llama-tiny", dict(shape, dtype=dtype, remat=False)))
  return LoraModel(base, LoraConfig(rank=rank, alpha=2.0 * rank, targets=TARGETS[family], base_bits=base_bits))


@functools.cache  # one object per optimizer: its engines and reference steps share their compiled updates
def _optimizer(name: str, clip: float):
  # sgd at 0.1: at 1.0 the second step's tiny gradients (at a point one large step away) differ by fp32 rounding
  # alone, by up to 5e-5 relative, even with one sub-batch, where the engine computes exactly the plain step's math.
  # adamw's eps at 1e-4: adam moves an adapter whose gradient g is near eps by lr x g / (|g| + eps), so the sub-batch
  # sum's rounding of g (up to ~2e-8 here, where gradients are ~4e-3) becomes lr x 2e-8 / eps of a step. At optax's
  # 1e-8 one adapter of 2,496 (g = -1.7e-8; opt, 2 sub-batches, seed 30786) moved 1.4e-3 apart, a 1e-4 relative
  # difference in the adapters where SGD's agree to 2e-8; at 1e-4 that is at most 2e-6, and the update still
  # divides by sqrt(v) for nearly every adapter.
  tx = optax.sgd(0.1) if name == "sgd" else optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx


@functools.cache
def _init_base(model):
  """The base model's init, jitted once per model."""
  return jax.jit(model.base.init)


@functools.partial(jax.jit, static_argnums=0)
def _random_adapters(model, base_layers, seed):
  """Adapters with both factors random (a fresh lora_b is zero, which would leave lora_a's gradient zero)."""
  adapters = model.init_adapters(jax.random.key(seed), base_layers)
  keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(adapters))))
  return jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)


@functools.cache
def _value_and_grad(model):
  """The loss's value and gradient in the adapters, jitted once per model (the base is an argument, not a constant)."""
  return jax.jit(jax.value_and_grad(lambda adapters, base, batch: model.loss(
      {"outer": base["outer"], "layers": join_adapters(base["layers"], adapters)}, batch)))


def _reference(model, optimizer, base, adapters, batches):
  """Plain training of the adapters: jax.grad of the whole model's loss, then optax, on the full batch. Returns the
  steps' losses, the adapters after them and the gradient of each step."""
  init, update = optimizer_step(optimizer)
  opt_state, losses, gradients = init(adapters), [], []
  for batch in batches:
    loss, grads = _value_and_grad(model)(adapters, base, batch)
    adapters, opt_state = update(grads, opt_state, adapters)
    losses.append(float(loss))
    gradients.append(grads)
  return losses, adapters, gradients


# (family, sub-batches, layers per group): few compiled shapes, so examples reuse them; what compiles nothing new
# (values, resident layers, stash placement, optimizer, clipping) varies freely.
SCHEDULES = [("llama", 4, 2), ("opt", 2, 1), ("llama", 1, 1)]


@st.composite
def cases(draw):
  family, sub_batches, live_layers = draw(st.sampled_from(SCHEDULES))
  layers = SHAPES[family]["num_layers"]
  resident = draw(st.integers(0, layers))
  cfg = LoraEngineConfig(sub_batches=sub_batches, live_layers=live_layers, resident_layers=resident,
                         activations_on_host=draw(st.booleans()),
                         tail_layers=draw(st.sampled_from([0, min(2, resident)])))
  return family, cfg, draw(st.sampled_from(["sgd", "adamw"])), draw(st.sampled_from([0.0, 0.05])), draw(
      st.integers(0, 2**16))


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_engine_lora_steps_equal_plain_lora_steps_and_leave_the_base_alone(case):
  family, cfg, optimizer_name, clip, seed = case
  model = _model(family, rank=4)
  optimizer = _optimizer(optimizer_name, clip)
  rng = np.random.default_rng(seed)
  base_model_params = _init_base(model)(jax.random.key(seed))
  engine = LoraEngine(model, optimizer, cfg)
  engine.load_base(base_model_params)
  base = engine.base_params()
  adapters = _random_adapters(model, base["layers"], seed)
  batches = [make_batch(rng, 8, 8) for _ in range(2)]
  want_losses, want_adapters, _ = _reference(model, optimizer, base, adapters, batches)

  state, got_losses = _steps(engine, adapters, batches)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  assert rel_error(engine.adapters(state), want_adapters) <= 1e-5
  if optimizer_name == "sgd" and not clip:  # the update is exactly -0.1 x the gradients
    got = flat(jax.tree.map(np.subtract, adapters, engine.adapters(state)))
    want = flat(jax.tree.map(np.subtract, adapters, want_adapters))
    # Read back from fp32 adapters ~500x its size, the update carries each side's rounding of them (up to half a
    # spacing per value), which alone can exceed 1e-5 of it.
    rounding = np.linalg.norm(np.spacing(flat(want_adapters).astype(np.float32)))
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want) + rounding
  assert int(state["step"]) == 2
  jax.tree.map(np.testing.assert_array_equal, engine.base_params(), base)  # bit for bit
  for g, group in enumerate(engine.base["groups"]):
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(group)}
    assert kinds == ({"device"} if engine.resident[g] else {HOST})


def _steps(engine, adapters, batches) -> tuple[dict, list[float]]:
  """The engine's state after a step on each batch from `adapters`, and the steps' losses."""
  state, losses = engine.from_adapters(adapters), []
  for batch in batches:
    state, loss = engine.step(state, batch)
    losses.append(float(loss))
  return state, losses


@pytest.mark.slow
@pytest.mark.parametrize("bits, cfg", [(4, LoraEngineConfig(sub_batches=4, live_layers=2, resident_layers=2)),
                                       (8, LoraEngineConfig(sub_batches=2, resident_layers=3, tail_layers=2))])
def test_steps_on_a_quantized_base_equal_plain_lora_steps_on_the_dequantized_base(bits, cfg):
  """--base_bits: the base is quantized once as it loads (sljax.quant, a group at a time, resident and streamed
  alike) and never changes; each step is the plain jax.grad step of the adapters on the dequantized base (fp32),
  with a residual-keeping tail too."""
  model, plain = _model("llama", rank=4, base_bits=bits), _model("llama", rank=4)
  optimizer = _optimizer("adamw", 0.05)
  params = _init_base(model)(jax.random.key(bits))
  engine = LoraEngine(model, optimizer, cfg)
  engine.load_base(params)
  base = engine.base_params()
  want_base = quantize_layers(params["layers"], QuantConfig(bits=bits))  # generation's quantizer, all layers at once
  jax.tree.map(np.testing.assert_array_equal, base["layers"], jax.tree.map(np.asarray, want_base))
  assert {x.dtype for x in jax.tree.leaves(base["layers"]["q_proj"])} == {jnp.dtype(f"int{bits}"),
                                                                          jnp.dtype("float16")}
  dequantized = {"outer": base["outer"], "layers": dequantize_layers(base["layers"], jnp.float32)}
  adapters = _random_adapters(model, dequantized["layers"], bits)
  rng = np.random.default_rng(bits)
  batches = [make_batch(rng, 8, 8) for _ in range(2)]
  want_losses, want_adapters, _ = _reference(plain, optimizer, dequantized, adapters, batches)
  state, got_losses = _steps(engine, adapters, batches)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  assert rel_error(engine.adapters(state), want_adapters) <= 1e-5
  assert abs(float(engine.eval_loss(state, batches[0])) - float(jax.jit(plain.loss)(
      {"outer": base["outer"], "layers": join_adapters(dequantized["layers"], engine.adapters(state))},
      batches[0]))) <= 1e-6 * want_losses[0]
  jax.tree.map(np.testing.assert_array_equal, engine.base_params(), base)  # bit for bit
  # The step ran on the codes: the same step on the unquantized base ends elsewhere, ten times further than the
  # tolerance above at least (int8: 5.5e-4).
  assert rel_error(engine.adapters(state), _reference(plain, optimizer, params, adapters, batches)[1]) > 1e-4


def _recording_gradients(engine) -> list:
  """The gradient each of the engine's steps hands its optimizer, stacked over all layers (numpy), recorded as it
  steps; each checked whole and the same on every device of the engine's mesh."""
  gradients, update = [], engine._update

  def record(adapters, opt_state, grads, loss):
    for x in jax.tree.leaves(grads):
      first, *others = (np.asarray(shard.data) for shard in x.addressable_shards)
      assert x.sharding.is_fully_replicated and len(others) == engine.place.mesh.size - 1
      for other in others:
        np.testing.assert_array_equal(other, first)
    gradients.append(jax.tree.map(np.asarray, grads))
    return update(adapters, opt_state, grads, loss)

  engine._update = record
  return gradients


@pytest.mark.slow
@pytest.mark.parametrize("bits, optimizer_name, clip, meshes", [
    (0, "sgd", 0.0, (2, 4)), (4, "adamw", 0.05, (2,))])
def test_lora_steps_over_a_data_mesh_are_one_devices_and_the_plain_steps(bits, optimizer_name, clip, meshes):
  """Data parallel (--mesh=data:N): every device holds the whole base and adapters and runs its rows of each
  sub-batch; the adapters' gradient is all-reduced once. Two steps with a streamed group, the stash in pinned
  host memory, 2 sub-batches and a residual-keeping tail, on an unquantized and an int4 base: the losses, the gradient
  the optimizer takes (whole, the same on every device) and the adapters after them are one device's and the plain
  jax.grad + optax steps' on the full batch (fp32, 1e-5); a mesh's second step compiles nothing, and its devices
  exchange the all-reduces' bytes. Without the all-reduce, the optimizer would take device 0's part of the gradient:
  far from the whole batch's."""
  model, plain = _model("llama", rank=4, base_bits=bits), _model("llama", rank=4)
  optimizer, cfg = _optimizer(optimizer_name, clip), LoraEngineConfig(sub_batches=2, resident_layers=3, tail_layers=2)
  params = _init_base(model)(jax.random.key(bits))
  rng = np.random.default_rng(bits)
  batches = [make_batch(rng, 8, 8) for _ in range(2)]
  runs, compiles = {}, []
  count = lambda event, seconds, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
  for devices in (1, *meshes):
    engine = LoraEngine(model, optimizer, cfg, Placement(make_mesh({"data": devices})))
    engine.load_base(params)
    if devices == 1:
      base = engine.base_params()
      dequantized = {"outer": base["outer"], "layers": dequantize_layers(base["layers"], jnp.float32)}
      adapters = _random_adapters(model, dequantized["layers"], bits)
    assert not all(engine.resident)  # a group streams from pinned host memory
    gradients = _recording_gradients(engine)
    state, losses = _steps(engine, adapters, batches[:1])
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
      state, loss = engine.step(state, batches[1])
    finally:
      jax.monitoring.unregister_event_duration_listener(count)
    runs[devices] = losses + [float(loss)], gradients, engine.adapters(state)
    jax.tree.map(np.testing.assert_array_equal, engine.base_params(), base)
    grad_bytes = sum(x.nbytes for x in jax.tree.leaves(gradients[0])) + 4  # the loss too
    assert engine.place.moved["between_devices"] == 2 * 2 * (devices - 1) * grad_bytes  # 2 steps, ring all-reduces
  assert compiles == []
  want_losses, want_adapters, want_gradients = _reference(plain, optimizer, dequantized, adapters, batches)
  for devices, (losses, gradients, got_adapters) in runs.items():
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(losses, runs[1][0], rtol=1e-5)
    for got, one, want in zip(gradients, runs[1][1], want_gradients, strict=True):
      assert rel_error(got, want) <= 1e-5 and rel_error(got, one) <= 1e-5, devices
    assert rel_error(got_adapters, want_adapters) <= 1e-5 and rel_error(got_adapters, runs[1][2]) <= 1e-5, devices

  # The same mesh engine with each device's slot left unsummed: device 0's part of the gradient, a test that would
  # pass it would pass an engine that never reduces.
  object.__setattr__(engine.place, "reduce", lambda per_device, sharded=True: engine.place.to_device(
      jax.tree.map(lambda x: np.asarray(x)[0], per_device)))
  _steps(engine, adapters, batches[:1])
  assert rel_error(gradients[-1], want_gradients[0]) > 0.1


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.slow
def test_a_checkpoint_of_adapters_in_layer_groups_restores_stacked_under_other_groups(tmp_path):
  """Format 1, as the engine once held its state: the adapters and their optimizer state a list of layer groups (of
  1 and 3 layers here). It restores joined into the stacks of an engine grouped otherwise (2, 1, 1 layers), the
  state saved bit for bit, and the step after it is the step after the state never saved."""
  model, optimizer = _model("llama", rank=4), _optimizer("adamw", 0.05)
  engine = LoraEngine(model, optimizer, LoraEngineConfig(sub_batches=2, live_layers=2, resident_layers=4,
                                                         tail_layers=1))
  assert [b - a for a, b in engine.groups] == [2, 1, 1]
  engine.init_base(jax.random.key(0))
  rng = np.random.default_rng(0)
  state, _ = engine.step(engine.init(jax.random.key(1)), make_batch(rng, 4, 8))
  saved, batch = in_layer_groups(state, [1, 3]), make_batch(rng, 4, 8)
  assert len(saved["adapters"]) == 2 and jax.tree.leaves(saved["adapters"][1])[0].shape[0] == 3
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), save_every=0)
  checkpointer.save(1, saved, {"lora": {"rank": 4}}, force=True)  # no lora.format: format 1
  target = restore_view(str(tmp_path), engine.abstract(jax.random.key(1)))
  step, restored, _ = checkpointer.restore_latest(target)
  checkpointer.close()
  assert step == 1 and jax.tree.structure(restored) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  assert {x.sharding for x in jax.tree.leaves(restored)} == {x.sharding for x in jax.tree.leaves(state)}
  want, want_loss = engine.step(_copy(state), batch)
  got, got_loss = engine.step(restored, batch)
  assert float(got_loss) == float(want_loss)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_an_unknown_adapter_layout_or_layer_groups_of_another_model_are_refused_in_one_line(tmp_path):
  model = _model("opt", rank=2)
  engine = LoraEngine(model, optax.adamw(1e-3), LoraEngineConfig())
  state = engine.abstract(jax.random.key(0))
  for name, lora, saved in [("unknown", {"rank": 2, "format": 3}, {"step": np.int32(0)}),
                            ("short", {"rank": 2}, in_layer_groups(engine.init(jax.random.key(0)), [1, 1]))]:
    checkpointer = Checkpointer(str(tmp_path / name / "checkpoints"), save_every=0)
    checkpointer.save(1, saved, {"lora": lora}, force=True)
    checkpointer.close()
    step_dir = str(tmp_path / name / "checkpoints" / "1")
    with pytest.raises(ValueError) as info:
      restore_view(str(tmp_path / name), state)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"checkpoint {step_dir} holds LoRA adapters ")
    assert ("in layout 3 (its metadata's lora.format), which this sljax does not read (it reads 1 and 2)"
            if name == "unknown" else "of 2 layers in all, and this run's model has 3") in str(info.value)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_the_state_holds_two_arrays_a_projection_whatever_the_layers_and_groups(family):
  """The adapters, their optimizer state and the update the step compiles are laid out by projection, not by layer
  or group: a model 16 times deeper in 16 times more groups has the same state leaves, and the same update program
  (its HLO: the same operations, on longer arrays), whose compile time then does not grow with the depth."""
  projections = len(TARGETS[family]) or {"llama": 7, "opt": 6}[family]
  shapes = []
  for layers in (2, 32):
    model = _model(family, rank=2, num_layers=layers)
    engine = LoraEngine(model, _optimizer("adamw", 0.05), LoraEngineConfig(live_layers=1))
    assert len(engine.groups) == layers
    state = engine.abstract(jax.random.key(0))
    assert len(jax.tree.leaves(state["adapters"])) == 2 * projections
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state["adapters"])
    loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=engine.place.device())
    program = engine._update.lower(state["adapters"], state["opt"], grads, loss).as_text()
    shapes.append((len(jax.tree.leaves(state)), re.sub(r"tensor<[^>]*>", "tensor", program)))
  assert shapes[0] == shapes[1]


@pytest.mark.slow
def test_a_plan_keeps_more_of_a_quantized_base_resident():
  """The plan sizes a layer as the engine holds it (int4 codes and scales: a sixth of an fp32 layer here), so a
  device too small for the whole fp32 base holds the whole int4 one."""
  int4_model, fp32_model = (_model("llama", rank=2, num_layers=8, base_bits=bits) for bits in (4, 0))
  roomy = plan_lora(fp32_model, 8, Budget(GIB, GIB), batch=4, tail_layers=0)
  layer = roomy.device_bytes["resident base layers"] // 8
  budget = Budget(sum(roomy.device_bytes.values()) - 4 * layer, GIB)
  fp32, int4 = (plan_lora(model, 8, budget, batch=4, tail_layers=0) for model in (fp32_model, int4_model))
  assert fp32.engine.resident_layers < 8 == int4.engine.resident_layers
  assert int4.device_bytes["resident base layers"] == 8 * held_layer_bytes(int4_model) < 8 * layer / 6
  assert "int4 codes with scales" in int4.describe() and "codes" not in fp32.describe()


@pytest.mark.slow
def test_a_plan_with_the_whole_base_resident_keeps_residuals_in_the_longest_tail_that_fits():
  """Device memory left once the whole base is resident goes to a tail whose layers are not recomputed: all of them
  where it holds them (no stash, a backward of input gradients alone), else as many as fit, not one more."""
  model = _model("llama", rank=2, num_layers=8)
  none = plan_lora(model, 8, Budget(GIB, GIB), batch=4, tail_layers=0)
  whole = plan_lora(model, 8, Budget(GIB, GIB), batch=4)
  assert none.last_layers == 1 and whole.engine.tail_layers == whole.last_layers == 8
  assert whole.device_bytes["stashed activations"] == 0
  # The tail's backward runs each layer's gradients alone; a recomputing one runs 7 forwards again beside them.
  layer, forward = lora_layer_flops(model, 8), none.phases["forward"].compute_seconds
  gradients = forward * layer.backward / layer.forward
  assert whole.phases["backward"].compute_seconds == pytest.approx(gradients)
  assert none.phases["backward"].compute_seconds == pytest.approx(gradients + forward * 7 / 8)
  budget = Budget((none.footprint.device_bytes + whole.footprint.device_bytes) // 2, GIB)
  part = plan_lora(model, 8, budget, batch=4)
  assert 1 < part.engine.tail_layers < 8 and part.engine.resident_layers == 8 and part.footprint.fits(budget)
  assert "the last {} layers one group that keeps its residuals".format(part.engine.tail_layers) in part.describe()
  with pytest.raises(ValueError, match=f"with a tail of {part.engine.tail_layers + 1} layers"):
    plan_lora(model, 8, budget, batch=4, tail_layers=part.engine.tail_layers + 1)


def test_a_tail_layer_on_an_int4_base_keeps_no_more_residuals_than_on_the_bf16_one():
  """The tail's backward dequantizes the base again: its dequantized kernels are not residuals kept per layer."""
  from sljax.lora.engine import held_base
  kept = {}
  for bits in (0, 4):
    model = _model("llama", rank=2, num_layers=2, base_bits=bits, dtype="bfloat16")
    engine = LoraEngine(model, optax.sgd(0.1), LoraEngineConfig(live_layers=1, resident_layers=2, tail_layers=2))
    shapes = jax.eval_shape(lambda: model.base.init_layers(jax.random.split(jax.random.key(0), 2)))
    base = jax.eval_shape(lambda layers: held_base(model, layers), shapes)
    stack = jax.eval_shape(model.init_adapters, jax.random.key(0), shapes)
    x = jax.ShapeDtypeStruct((2, 16, model.cfg.hidden_size), jnp.bfloat16)
    residuals = jax.eval_shape(lambda b, s, x: engine._calls._tail_forward_fn(b, s, jnp.int32(0), jnp.int32(0), x)[1],
                               base, stack, x)
    kept[bits] = tree_bytes(residuals.kept)
  assert kept[4] == kept[0]


@pytest.mark.slow
def test_a_plan_with_the_whole_base_resident_splits_the_batch_where_a_longer_tail_computes_less(monkeypatch):
  """A tail holds one sub-batch's residuals per layer: where the whole base is resident and the tail cannot hold
  every layer, the batch in more sub-batches (of MIN_TAIL_CALL_TOKENS a call at least) keeps a longer tail within
  the same budget, and the plan takes it when its step computes less; a sub-batch count given is kept."""
  from sljax.lora import plan as lora_plan
  model = _model("llama", rank=2, num_layers=8)
  none = plan_lora(model, 8, Budget(GIB, GIB), batch=4, tail_layers=0)
  whole = plan_lora(model, 8, Budget(GIB, GIB), batch=4)
  budget = Budget((none.footprint.device_bytes + whole.footprint.device_bytes) // 2, GIB)
  one = plan_lora(model, 8, budget, batch=4)  # calls of 32 tokens: below the floor, one sub-batch
  monkeypatch.setattr(lora_plan, "MIN_TAIL_CALL_TOKENS", 8)  # a row a call
  split = plan_lora(model, 8, budget, batch=4)
  assert one.engine.sub_batches == 1 and split.engine.sub_batches == 4 and split.footprint.fits(budget)
  assert one.engine.tail_layers < split.engine.tail_layers and split.engine.resident_layers == 8
  compute = lambda plan: sum(phase.compute_seconds for phase in plan.phases.values())
  assert compute(split) < compute(one)
  assert plan_lora(model, 8, budget, batch=4, sub_batches=1).engine.tail_layers == one.engine.tail_layers


@pytest.mark.slow
def test_a_plan_on_a_compressed_base_takes_the_fewest_sub_batches_that_keep_the_whole_model_as_tail(monkeypatch):
  """Every sub-batch's call dequantizes its layer again, forward and backward, so the step's compute counts
  2 x sub-batches x layers dequantizes (a layer's codes read and its kernels written at the memory's rate); between
  splits whose tails hold every layer, the one with the fewest sub-batches computes least and is taken (rows of 512
  tokens: the tiny layers' matmuls outweigh their dequantizes there, as llama70b's do at 2048)."""
  from sljax.lora import plan as lora_plan
  monkeypatch.setattr(lora_plan, "MIN_TAIL_CALL_TOKENS", 512)  # a row a call
  model, seq = _model("llama", rank=2, num_layers=8, base_bits=4), 512
  fixed = {n: plan_lora(model, seq, Budget(GIB, GIB), batch=4, sub_batches=n) for n in (1, 2, 4)}
  assert all(plan.engine.tail_layers == 8 for plan in fixed.values())
  machine, layers = fixed[1].machine, 8
  written = jnp.dtype(model.cfg.dtype).itemsize * model_sizes(model.base).layer_params  # the kernels, dequantized
  dequantize = (held_layer_bytes(model) + written) / machine.memory_bytes_per_s
  for n in (2, 4):
    assert fixed[n].phases["forward"].compute_seconds - fixed[1].phases["forward"].compute_seconds == pytest.approx(
        (n - 1) * layers * dequantize)
  device = lambda plan: plan.footprint.device_bytes
  assert device(fixed[1]) > device(fixed[2])
  chosen = plan_lora(model, seq, Budget(device(fixed[2]), GIB), batch=4)
  assert (chosen.engine.sub_batches, chosen.engine.tail_layers) == (2, 8)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 0])
def test_a_plan_that_keeps_the_whole_model_as_tail_grows_its_sub_batches_where_a_compressed_base_dequantizes(
    monkeypatch, bits):
  """With the batch the plan's own and the whole model kept as the tail, a compressed base's sub-batches grow a row at
  a time while that tail still fits: as many calls dequantize each layer for more tokens (here 2 sub-batches of 2
  rows become 2 of 3, where 3 rows are the most the budget holds the whole tail for). An uncompressed base computes
  the same per token at any rows and keeps its batch; a batch given is kept."""
  from sljax.lora import plan as lora_plan
  seq = 2048  # long rows: a tiny layer's matmuls outweigh its dequantize, as llama70b's do
  monkeypatch.setattr(lora_plan, "SUB_BATCH_TOKENS", 4 * seq)  # 4 rows a call at most: the first batch tried is 4
  monkeypatch.setattr(lora_plan, "MIN_TAIL_CALL_TOKENS", seq)  # a row a call
  model = _model("llama", rank=2, num_layers=8, base_bits=bits)
  three = plan_lora(model, seq, Budget(8 * GIB, GIB), batch=6, sub_batches=2)
  assert three.engine.tail_layers == 8
  budget = Budget(three.footprint.device_bytes, GIB)
  with pytest.raises(ValueError, match="with a tail of 8 layers"):
    plan_lora(model, seq, budget, batch=8, sub_batches=2, tail_layers=8)  # 4 rows a sub-batch: the tail no longer fits
  chosen = plan_lora(model, seq, budget)
  assert chosen.engine.tail_layers == 8 and chosen.engine.resident_layers == 8 and chosen.footprint.fits(budget)
  per_token = lambda plan: sum(phase.compute_seconds for phase in plan.phases.values()) / plan.batch
  if bits:
    assert (chosen.batch, chosen.engine.sub_batches) == (6, 2)
    assert "sub-batches of 3 rows" in chosen.batch_why
    two = plan_lora(model, seq, budget, batch=4, sub_batches=2)
    assert per_token(chosen) < per_token(two)
  else:
    assert chosen.batch == 4 and not chosen.batch_why
  assert plan_lora(model, seq, budget, batch=4).batch == 4


@pytest.mark.slow
def test_lora_on_an_int4_base_fine_tunes_as_on_the_bf16_one(tmp_path):
  """benchmarks/qlora_quality.py's smoke: a tiny model pretrained 30 steps, then LoRA fine-tuned 10 steps on its bf16
  base and on the same base in int4, from the same adapters on the same batches. The int4 base is another model (its
  held-out loss differs before fine-tuning) whose fine-tuned held-out loss stays within 0.02 of the bf16 one's (it
  differs by ~1e-4; a base quantized to garbage would lose the 2 nats the pretraining gained)."""
  result = benchmark_smoke("qlora_quality", tmp_path)
  assert has_provenance(result, "qlora_quality")
  pretrain, (bf16, int4) = result["pretrain"], (result["runs"][name] for name in ("bfloat16", "int4"))
  assert pretrain["train_loss_last_step"] < pretrain["train_loss_first"] - 2
  assert all(run["train_loss_last_step"] < run["train_loss_first"] - 0.1 for run in (bf16, int4))
  assert bf16["held_out_loss_before"] != int4["held_out_loss_before"]
  assert abs(result["quantized_minus_unquantized"]["held_out_loss"]) < 0.02, result["quantized_minus_unquantized"]


@pytest.mark.slow
def test_base_has_no_master_copy_and_runs_in_the_compute_dtype():
  """bf16 compute: the base's kernels are held in bf16 (what the layers run in), vectors as stored; the adapters
  are fp32; nothing else is kept."""
  model = _model("llama", rank=2, dtype="bfloat16")
  engine = LoraEngine(model, optax.adamw(1e-3), LoraEngineConfig(resident_layers=2))
  engine.init_base(jax.random.key(0))
  kernels = {x.dtype for path, x in jax.tree_util.tree_flatten_with_path(engine.base["groups"])[0]
             if "kernel" in jax.tree_util.keystr(path)}
  assert kernels == {jnp.dtype("bfloat16")}
  state = engine.init(jax.random.key(1))
  assert {x.dtype for x in jax.tree.leaves(state["adapters"])} == {jnp.dtype("float32")}
  assert set(state) == {"step", "adapters", "opt"}
  state, loss = engine.step(state, make_batch(np.random.default_rng(0), 4, 8))
  assert np.isfinite(float(loss))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [0, 4])
def test_a_resident_group_of_several_layers_is_made_a_layer_at_a_time_as_one_call_makes_it(bits):
  """The tail (one group, up to the whole model) is made a layer at a time into its buffers: made in one call, a
  llama70b tail of 80 int4 layers compiled to 121 GiB on an H100. The same bits as that one call, from init_base and
  from load_base."""
  model = _model("llama", rank=2, dtype="bfloat16", base_bits=bits)
  engine = LoraEngine(model, optax.sgd(0.0), LoraEngineConfig(resident_layers=4, tail_layers=3))  # layers 1-3
  made = []
  for name in ("_init_base_layers", "_hold"):
    call = getattr(engine, name)
    setattr(engine, name, lambda tree, call=call: (made.append(len(jax.tree.leaves(tree)[0])), call(tree))[1])
  engine.init_base(jax.random.key(5))
  reader = RandomBase(model.base, jax.random.key(5))
  whole = sljax.lora.engine.held_base(model, jax.tree.map(jnp.asarray, reader.layers(1, 4)))
  jax.tree.map(np.testing.assert_array_equal, engine.base["groups"][-1], whole)
  engine.load_base(reader)
  jax.tree.map(np.testing.assert_array_equal, engine.base["groups"][-1], whole)
  assert made and set(made) == {1}


@pytest.mark.slow
def test_fresh_adapters_leave_the_model_exactly_the_base():
  model = _model("opt", rank=3)
  params = _init_base(model)(jax.random.key(0))
  adapters = model.init_adapters(jax.random.key(1), params["layers"])
  h = jax.random.normal(jax.random.key(2), (2, 5, SHAPES["opt"]["hidden_size"]))
  np.testing.assert_array_equal(model.layers(join_adapters(params["layers"], adapters), h),
                                model.base.layers(params["layers"], h))


@pytest.mark.slow
def test_merged_adapters_are_the_same_model():
  model = _model("llama", rank=4)
  params = _init_base(model)(jax.random.key(0))
  layers = join_adapters(params["layers"], _random_adapters(model, params["layers"], 3))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 7)), jnp.int32)
  with_adapters = model.base.logits(params["outer"], model.layers(layers, model.embed(params["outer"], tokens)))
  merged = merge(model.lora, layers)
  assert split_adapters(merged)[1] == {}
  np.testing.assert_allclose(model.base.forward({"outer": params["outer"], "layers": merged}, tokens),
                             with_adapters, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_merged_weights_read_group_by_group_are_the_merged_params():
  """What generate.py --lora_checkpoint loads: the base read one group at a time, each group's adapters merged; a
  run's random base (no Hugging Face files) is the engine's init_base."""
  model = _model("opt", rank=2)
  engine = LoraEngine(model, optax.sgd(0.0), LoraEngineConfig(live_layers=3))
  engine.init_base(jax.random.key(5))
  base = engine.base_params()
  reader = RandomBase(model.base, jax.random.key(5))
  jax.tree.map(np.testing.assert_array_equal, {"outer": reader.outer(), "layers": reader.layers(0, 3)}, base)
  rng = np.random.default_rng(0)
  adapters = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32),
                          jax.eval_shape(model.init_adapters, jax.random.key(0), base["layers"]))
  merged = MergedWeights(reader, model.lora, adapters)
  whole = merge(model.lora, join_adapters(base["layers"], adapters))
  by_group = jax.tree.map(lambda *xs: np.concatenate(xs), *(merged.layers(i, i + 1) for i in range(3)))
  jax.tree.map(np.testing.assert_array_equal, by_group, jax.tree.map(np.asarray, whole))


def test_targets_name_the_adapted_projections():
  model = _model("llama", rank=2)
  layers = _init_base(model)(jax.random.key(1))["layers"]
  adapters = model.init_adapters(jax.random.key(0), layers)
  assert sorted(adapters) == sorted(TARGETS["llama"])
  for targets in (("query",), ("q_proj", "query")):  # one unknown name is a typo, even beside known ones
    with pytest.raises(ValueError, match="no Dense module of the layers is named query"):
      LoraModel(model.base, LoraConfig(targets=targets)).init_adapters(jax.random.key(0), layers)


@pytest.mark.parametrize("field, value", [("rank", 0), ("alpha", float("nan")), ("alpha", -1.0), ("base_bits", 16),
                                          ("base_bits", 3)])
def test_bad_lora_config_is_refused(field, value):
  with pytest.raises(ValueError, match=field):
    LoraConfig(**{field: value})


@pytest.mark.slow
def test_a_non_finite_step_changes_nothing():
  model = _model("opt", rank=2)
  engine = LoraEngine(model, optax.adamw(1e-2), LoraEngineConfig(sub_batches=2))
  engine.load_base(_init_base(model)(jax.random.key(0)))
  state = engine.init(jax.random.key(1))
  before = engine.adapters(state)
  batch = make_batch(np.random.default_rng(0), 4, 8)
  batch["weights"][0, 0] = np.inf
  state, loss = engine.step(state, batch)
  assert np.isnan(float(loss)) and int(state["step"]) == 0
  jax.tree.map(np.testing.assert_array_equal, engine.adapters(state), before)


@pytest.mark.slow
def test_steps_after_the_first_compile_nothing():
  """A step's state comes back laid out as it went in, so the second step compiles nothing (it once compiled the
  update again: for llama70b's adapters on the GPU, a minute, and the device memory of a second update)."""
  model = _model("opt", rank=2)
  engine = LoraEngine(model, _optimizer("adamw", clip=1.0), LoraEngineConfig(sub_batches=2))
  engine.init_base(jax.random.key(0))
  state, rng, compiles = engine.init(jax.random.key(1)), np.random.default_rng(0), []
  count = lambda event, seconds, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
  state, loss = engine.step(state, make_batch(rng, 4, 8))
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    for _ in range(2):
      state, loss = engine.step(state, make_batch(rng, 4, 8))
    assert np.isfinite(float(loss)) and int(state["step"]) == 3
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert compiles == []


@pytest.mark.slow
def test_a_step_waits_for_each_group_before_it_dispatches_past_the_next(monkeypatch):
  """The host stays one group ahead of the device: after each group's calls are issued, the previous group's are
  done (sljax.memory.InFlight waits), so the device never holds more groups' weights than the plan counts."""
  left_waiting = []

  class Recording(InFlight):
    def add(self, output):
      super().add(output)
      left_waiting.append(len(self.outputs))

  monkeypatch.setattr(sljax.lora.engine, "InFlight", Recording)
  model = _model("llama", rank=2)
  engine = LoraEngine(model, optax.adamw(1e-3), LoraEngineConfig(sub_batches=2, resident_layers=2))
  engine.init_base(jax.random.key(0))
  _, loss = engine.step(engine.init(jax.random.key(1)), make_batch(np.random.default_rng(0), 4, 8))
  assert np.isfinite(float(loss))
  assert left_waiting == [1] * (2 * len(engine.groups) - 1)  # every group forward, the last, every group backward


@pytest.mark.slow
def test_each_backward_groups_first_input_is_fetched_behind_the_group_before_it():
  """As the training engine's (tests/test_engine.py): a copy into device memory starts only once the calls issued
  before it have run, so each stashed input is fetched one backward call ahead, across groups too."""
  model = _model("llama", rank=2)
  engine = LoraEngine(model, optax.adamw(1e-3), LoraEngineConfig(sub_batches=2))
  engine.init_base(jax.random.key(0))
  events = []
  record_calls(engine, events, {"_unstash": "fetch", "_backward": "backward"})
  engine.step(engine.init(jax.random.key(1)), make_batch(np.random.default_rng(0), 4, 8))
  assert inputs_fetched_one_call_ahead(events) == 2 * (len(engine.groups) - 1) and len(engine.groups) > 2


class _Output:
  def __init__(self, deleted=False):
    self.deleted, self.waited = deleted, False

  def is_deleted(self):
    return self.deleted

  def block_until_ready(self):
    self.waited = True


def test_in_flight_waits_for_the_output_limit_calls_back_unless_donated_since():
  pace, outputs = InFlight(2), [_Output(), _Output(deleted=True), _Output(), _Output(), _Output()]
  for n, output in enumerate(outputs):
    pace.add(output)
    assert [x.waited for x in outputs] == [n >= 2, False, n >= 4, False, False]


@pytest.mark.slow
def test_a_plan_over_a_data_mesh_is_each_devices_plan_for_its_rows():
  """Over data:2 each device holds the whole base and adapters and runs half the rows: the plan for batch 8 is one
  device's plan for batch 4 (its bytes, tiers and times, a device's budget), its batch the whole; a batch it leaves
  open is rows x devices."""
  model = _model("llama", rank=2, num_layers=8)
  roomy = plan_lora(model, 8, Budget(device_bytes=GIB, host_bytes=GIB), batch=4, sub_batches=2, tail_layers=0)
  layer = roomy.device_bytes["resident base layers"] // 8
  budget = Budget(device_bytes=sum(roomy.device_bytes.values()) - 2 * layer, host_bytes=GIB)  # part streams
  one = plan_lora(model, 8, budget, batch=4, sub_batches=2, tail_layers=0)
  two = plan_lora(model, 8, budget, batch=8, sub_batches=2, tail_layers=0, devices=2)
  assert one.engine.resident_layers < 8 and (two.batch, two.rows, two.devices) == (8, 4, 2)
  assert (two.engine, two.device_bytes, two.host_bytes, two.phases) == (one.engine, one.device_bytes, one.host_bytes,
                                                                        one.phases)
  assert "batch 8 (4 rows x 2 devices, each with the whole base) as 2 sub-batches" in two.describe()
  open_batch = lambda devices: plan_lora(model, 8, budget, sub_batches=2, max_rows=4, tail_layers=0, devices=devices)
  assert open_batch(2).batch == 2 * open_batch(1).batch
  with pytest.raises(ValueError, match="batch 12 does not split into 2 sub-batches x 4 devices"):
    plan_lora(model, 8, budget, batch=12, sub_batches=2, devices=4)


def test_plan_streams_what_the_device_cannot_hold_and_its_engine_runs():
  model = _model("llama", rank=2, num_layers=8)
  roomy = plan_lora(model, 8, Budget(device_bytes=GIB, host_bytes=GIB), batch=4, tail_layers=0)
  assert roomy.engine.resident_layers == 8 and not roomy.engine.activations_on_host
  layer = roomy.device_bytes["resident base layers"] // 8
  tight = plan_lora(model, 8, Budget(device_bytes=sum(roomy.device_bytes.values()) - 2 * layer, host_bytes=GIB),
                    batch=4, tail_layers=0)
  # Two layers short: three streamed groups are on the device at once (STREAMED_IN_FLIGHT), so five stream, less the
  # layers the stash makes room for where the plan sends it to pinned host memory: here it does, as its copy out
  # overlaps the streamed layers' copies in (sljax.footprint.copy_seconds) and costs less than one more streamed layer.
  freed = roomy.device_bytes["stashed activations"] // layer if tight.engine.activations_on_host else 0
  assert tight.engine.activations_on_host and freed == 1
  assert tight.engine.resident_layers == 8 - 2 - STREAMED_IN_FLIGHT + freed
  assert tight.host_bytes["streamed base layers"] == (8 - tight.engine.resident_layers) * layer
  assert "LoRA plan" in tight.describe()
  engine = LoraEngine(model, optax.adamw(1e-3), tight.engine)
  engine.init_base(jax.random.key(0))
  _, loss = engine.step(engine.init(jax.random.key(1)), make_batch(np.random.default_rng(0), 4, 8))
  assert np.isfinite(float(loss))
  with pytest.raises(ValueError, match="does not fit"):
    plan_lora(model, 8, Budget(device_bytes=1024, host_bytes=1024), batch=4)


def test_flops_count_the_base_three_times_and_the_recompute_only_where_it_runs():
  model = _model("llama", rank=2)
  no_recompute = lora_flops_per_token(model, 8, recomputed_layers=0)
  all_recomputed = lora_flops_per_token(model, 8, recomputed_layers=4)
  kernels = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 40
  adapters = 2 * (32 + 32) + 2 * (32 + 16) + 2 * (40 + 32)  # q: 32 -> 32, v: 32 -> 16, down: 40 -> 32
  assert no_recompute.hardware == no_recompute.model == all_recomputed.model  # MFU never counts the recompute
  assert all_recomputed.hardware - no_recompute.hardware == 4 * (2 * kernels + 2 * adapters + 2 * 8 * 32)


# XLA's count is over the formula's by the elementwise ops (norms, activations, softmax, residual adds), by the
# masked half of causal attention, which it computes and the formula leaves out, and by what a layer's backward
# reruns without remat (models/llama.py: the norms, and with them the adapters' first products x A of the norms'
# outputs): ~1-5% at these shapes, where matmuls dominate (width 256, seq 8; the rerun is 0.02% of a llama7b layer's
# gradient). Counting the recompute in model FLOPs would be ~30% over.
XLA_EXTRA = 0.06


@pytest.mark.slow
def test_flops_per_token_are_xlas_count_of_the_steps_compiled_calls():
  """A 3-layer llama, one layer per group: the last group runs with no recompute, the two others recompute their
  forward in their backward. XLA's cost analysis of the engine's compiled calls (one sub-batch; a call's scan of one
  layer is counted whole) against lora_flops_per_token: model FLOPs are the step's passes with the recompute left
  out, hardware FLOPs add a forward call per recomputed layer."""
  layers, seq = 3, 8
  shape = dict(family="llama", num_layers=layers, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
               vocab_size=256, dtype="float32", remat=False)
  model = LoraModel(build(get_config("llama-tiny", shape)), LoraConfig(rank=16, alpha=32.0))
  calls = LoraEngine(model, optax.sgd(0.0), LoraEngineConfig(live_layers=1)).calls
  array = lambda *dims, dtype=jnp.float32: jax.ShapeDtypeStruct(dims, jnp.dtype(dtype))
  x = array(1, seq, 256)  # one row: FLOPs per call = FLOPs per token x seq
  base = jax.eval_shape(lambda: calls.hold(model.base.init_layers(jax.random.split(jax.random.key(0), 1))))
  adapters = jax.eval_shape(model.init_adapters, jax.random.key(0), base)
  stack = jax.eval_shape(model.init_adapters, jax.random.key(0), jax.eval_shape(
      lambda: model.base.init_layers(jax.random.split(jax.random.key(0), layers))))
  outer, start = jax.eval_shape(model.base.init_outer, jax.random.key(0)), array(dtype=jnp.int32)
  per_token = lambda lowered: lowered.compile().cost_analysis()["flops"] / seq
  forward = per_token(calls.forward.lower(base, stack, start, x))
  grads = jax.eval_shape(calls.zeros, stack)  # the accumulators: a slot per device (one here)
  backward = per_token(calls.backward.lower(base, stack, start, x, x, grads))  # recompute + backward
  # The last group of one layer: its forward keeping its residuals, the head and its backward, its backward.
  _, residuals = jax.eval_shape(calls.tail_forward, base, stack, start, start, x)
  last = (per_token(calls.tail_forward.lower(base, stack, start, start, x))
          + per_token(calls.head.lower(outer, x, array(1, seq, dtype=jnp.int32), array(1, seq), array()))
          + per_token(calls.tail_backward.lower(base, stack, start, start, residuals, x, grads)))
  # The backward alone, from the forward's residuals: the backward call without its recompute.
  pullback = jax.eval_shape(lambda base, adapters, x: jax.vjp(
      lambda adapters, x: model.layers(join_adapters(base, adapters), x), adapters, x)[1], base, adapters, x)
  backward_alone = per_token(jax.jit(lambda pullback, dy: pullback(dy)).lower(pullback, x))

  one_layer = lora_flops_per_token(LoraModel(build(get_config("llama-tiny", dict(shape, num_layers=1))),
                                             model.lora), seq, recomputed_layers=0)
  assert one_layer.model == one_layer.hardware <= last <= (1 + XLA_EXTRA) * one_layer.model
  flops = lora_flops_per_token(model, seq, recomputed_layers=layers - 1)
  model_counted = last + (layers - 1) * (forward + backward_alone)
  assert flops.model <= model_counted <= (1 + XLA_EXTRA) * flops.model
  recomputed = flops.hardware - flops.model
  assert recomputed <= (layers - 1) * forward <= (1 + XLA_EXTRA) * recomputed
  # The calls the step runs: XLA's recompute leaves out the layer's last projection (no gradient needs its output),
  # so they run between the model FLOPs and the hardware FLOPs, which count a whole forward per recomputed layer.
  step = last + (layers - 1) * (forward + backward)
  assert flops.model < step <= flops.hardware


def test_a_plan_for_a_gpu_keeps_its_margin_and_corrects_the_cpu_compiled_peak(monkeypatch):
  """--target on a CPU: the GPU's rates, GPU_MARGIN_BYTES unplanned, the calls' peak through gpu_peak_from_cpu."""
  monkeypatch.setattr(sljax.lora.plan, "gpu_peak_from_cpu", lambda cpu_peak: 3 * cpu_peak)
  model = _model("llama", rank=2)
  here = plan_lora(model, 8, Budget(device_bytes=GIB, host_bytes=GIB), batch=4, tail_layers=0)
  there = plan_lora(model, 8, Budget(device_bytes=8 * GIB, host_bytes=GIB), batch=4, target=H200, tail_layers=0)
  assert here.device_bytes[MARGIN] == 0
  assert there.device_bytes[MARGIN] == GPU_MARGIN_BYTES
  assert there.device_bytes[SCRATCH] == 3 * here.device_bytes[SCRATCH]
  forward = there.phases["forward"].compute_seconds  # batch 4 of 8 tokens through 4 layers
  assert forward == pytest.approx(4 * 8 * 4 * lora_layer_flops(model, 8).forward
                                  / (H200.peak_flops * H200.layer_efficiency))


@pytest.mark.slow
@pytest.mark.parametrize("layers_short", [0, 2])
def test_live_bytes_after_every_dispatch_stay_within_the_plan(layers_short):
  """What the engine holds, per memory kind, after each of its calls and transfers over steady steps, against what
  its plan says (less the compiled calls' scratch, which no live array shows): everything on the device, and a
  device layers_short layers too small, so that part of the base streams from host memory."""
  model = _model("llama", rank=2, num_layers=8)
  roomy = plan_lora(model, 8, Budget(device_bytes=GIB, host_bytes=GIB), batch=4, sub_batches=2, tail_layers=0)
  layer = roomy.device_bytes["resident base layers"] // 8
  plan = plan_lora(model, 8, Budget(sum(roomy.device_bytes.values()) - layers_short * layer, GIB), batch=4,
                   sub_batches=2)
  assert (plan.engine.resident_layers < 8) == (layers_short > 0)
  engine = LoraEngine(model, optax.adamw(1e-3), plan.engine)
  earlier = jax.live_arrays()  # other tests' arrays, garbage included: held, so none is freed and no id is reused
  earlier_ids = {id(x) for x in earlier}
  peaks = {"device": 0, HOST: 0}

  def recorded(fn):
    def call(*args, **kwargs):
      out = fn(*args, **kwargs)
      live = [x for x in jax.live_arrays() if not x.is_deleted() and id(x) not in earlier_ids]
      for kind in peaks:
        peaks[kind] = max(peaks[kind], sum(x.nbytes for x in live if x.sharding.memory_kind == kind))
      return out
    return call

  for name in ("_embed", "_forward", "_tail_forward", "_head", "_tail_backward", "_backward", "_update", "_zeros"):
    setattr(engine, name, recorded(getattr(engine, name)))
  object.__setattr__(engine.place, "_put", recorded(engine.place._put))  # every transfer
  engine.init_base(jax.random.key(0))
  state = engine.init(jax.random.key(1))
  batch = make_batch(np.random.default_rng(0), 4, 8)
  for _ in range(3):
    state, _ = engine.step(state, batch)
  device = sum(plan.device_bytes.values()) - plan.device_bytes[SCRATCH]
  host = sum(plan.host_bytes.values())
  assert peaks["device"] <= device and peaks[HOST] <= host, (peaks, device, host)


@pytest.mark.slow
@pytest.mark.parametrize("family,sub_batches,live_layers,resident_layers", [("llama", 4, 2, 1), ("opt", 2, 1, 0)])
def test_eval_loss_is_the_lora_models_loss_and_changes_nothing(family, sub_batches, live_layers, resident_layers):
  """Forward only through the streamed base and the adapters: the LoraModel's loss in fp32 (1e-6), the state
  unchanged (a step after it is the step without it, bit for bit)."""
  model = _model(family, rank=4)
  engine = LoraEngine(model, optax.adamw(1e-2), LoraEngineConfig(sub_batches=sub_batches, live_layers=live_layers,
                                                                 resident_layers=resident_layers))
  engine.load_base(_init_base(model)(jax.random.key(0)))
  base = engine.base_params()
  adapters = _random_adapters(model, base["layers"], 1)
  rng = np.random.default_rng(2)
  batch, held_out = make_batch(rng, 8, 8), make_batch(rng, 8, 8)
  want = float(jax.jit(model.loss)({"outer": base["outer"], "layers": join_adapters(base["layers"], adapters)},
                                   held_out))
  runs = []
  for evaluate in (False, True):
    state = engine.from_adapters(adapters)
    if evaluate:
      got = float(engine.eval_loss(state, held_out))
      assert abs(got - want) <= 1e-6 * want, (got, want)
    state, loss = engine.step(state, batch)
    runs.append((float(loss), [np.asarray(x) for x in jax.tree.leaves(state)]))
  assert runs[0][0] == runs[1][0]
  for without, with_eval in zip(runs[0][1], runs[1][1], strict=True):
    np.testing.assert_array_equal(with_eval, without)
