"""LoRA fine-tuning, one step (`LoraEngine.step`) top to bottom:

  embed every sub-batch                           (the frozen embeddings and head stay on the device)
  for each group g but the last: base W_g on the device (resident, or fetched from pinned host one group ahead);
      stash h[g][s]; every sub-batch through W_g + its adapters -> h[g+1][s]
  last group: per sub-batch, each layer's forward (a call per layer, keeping its residuals in buffers of their own),
      head + loss and its backward, each layer's backward (freeing its residuals) -> dh, the group's adapter
      gradient (a longer resident tail, `tail_layers`, keeps more layers' residuals: they are not recomputed)
  for each group g, last-but-one down to 0: W_g again (a streamed group crosses PCIe a second time); the stashed
      inputs back; recompute + backward of every sub-batch: input gradients and adapter gradients, none for the base
  one optax update of every adapter at once, on the device

The trainable state is one array per adapter leaf stacked over all layers (lora_a of q_proj: [layers, in, r]), as
LoraModel's params hold them, and so are their gradient and optimizer state: a llama's 7 projections are 14 arrays
whatever the model's depth or the layer groups. Each group's call takes the whole stack and its group's first layer,
traced, and slices its layers out (lax.dynamic_slice): one compile serves every group of a size; a backward adds its
group's gradient into the stacked accumulator in place (donated). The update is then one optax call over those few
arrays: at llama70b's shapes it compiles in under a second on CPU, where a leaf per layer group and projection
(1,120 leaves at one layer a group) took 18 s.

Over a data-parallel mesh (sljax.mesh's data axis; fsdp 1) every device holds the whole base and the whole trainable
state, and every sub-batch is split over the devices, as full training splits it (sljax.schedule): each device runs
its own rows through every call with no collective, adding its rows' part of the adapters' gradient (the loss is the
whole batch's weighted mean, so the parts sum to it) to a per-device slot; once the backward is done, ONE all-reduce
sums the slots (Placement.reduce), and each device applies the same update to its copy. Each device sends 2 (n-1)/n
of the adapters' fp32 gradient (and of the 4-byte loss) per step, in one collective after the backward (llama70b's
rank-16 gradient is 0.8 GB: milliseconds over NVLink, in a step of seconds); its PCIe traffic is the single-device
schedule's for its rows.

The base has no master copy, no gradient and no optimizer state: it is held by the engine (`load_base` / `init_base`)
in the dtypes its layers run in (with LoraConfig.base_bits, its kernels as int8 / int4 codes and scales, quantized
once as each group is loaded and dequantized inside every call that runs the group: forward, recompute and input
gradient; `held_base`) and never changes, so the state a step consumes and returns (and a checkpoint holds)
is only the adapters, their optimizer state and the step count. Because the whole trainable state is on the device,
the update is the optimizer's own over all adapters at once: any optax chain, global-norm clipping included, is
exactly the plain step's.
"""

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from models.common import layer_compute_dtypes, loss_denominator, params_reader
from sljax.generate import layer_groups
from sljax.lora.model import LoraModel, join_adapters, split_adapters
from sljax.memory import InFlight, Placement, prefetch
from sljax.mesh import PER_DEVICE, REPLICATED, check_batch
from sljax.metrics import StepFlops, step_flops
from sljax.quant import QuantConfig, can_pack_halves, dequantize_layer, map_packed, pack_halves, quantize_layers, \
    unpack_halves
from sljax.schedule import Residuals, backward_inputs, check_training_batch, shared_calls
from sljax.sizes import model_sizes, stacked_layer_shapes


@dataclasses.dataclass(frozen=True)
class LoraEngineConfig:
  sub_batches: int = 1  # N: the effective batch is split into N sub-batches that share each fetch of a base group
  live_layers: int = 1  # layers per group
  resident_layers: int = 0  # base layers that stay on the device (spread among the streamed ones); the rest stream
  activations_on_host: bool = True  # stash group-boundary hidden states in pinned host memory for the backward
  # > 0: the last group is the last tail_layers layers, resident (counted in resident_layers): one call per sub-batch
  # runs their forward, the head and their backward, keeping their residuals instead of recomputing them. 0: the last
  # group is as long as the others.
  tail_layers: int = 0


class LayerFlops(NamedTuple):
  """FLOPs per token of one LoRA layer (lora_layer_flops)."""

  forward: float  # the base's matmuls, the adapters' and causal attention, once
  backward: float  # the input gradient of the frozen base, the adapters' input and weight gradients, attention's


def lora_layer_flops(model: LoraModel, seq_len: int) -> LayerFlops:
  """One layer's FLOPs per token: the base's matmuls forward and input gradient (2 + 2 x params; the frozen base has
  no weight gradient), the adapters' forward, input and weight gradients (3 x 2 x params), causal attention forward
  (2 S D) and backward (twice that). The metric (lora_flops_per_token) and the plan's compute time
  (sljax.lora.plan) both count these."""
  sizes = model_sizes(model.base)
  probe = jax.eval_shape(lambda: model.init_layers(jax.random.split(jax.random.key(0), 1)))
  base, adapters = split_adapters(probe)
  kernels = sum(x.size for path, x in traverse_util.flatten_dict(base).items() if path[-1] == "kernel")
  adapter_params = sum(x.size for x in jax.tree.leaves(adapters))
  attention = 2 * seq_len * sizes.hidden  # causal QK^T and AV of one forward
  return LayerFlops(forward=2 * kernels + 2 * adapter_params + attention,
                    backward=2 * kernels + 4 * adapter_params + 2 * attention)


def lora_flops_per_token(model: LoraModel, seq_len: int, recomputed_layers: int) -> StepFlops:
  """FLOPs per token of one LoRA step, by full training's rule (sljax.metrics.StepFlops): model FLOPs (MFU) count
  each layer's forward once and its backward (lora_layer_flops), and the head's forward and input gradient. Hardware
  FLOPs (HFU) add one more forward of each of the `recomputed_layers` layers the engine recomputes in its backward."""
  cfg, layer = model.cfg, lora_layer_flops(model, seq_len)
  head = 4 * cfg.vocab_size * model_sizes(model.base).hidden if hasattr(cfg, "vocab_size") else 0
  return step_flops(cfg.num_layers * (layer.forward + layer.backward) + head, layer.forward, recomputed_layers)


def held_base(model: LoraModel, stacked) -> dict:
  """Base layer params as the engine holds them: each leaf in the dtype the base model runs it in and, with
  base_bits, every kernel as group-wise codes and scales (sljax.quant's, QuantConfig's group size, as generation
  compresses layers). jnp: jit it, or eval_shape it for the bytes."""
  cast = jax.tree.map(lambda x, dtype: x.astype(dtype), stacked, layer_compute_dtypes(model.base, stacked))
  bits = model.lora.base_bits
  if not bits:
    return cast
  # Every call dequantizes whole kernels before its matmuls: int4 codes as bytes unpack at the HBM's rate there.
  return map_packed(lambda node: pack_halves(node) if can_pack_halves(node) else node,
                    quantize_layers(cast, QuantConfig(bits=bits)))


def group_layers(stack, start, layers: int):
  """Layers [start, start + layers) of every leaf of `stack` (stacked over all layers; start may be traced)."""
  return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, layers), stack)


def add_group(slots, grads, start):
  """The per-device gradient slots of the stack (a leading slot axis, then the layers; inside `Placement.local`)
  with a group's gradient `grads` added in fp32 at its layers, from `start` on."""

  def add(slot, grad):
    layers = jax.lax.dynamic_slice_in_dim(slot, start, grad.shape[0], axis=1)
    return jax.lax.dynamic_update_slice_in_dim(slot, layers + grad.astype(slot.dtype)[None], start, axis=1)

  return jax.tree.map(add, slots, grads)


def _layer_count(base) -> int:
  return jax.tree.leaves(base)[0].shape[0]


def lora_groups(num_layers: int, cfg: LoraEngineConfig) -> tuple[list[tuple[int, int]], list[bool]]:
  """([start, stop) of each group, whether it is resident): sljax.generate.layer_groups of the layers before the
  tail, then the tail as one resident group."""
  head = num_layers - cfg.tail_layers
  groups, resident = layer_groups(head, cfg.resident_layers - cfg.tail_layers, cfg.live_layers)
  return groups + [(head, num_layers)] * bool(cfg.tail_layers), resident + [True] * bool(cfg.tail_layers)


class _LoraModelCalls:
  """An engine's jitted calls of its model (run without remat) on a mesh. Per-sub-batch calls see a group's base, the
  whole adapter stack with the group's first layer, and this device's rows; outputs are rows or per-device slots (the
  loss's part and the adapters' gradient accumulators, summed over the mesh by Placement.reduce)."""

  def __init__(self, model: LoraModel, mesh):
    if getattr(model.cfg, "remat", False):
      model = model.without_remat()  # each group's backward already recomputes it
    self.model = model
    place = Placement(mesh)
    local, whole, rows = place.local, REPLICATED, PER_DEVICE
    self.embed = local(model.embed, (whole, rows), rows)
    self.forward = local(self._forward_fn, (whole, whole, whole, rows), rows)
    # The last group, one layer a call (as sljax.schedule's engine runs it: no call's scratch grows with the tail):
    # (base, stack, start, layer, x) -> (y, the layer's residuals); (outer, h, targets, weights, inv_total) -> (loss,
    # dh); (base, stack, start, layer, residuals, dy, grads) -> (dx, grads). layer: within the group.
    self.tail_forward = local(self._tail_forward_fn, (whole, whole, whole, whole, rows), rows, donate=(4,))
    self.head = local(self._head_fn, (whole, rows, rows, rows, whole), rows, donate=(1,))
    self.tail_backward = local(self._tail_backward_fn, (whole, whole, whole, whole, rows, rows, rows), rows,
                               donate=(5, 6))
    self.backward = local(self._backward_fn, (whole, whole, whole, rows, rows, rows), rows, donate=(3, 5))
    self.last_group_loss = local(self._last_group_loss_fn, (whole, whole, whole, whole, rows, rows, rows, whole),
                                 rows)
    # The base is made whole on every device of the mesh (no process places another's devices' parts).
    whole_on_devices = place.device()
    self.hold = jax.jit(lambda stacked: held_base(model, stacked), out_shardings=whole_on_devices)
    self.init_base_layers = jax.jit(lambda keys: held_base(model, model.base.init_layers(keys)),
                                    out_shardings=whole_on_devices)
    self.init_outer = jax.jit(model.base.init_outer, out_shardings=whole_on_devices)
    self.init_adapters = jax.jit(model.init_adapters)

  def _layers(self, base, adapters, x):
    """A group's layers: its base and its adapters (sliced from the stack)."""
    return self.model.layers(join_adapters(base, adapters), x)

  def _forward_fn(self, base, stack, start, x):
    return self._layers(base, group_layers(stack, start, _layer_count(base)), x)

  def _tail_forward_fn(self, base, stack, start, layer, x):
    # A compressed base is dequantized before the vjp, as its backward does again: the dequantized kernels are then
    # the layer's weights, which Residuals leaves out, not residuals kept per layer (an int4 llama70b layer's: 1.6 GiB).
    base, adapters = dequantize_layer(base, layer, self.model.cfg.dtype), group_layers(
        stack, start + layer, 1)
    y, vjp = jax.vjp(lambda adapters, x: self._layers(base, adapters, x), adapters, x)
    return y, Residuals.of(vjp, base, adapters)

  def _head_fn(self, outer, h, targets, weights, inv_total):
    loss_fn = lambda h: self.model.head_loss(outer, h, targets, weights) * inv_total
    loss, dh = jax.value_and_grad(loss_fn)(h)
    return loss[None], dh  # loss: this device's rows' part

  def _tail_backward_fn(self, base, stack, start, layer, residuals, dy, grads):
    base, adapters = dequantize_layer(base, layer, self.model.cfg.dtype), group_layers(
        stack, start + layer, 1)
    d_adapters, dx = residuals.vjp(base, adapters)(dy)
    return dx, add_group(grads, d_adapters, start + layer)

  def _last_group_loss_fn(self, base, stack, start, outer, x, targets, weights, inv_total):
    h = self._layers(base, group_layers(stack, start, _layer_count(base)), x)
    return (self.model.head_loss(outer, h, targets, weights) * inv_total)[None]  # this device's rows' part

  def _backward_fn(self, base, stack, start, x, dy, grads):
    adapters = group_layers(stack, start, _layer_count(base))
    _, vjp = jax.vjp(lambda adapters, x: self._layers(base, adapters, x), adapters, x)
    d_adapters, dx = vjp(dy)
    return dx, add_group(grads, d_adapters, start)


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(group, layer, index):
  """`group` (stacked layers, donated) with `layer` (one layer, stacked) written at `index`."""
  return jax.tree.map(lambda g, x: jax.lax.dynamic_update_slice_in_dim(g, x, index, 0), group, layer)


class _LoraOptimizerCalls:
  """An engine's jitted optimizer calls on a mesh: the update of every adapter at once, and its state's init."""

  def __init__(self, optimizer: optax.GradientTransformation, mesh):
    self.optimizer = optimizer
    place = Placement(mesh)
    # Laid out as the state it replaces (replicated), so that the next step compiles nothing.
    self.update = jax.jit(self._update_fn, donate_argnums=(0, 1), out_shardings=place.device())
    # Laid out as the step's outputs are (the optimizer's counters too, which a plain jit would leave unplaced):
    # otherwise the second step compiles the update again.
    self.init = jax.jit(optimizer.init, out_shardings=place.device())

  def _update_fn(self, adapters, opt_state, grads, loss):
    """The optimizer's update of every adapter, or (a non-finite loss or gradient) the state unchanged."""
    ok = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    updates, new_opt_state = self.optimizer.update(grads, opt_state, adapters)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    return keep(optax.apply_updates(adapters, updates), adapters), keep(new_opt_state, opt_state), ok


class LoraEngine:
  """Fine-tunes the adapters of `model` (a LoraModel) layer-major with `optimizer`, on one device or data parallel
  over the devices of `placement`'s mesh (data:D; the whole base and adapters on every device).

    engine = LoraEngine(LoraModel(model, LoraConfig(rank=16)), optax.adamw(1e-4), LoraEngineConfig(...))
    engine.load_base(base_params)           # or init_base(key): {"outer", "layers"} of the base model, or a reader
    state = engine.init(key)                 # the adapters, their optimizer state, the step
    state, loss = engine.step(state, batch)  # consumes state
  """

  skips_bad_steps = True

  def __init__(self, model: LoraModel, optimizer: optax.GradientTransformation, cfg: LoraEngineConfig,
               placement: Placement | None = None):
    num_layers = model.cfg.num_layers
    if cfg.sub_batches < 1 or cfg.live_layers < 1:
      raise ValueError(f"sub_batches and live_layers must be >= 1, got {cfg.sub_batches} and {cfg.live_layers}")
    if not 0 <= cfg.resident_layers <= num_layers:
      raise ValueError(f"resident_layers must be in 0..{num_layers}, got {cfg.resident_layers}")
    if not 0 <= cfg.tail_layers <= cfg.resident_layers:
      raise ValueError(f"tail_layers must be in 0..resident_layers ({cfg.resident_layers}): the tail stays on the "
                       f"device; got {cfg.tail_layers}")
    self.place = placement or Placement.single()
    if self.place.fsdp != 1:
      raise ValueError(f"LoRA fine-tuning runs data parallel, the whole base and adapters on every device; the "
                       f"placement's mesh splits weights over fsdp:{self.place.fsdp}")
    # The jitted calls of this model object on this mesh (and of this optimizer), shared by all its engines (as
    # sljax.schedule's engines share theirs): another split or placement, or the planner sizing the calls, traces and
    # compiles none of them again.
    mesh = self.place.mesh
    self._calls = calls = shared_calls(("lora model", model, mesh), model.cfg, lambda: _LoraModelCalls(model, mesh))
    updates = shared_calls(("lora optimizer", optimizer, mesh), None, lambda: _LoraOptimizerCalls(optimizer, mesh))
    self.model, self.optimizer, self.cfg = calls.model, optimizer, cfg  # the model without remat
    self.groups, self.resident = lora_groups(num_layers, cfg)
    # Each group's first layer, on the device once (replicated): the calls take it as an argument, not a constant.
    self._starts = self.place.to_device([np.int32(start) for start, _ in self.groups])
    self.base = None  # {"outer": on the device, "groups": [group g's base layers, on the device or pinned host]}
    (self._embed, self._forward, self._tail_forward, self._head, self._tail_backward, self._backward,
     self._last_group_loss, self._hold, self._init_base_layers, self._init_outer, self._init_adapters) = (
        calls.embed, calls.forward, calls.tail_forward, calls.head, calls.tail_backward, calls.backward,
        calls.last_group_loss, calls.hold, calls.init_base_layers, calls.init_outer, calls.init_adapters)
    self._update, self._init_opt = updates.update, updates.init
    start, stop = self.groups[-1]
    self._layer_indices = self.place.to_device([np.int32(i) for i in range(stop - start)])
    self._zeros = self.place.zero_slots

  def _last_group(self, base, stack, start, outer, x, targets, weights, inv_total, grads):
    """One sub-batch through the last group, the head and back (LoraCalls.last_group): a call per layer forward,
    keeping each layer's residuals, the head's call, a call per layer backward, freeing them."""
    kept = []
    for layer in self._layer_indices:
      x, residuals = self._tail_forward(base, stack, start, layer, x)
      kept.append(residuals)
    loss, dy = self._head(outer, x, targets, weights, inv_total)
    for layer in reversed(self._layer_indices):
      dy, grads = self._tail_backward(base, stack, start, layer, kept.pop(), dy, grads)
    return loss, dy, grads

  @property
  def calls(self) -> "LoraCalls":
    """The step's jitted calls: the plan sizes them (compiled memory analysis, sljax.lora.plan); their compiled FLOPs
    are what lora_flops_per_token counts (tests/test_lora.py)."""
    return LoraCalls(forward=self._forward, last_group=self._last_group, backward=self._backward, zeros=self._zeros,
                     hold=self._hold, tail_forward=self._tail_forward, head=self._head,
                     tail_backward=self._tail_backward)

  # ---- the frozen base -----------------------------------------------------------------------------------------

  def _home(self, g: int, tree):
    return self.place.to_device(tree) if self.resident[g] else self.place.to_host(tree)

  def init_base(self, key: jax.Array):
    """A random base (the base model's init, one group at a time), for benchmarks."""
    outer_key, layers_key = jax.random.split(key)
    keys = jax.random.split(layers_key, self.model.cfg.num_layers)
    self.base = {"outer": self._init_outer(outer_key),
                 "groups": [self._group_base(g, lambda a, b: self._init_base_layers(keys[a:b]))
                            for g in range(len(self.groups))]}

  def load_base(self, params):
    """The base from full base-model params ({"outer", "layers"}, numpy or jax) or a reader with outer() and
    layers(start, stop) (models.hf.HFWeights), read one group at a time straight to its home (a quantized base:
    cast and quantized on the device a group at a time)."""
    reader = params_reader(params)
    cast = lambda tree: jax.tree.map(lambda x, dtype: np.asarray(x).astype(dtype, copy=False), tree,
                                     layer_compute_dtypes(self.model.base, tree))
    hold = (lambda tree: self._hold(cast(tree))) if self.model.lora.base_bits else cast
    self.base = {"outer": self.place.to_device(jax.tree.map(np.asarray, reader.outer())),
                 "groups": [self._group_base(g, lambda a, b: hold(reader.layers(a, b)))
                            for g in range(len(self.groups))]}

  def _group_base(self, g: int, layers):
    """Group g's base at its home from layers(a, b), base layers [a, b) (numpy, or held on the device). A group on
    the device that holds several layers (the tail: up to the whole model) is made a layer at a time into its own
    buffers: made whole, one call would hold the group in bf16 and its compression's scratch (a llama70b tail of 80
    int4 layers: a 121 GiB call, where the layers held take 33)."""
    start, stop = self.groups[g]
    if not self.resident[g] or stop - start == 1:
      return self._home(g, layers(start, stop))
    group = None
    for i in range(start, stop):
      layer = self.place.to_device(layers(i, i + 1))
      if group is None:
        group = jax.tree.map(lambda x: jnp.zeros((stop - start, *x.shape[1:]), x.dtype, device=x.sharding), layer)
      group = _write_layer(group, layer, i - start)
    return group

  def base_params(self) -> dict:
    """The base as full-model params as the engine holds it (a quantized base's kernels as codes and scales), numpy
    (for tests and export)."""
    layers = [jax.tree.map(np.asarray, map_packed(lambda node: unpack_halves(node) if "halves" in node else node,
                                                  group)) for group in self.base["groups"]]
    return {"outer": jax.tree.map(np.asarray, self.base["outer"]),
            "layers": jax.tree.map(lambda *xs: np.concatenate(xs), *layers)}

  # ---- the trainable state -------------------------------------------------------------------------------------

  def init(self, key: jax.Array) -> dict:
    """Fresh adapters (LoraModel.init_adapters: the model starts as the base), their optimizer state, step 0."""
    adapters = self._init_adapters(key, stacked_layer_shapes(self.model.base, self.model.cfg.num_layers))
    return self.from_adapters(adapters)

  def from_adapters(self, adapters) -> dict:
    """State from adapters stacked over all layers (as LoraModel's params hold them, and as the state does)."""
    # Copied: the step donates the state, not the caller's arrays.
    adapters = self.place.to_device(jax.tree.map(lambda x: jnp.array(x, jnp.float32), adapters))
    return {"step": self.place.to_device(np.zeros((), np.int32)), "adapters": adapters,
            "opt": self._init_opt(adapters)}

  def adapters(self, state: dict) -> dict:
    """The adapters stacked over all layers, numpy."""
    return jax.tree.map(np.asarray, state["adapters"])

  def abstract(self, key: jax.Array) -> dict:
    """Shapes, dtypes and shardings of `init(key)` (everything on the device), allocating nothing."""
    sharding = self.place.device()
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        jax.eval_shape(self.init, key))

  def settle(self, state: dict) -> dict:
    return state  # nothing is ever deferred: the update runs at the end of each step

  # ---- the step ------------------------------------------------------------------------------------------------

  def _fetch(self, g: int):
    """Group g's base layers on the device: a resident group's are there; a streamed group's cross PCIe."""
    group = self.base["groups"][g]
    return group if self.resident[g] else self.place.to_device(group)

  def _stash(self, x):
    return self.place.to_host(x) if self.cfg.activations_on_host else x

  def _unstash(self, x):
    return self.place.to_device(x) if self.cfg.activations_on_host else x

  def _sub_batches(self, batch: dict):
    """(tokens, targets, loss weights) of each sub-batch, its rows split over every device, and 1 / the whole batch's
    weight (the loss is the weighted mean over the whole batch). Checks the batch."""
    n = self.cfg.sub_batches
    check_batch(check_training_batch(batch, self.model.cfg), n, self.place.mesh)
    tokens, targets, loss_weights = (
        [self.place.to_device(part, PER_DEVICE) for part in np.split(np.asarray(batch[key]), n)]
        for key in ("inputs", "targets", "weights"))
    inv_total = np.float32(1) / loss_denominator(np.sum(np.asarray(batch["weights"], np.float32), dtype=np.float32))
    return tokens, targets, loss_weights, inv_total

  def step(self, state: dict, batch: dict) -> tuple[dict, jax.Array]:
    """One optimizer step of the adapters on `batch` ({"inputs", "targets", "weights"}: [B, S] numpy, B = N x b).
    Returns (the new state, the loss: the weighted mean over the whole batch; NaN when the step was skipped for a
    non-finite loss or gradient, and then the state is unchanged). Consumes `state`."""
    if self.base is None:
      raise ValueError("the engine has no base: call load_base(params) or init_base(key) first")
    n = self.cfg.sub_batches
    tokens, targets, loss_weights, inv_total = self._sub_batches(batch)
    outer, adapters, starts, last = self.base["outer"], state["adapters"], self._starts, len(self.groups) - 1
    # The host stays one group ahead of the device (and starts a step once the last one is done), so the device
    # holds the streamed groups' weights (sljax.lora.plan.STREAMED_IN_FLIGHT) and the calls' buffers the plan counts,
    # not those of every group dispatched.
    jax.block_until_ready(state["step"])
    pace = InFlight(1)
    # Each streamed group crosses PCIe once forward and once backward; the last group's weights serve both.
    stream = prefetch([*range(last + 1), *range(last - 1, -1, -1)], self._fetch)

    level = [self._embed(outer, tokens[s]) for s in range(n)]
    boundaries = []
    for g in range(last):
      w = next(stream)
      boundaries.append([self._stash(x) for x in level])
      level = [self._forward(w, adapters, starts[g], x) for x in level]
      pace.add(level[-1])

    w, grads, losses, cotangents = next(stream), self._zeros(adapters), [], []
    for s, x in enumerate(level):
      loss, dx, grads = self._last_group(w, adapters, starts[last], outer, x, targets[s], loss_weights[s], inv_total,
                                         grads)
      losses.append(loss)
      cotangents.append(dx)
    pace.add(cotangents[-1])
    del level

    inputs = backward_inputs(boundaries, self._unstash)  # each group's first input fetched behind the group before
    for g in range(last - 1, -1, -1):
      w, dxs = next(stream), []
      for dy in cotangents:
        dx, grads = self._backward(w, adapters, starts[g], next(inputs), dy, grads)
        dxs.append(dx)
      pace.add(dxs[-1])
      cotangents = dxs
    del cotangents

    grads = self.place.reduce(grads, sharded=False)  # the step's one all-reduce of the adapters' gradient
    loss = self.place.reduce(sum(losses), sharded=False)
    new_adapters, new_opt, ok = self._update(adapters, state["opt"], grads, loss)
    return ({"step": state["step"] + ok.astype(jnp.int32), "adapters": new_adapters, "opt": new_opt},
            jnp.where(ok, loss, jnp.nan))

  def eval_loss(self, state: dict, batch: dict) -> jax.Array:
    """The loss of `batch` under the base and the state's adapters (the LoraModel's loss), forward only, in the
    step's order and pace: each streamed group fetched once, every sub-batch through it. Reads `state` and changes
    nothing."""
    if self.base is None:
      raise ValueError("the engine has no base: call load_base(params) or init_base(key) first")
    n = self.cfg.sub_batches
    tokens, targets, loss_weights, inv_total = self._sub_batches(batch)
    outer, adapters, starts, last = self.base["outer"], state["adapters"], self._starts, len(self.groups) - 1
    jax.block_until_ready(state["step"])  # as the step: the device holds one pass's buffers at a time
    pace, stream = InFlight(1), prefetch(range(last + 1), self._fetch)
    level = [self._embed(outer, tokens[s]) for s in range(n)]
    for g in range(last):
      w = next(stream)
      level = [self._forward(w, adapters, starts[g], x) for x in level]
      pace.add(level[-1])
    w = next(stream)
    return self.place.reduce(sum(self._last_group_loss(w, adapters, starts[last], outer, x, targets[s],
                                                       loss_weights[s], inv_total) for s, x in enumerate(level)),
                             sharded=False)


class LoraCalls(NamedTuple):
  """Pieces of `LoraEngine.step`; x, dy: one sub-batch's hidden states; base: one group's; stack: the adapters stacked
  over all layers, start: the group's first layer (int32), grads: the stack's gradient accumulators."""

  forward: Callable  # (base, stack, start, x) -> y: a group's forward (every group but the last)
  # (base, stack, start, outer, x, targets, weights, 1 / total weight, grads) -> (this device's part of the loss, one
  # slot per device; dx; grads): the calls tail_forward (each layer), head, tail_backward (each layer)
  last_group: Callable
  backward: Callable  # (base, stack, start, x, dy, grads) -> (dx, grads): recompute + backward of a group
  zeros: Callable  # the stack -> its fp32 gradient accumulators, one slot per device (Placement.zero_slots)
  hold: Callable  # stacked base layers -> the same as the engine holds them (held_base)
  # The last group's calls; layer: int32, within the group (its adapters are the stack's at start + layer).
  tail_forward: Callable  # (base, stack, start, layer, x) -> (y, sljax.schedule.Residuals); donates x
  head: Callable  # (outer, h, targets, weights, 1 / total weight) -> (the loss's part, dh); donates h
  tail_backward: Callable  # (base, stack, start, layer, residuals, dy, grads) -> (dx, grads); donates dy, grads
