"""The SpeedLoader step: layer-major, sub-batched training with weights, activations and optimizer state offloaded.

One step, top to bottom (see `Engine.step`):

  embed every sub-batch                                          -> h[0][s] on the device
  for each group g but the last: fetch W_g once; stash h[g][s] to host; run every sub-batch -> h[g+1][s]
  last group:  per sub-batch: each layer's forward (a call per layer, keeping its residuals); head + loss and its
               backward; each layer's backward (a call per layer, freeing its residuals)  -> dh[G-1][s]
  for each group g, last-but-one down to 0: fetch W_g once; fetch the stashed h[g][s] back; recompute + backward
               every sub-batch, accumulating dW_g on the device -> dh[g][s]; update group g (its state streams in
               and out while the next group computes)
  embedding backward per sub-batch; update the embeddings and head

Only the groups before the last recompute their forward. The last group may be a longer tail (`tail_layers`): where
the device has room for its residuals (one sub-batch's, through all its layers), fewer layers are recomputed, and a
tail of every layer recomputes nothing. Its residuals are the outputs of its per-layer forward calls, each layer's
its own buffers (`Residuals`), not the scratch of one call: XLA makes a call's scratch one allocation, and llama13b's
12-layer tail at 8 x 2048 rows asked the H200 for 65.75 GiB of it in one piece, which it did not have at step 2
(beside 73.6 GiB in use, 14 GiB of it the tail's parked gradient, then held by mistake: see sljax.memory.prefetch).

With clipping (grad_clip_norm > 0) no group can be updated before the global norm is known, after the whole
backward: each group's gradient is parked instead (on the device or, for a host group, in pinned host memory) and
the next step's forward updates group g just before it runs group g, taking W_g from the new master weights; its
state comes to the device STATE_LEAD groups ahead (`Engine.settle` applies them all at once, for a checkpoint).

Groups whose state lives in host memory are spread among the device groups (`state_on_device`), so that their
update traffic is spread over the pass that carries it. The loop is plain Python that dispatches jitted calls
asynchronously; every transfer is issued ahead of its use (`sljax.memory.prefetch`), so copies run while the
previous item computes. "Ahead" counts in calls, not time: XLA's GPU client starts a copy into device memory only
once every call issued before it has run (its allocator is ordered with the compute stream), however early the
host issued it. It waits for the device only to bound the host groups' state there (`Engine._admit`).

Over a mesh (sljax.mesh: axes data x fsdp, d x f = n devices) every sub-batch is split over all n devices, and each
group's weights, master weights and optimizer state are split over fsdp (each device's pinned host memory holds its
shard). Per group and step: the fetch of W_g's shards is followed by ONE all-gather (both part of the prefetch, so
they overlap the previous group); the group's sub-batch calls run on each device's own rows with no collective,
accumulating the gradient in a per-device slot; after the last sub-batch ONE reduce-scatter over fsdp (+ all-reduce
of the shard over data) leaves each device its gradient shard, and the optimizer updates the shards. Bytes each
device sends per step, with ring collectives (W_g: group g's weights in the compute dtype; P_g: its params in fp32;
O: embeddings + head in fp32):

  weight all-gathers   (f-1)/f (2 sum_g W_g - W_last)      forward and backward, the last group's once
  gradients            sum_g ((f-1)/f + 2 (d-1)/(d f)) P_g  reduce-scatter over fsdp, all-reduce over data
  embeddings + head    2 (n-1)/n (O + 4 bytes)               all-reduce of their gradient and the loss, once

A leaf that no dimension divisible by f has stays whole (no gather; a full all-reduce of its gradient); clipping
adds a 4-byte all-reduce of each group's norm. Placement.moved["between_devices"] counts these, summed over the
devices. PCIe traffic per device is the single-device schedule's, for its shards and its rows.
"""

import collections
import dataclasses
import functools
import weakref
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.common import check_model, layer_compute_dtypes, loss_denominator, params_reader
from sljax.memory import DEVICE, HOST, InFlight, Placement, accumulate, prefetch
from sljax.mesh import PER_DEVICE, REPLICATED, check_batch
from sljax.optim import check_per_parameter
from sljax.sizes import model_sizes


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  sub_batches: int = 1  # N: the effective batch is split into N sub-batches that share each weight fetch
  live_layers: int = 1  # layers per group: the weights on the device at once (twice that while prefetching)
  grad_clip_norm: float = 0.0  # > 0: clip by the global norm over all params (exact: updates wait for all grads)
  activations_on_host: bool = True  # stash group-boundary hidden states in pinned host memory for the backward pass
  int8_exchange: bool = False  # stash them as int8 with one scale per row: half the bytes of bf16, not exact
  device_state_groups: int = 0  # groups whose master weights + optimizer state stay on device (see state_on_device)
  # > 0: the last group is the last tail_layers layers (the others form groups of live_layers). The last group runs
  # forward, head and backward for one sub-batch at a time with its residuals kept, so its layers are not recomputed:
  # a tail of every layer is a step with no recompute at all. 0: the last group is the last of the live_layers groups.
  tail_layers: int = 0
  # With clipping: the dtype each group's gradient waits in for the global norm, until the next step's forward
  # applies its update. bfloat16 halves what waits (at llama13b, 48 GiB of fp32 gradients) and rounds each gradient
  # once (inexact); the norm is still the fp32 gradients'.
  parked_grads_dtype: str = "float32"

  @property
  def parked_bytes_per_param(self) -> int:
    """Bytes a parked gradient holds per parameter: 0 without clipping, which parks nothing."""
    return jnp.dtype(self.parked_grads_dtype).itemsize if self.grad_clip_norm > 0 else 0

  def bounds(self, num_layers: int) -> list[tuple[int, int]]:
    """[start, stop) of each layer group of a model of num_layers layers: groups of live_layers (the last may be
    shorter), then a tail group of the last tail_layers layers when tail_layers > 0."""
    head = num_layers - self.tail_layers
    return ([(a, min(a + self.live_layers, head)) for a in range(0, head, self.live_layers)]
            + ([(head, num_layers)] if self.tail_layers else []))


PARKED_GRADS_DTYPES = ("float32", "bfloat16")

# Replaced host buffers are freed this many retirements (about two layer groups) after their last copy was issued.
RETIRE_LAG = 4
# Host groups whose state may be on the device for an update at once: the one being written back while the next
# arrives (with clipping, counting those brought in ahead of their updates, with their parked gradients, until the
# updates have run). Python dispatches far ahead of the device, so without this bound every host group's state would
# be brought in at once, more than the device holds for llama13b.
UPDATES_IN_FLIGHT = 2
# With clipped updates parked, a group's state (and parked gradient) is brought in this many groups before its
# forward: one group's forward (4 x 16 ms for llama13b) is shorter than a host group's 4.6 GB copy (86 ms), so one
# group ahead would leave the GPU idle before each host group.
STATE_LEAD = 3


def state_on_device(groups: int, device_groups: int) -> list[bool]:
  """Which groups keep their state on the device: the host groups spread evenly among them, never the first or the
  last while a device group is left for it, so that each host group's update traffic (its state in and out, once per
  step) overlaps the compute of the device groups around it instead of piling up at one end of the pass."""
  host = groups - max(0, min(device_groups, groups))
  on_host = {(i + 1) * groups // (host + 1) for i in range(host)} if host < groups else set(range(groups))
  return [g not in on_host for g in range(groups)]


def in_flight_bytes(sizes, cfg: "EngineConfig", sub_batch_rows: int, seq_len: int, state_per_layer: int,
                    outer_opt_bytes: int, fsdp: int = 1, host_state: bool = True) -> dict[str, int]:
  """What `Engine.step` keeps on each device besides the groups' resident state, parked gradients and stash, by kind:
  the schedule's own account of its footprint, which the plan (sljax.plan) adds the compiled calls' scratch to.
  sizes: sljax.sizes.ModelSizes; state_per_layer: one layer's master weights + optimizer state on this device;
  outer_opt_bytes: the embeddings' and head's optimizer state, whole;
  host_state: some group's state lives in host memory (else no state moves: updates donate it in place)."""
  bounds = cfg.bounds(sizes.num_layers)
  groups, last_layers, live = len(bounds), bounds[-1][1] - bounds[-1][0], cfg.live_layers
  weights_per_group = live * sizes.layer_weight_bytes  # gathered whole on every device while the group runs
  state_per_group = live * state_per_layer
  parked = live * sizes.layer_params * cfg.parked_bytes_per_param // fsdp
  grads = lambda layers: layers * sizes.layer_params * 4  # a group's fp32 gradient, whole
  footprint = {
      # Master weights, moments and the reduced gradient split over fsdp; under fsdp also the whole weights (gathered
      # per step) and the per-device gradient accumulator.
      "embeddings+head (params, moments, grads)": int(
          (sizes.outer_master_bytes + outer_opt_bytes + sizes.outer_params * 4) / fsdp
          + (sizes.outer_master_bytes + sizes.outer_params * 4 if fsdp > 1 else 0)),
      # The running group's and the next one's (the last group's while the first backward group's arrive).
      "group weights (2 in flight)": max(2 * weights_per_group,
                                         last_layers * sizes.layer_weight_bytes + weights_per_group * (groups > 1))
      + (weights_per_group // fsdp if fsdp > 1 else 0),
      # In backward one group's gradients accumulate (whole, on every device) while the next group's wait, reduced to
      # this device's shard, for its deferred update: the pairs of neighbours, so a long last group counts once
      # (nothing waits while it accumulates, and it waits beside a group of live layers).
      "group grads (2)": max(grads(last_layers), grads(live) + grads(last_layers) // fsdp if groups > 1 else 0,
                             grads(live) + grads(live) // fsdp if groups > 2 else 0),
  }
  if host_state:
    # A host group's deferred update holds its state and writes the new state while the next group's arrives; the
    # engine lets UPDATES_IN_FLIGHT host groups' state (with clipping, and their parked gradients) be on the device.
    footprint["group state in update (3)"] = max(3 * state_per_group, UPDATES_IN_FLIGHT * (state_per_group + parked))
  # A group's inputs, outputs and gradients, for every sub-batch.
  footprint["activations in flight"] = 3 * cfg.sub_batches * sizes.activation_bytes(sub_batch_rows, seq_len)
  return footprint


def step_peak_bytes(last_group_peak: int, backward_peak: int, parked_on_device: int) -> int:
  """The most device bytes that the compiled calls' scratch, the last group's residuals and the gradients parked on
  the device (clipping) take together over `Engine.step`: the last group's calls run after the forward has applied
  every parked update and before the backward parks the new ones, so beside none of them; each other group's backward
  (recompute included) runs beside up to all of them, its residuals gone. last_group_peak: one sub-batch's residuals
  through the last group and the most scratch of its calls; backward_peak: XLA's temp bytes of one group's backward
  call (0: no such call)."""
  return max(last_group_peak, backward_peak + parked_on_device)


def retired_host_bytes(on_device: list[bool], state: list[int], weights: list[int], parked: list[int]) -> int:
  """The most pinned host bytes that replaced host buffers still hold while they wait RETIRE_LAG retirements to be
  freed (`Engine._retire`), beyond each group's one copy: a retired buffer counts once its replacement exists. Walks
  the retirements and replacements of a steady `Engine.step` in their order, over two steps (the lag carries over).
  Per group g: `state` its master weights + optimizer state, `weights` its compute copy (0 where it keeps none),
  `parked` its parked gradient (0 without clipping). A device group's retirements hold no host bytes, but they count
  towards the lag. A host group's parked gradient is dropped when it is taken to the device, so it leaves room in
  the parked gradients' bytes (counted whole beside these) until the backward parks a new one."""
  groups, last = len(on_device), len(on_device) - 1
  sizes = {"state": state, "weights": weights, "parked": parked}
  events = []  # ("retire" | "replace" | "taken", parts); a part is (what, group)
  retire = lambda *parts: events.append(("retire", [p for p in parts if not on_device[p[1]]]))
  replace = lambda *parts: events.append(("replace", parts))
  if not any(parked):
    # The last group's update brings its state in; then each group's update, issued behind the next group's first
    # backward call, retires the old compute copy and makes the new state, and that next group's state comes in.
    retire(("state", last))
    for g in range(last, -1, -1):
      retire(("weights", g))
      replace(("state", g), ("weights", g))
      if g:
        retire(("state", g - 1))
  else:
    # The forward brings each group's state and parked gradient in STATE_LEAD groups ahead (and one further, as the
    # weight stream fetches one item ahead), a host group's only while fewer than UPDATES_IN_FLIGHT host groups are
    # there before their updates have run (`Engine._fetch`; their new states are taken to have left); each group's
    # update, before its forward, retires its old compute copy and makes the new state. The backward parks the new
    # gradients.
    taken, waiting = 0, set()  # waiting: host groups brought in whose updates have not run
    for g in range(groups + 1):
      while taken < min(g + STATE_LEAD, groups) and (
          taken == g or on_device[taken] or len(waiting) < UPDATES_IN_FLIGHT):
        retire(("state", taken))
        events.append(("taken", [] if on_device[taken] else [("parked", taken)]))  # dropped: freed once it has come
        waiting |= set() if on_device[taken] else {taken}
        taken += 1
      if g:  # group g - 1's update, issued once group g's fetch is (the weight stream fetches one item ahead)
        retire(("weights", g - 1))
        replace(("state", g - 1), ("weights", g - 1))
        waiting.discard(g - 1)
    for g in range(last, -1, -1):
      replace(("parked", g))
  alive, most = collections.deque(maxlen=RETIRE_LAG), 0  # retired entries: {part: replaced yet}
  gone = set()  # parked gradients taken to the device and not parked again yet: room in what the plan counts
  for i, (kind, parts) in enumerate(events * 2):
    if kind == "retire":
      alive.append(dict.fromkeys(parts, False))
    elif kind == "taken":
      gone |= set(parts)
    else:
      for entry in alive:
        entry.update({part: True for part in parts if part in entry})
      gone -= set(parts)
    if i >= len(events):  # the second step: steady
      held = sum(sizes[what][g] for entry in alive for (what, g), done in entry.items() if done)
      most = max(most, held - sum(sizes[what][g] for what, g in gone))
  return most


def backward_inputs(boundaries: list, unstash: Callable) -> Iterator:
  """The stashed group inputs back on the device in the backward's order (groups last to first, each group's
  sub-batches in order), each fetched one sub-batch ahead across the groups: a group's first input is issued before
  the previous group's last backward call. A copy into device memory starts only once every call issued before it
  has run (XLA's GPU client orders its allocations with the compute stream), so a group's first input fetched at the
  group's own turn would leave the GPU idle while it crosses. Pops each group's stash from `boundaries` as it goes."""
  return prefetch((x for _ in range(len(boundaries)) for x in boundaries.pop()), unstash)


def _alive(refs: list) -> list:
  """The arrays behind weak references that are still held and not deleted."""
  return [x for x in (ref() for ref in refs) if x is not None and not x.is_deleted()]


def quantize_rows(x):
  """int8 with one fp32 scale per row (last axis): |dequantize_rows(*quantize_rows(x)) - x| <= max|row| / 254."""
  scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 127.0
  q = jnp.round(x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0))
  return q.astype(jnp.int8), scale


def dequantize_rows(q, scale, dtype):
  return (q.astype(jnp.float32) * scale).astype(dtype)


BATCH_KEYS = ("inputs", "targets", "weights")


def check_training_batch(batch, cfg) -> int:
  """The rows of a training batch ({"inputs", "targets": int [B, S] token ids, "weights": [B, S] >= 0}); ValueError
  naming the key when one is missing, of another shape, dtype or rank, or holds a token id outside the vocabulary
  (cfg.vocab_size, where the model's config has one) or more positions than cfg.max_positions."""
  if not hasattr(batch, "keys"):
    raise ValueError(f"a batch is a dict of {', '.join(BATCH_KEYS)}, got {type(batch).__name__}")
  missing = [key for key in BATCH_KEYS if key not in batch]
  if missing:
    raise ValueError(f"the batch has no {', '.join(map(repr, missing))} (it needs {', '.join(BATCH_KEYS)}: [B, S] "
                     f"arrays), got keys {', '.join(map(repr, batch.keys()))}")
  arrays = {key: np.asarray(batch[key]) for key in BATCH_KEYS}
  shape = arrays["inputs"].shape
  for key, x in arrays.items():
    if x.ndim != 2 or x.shape != shape or 0 in x.shape:
      raise ValueError(f"batch[{key!r}] has shape {x.shape}; every array of a batch is [B, S], the same for "
                       f"{', '.join(BATCH_KEYS)} (inputs: {shape})")
    kinds = "iu" if key != "weights" else "iufb"
    if x.dtype.kind not in kinds:
      raise ValueError(f"batch[{key!r}] has dtype {x.dtype}; "
                       + ("token ids are integers" if key != "weights" else "weights are numbers >= 0"))
  vocab, positions = getattr(cfg, "vocab_size", None), getattr(cfg, "max_positions", None)
  for key in ("inputs", "targets"):
    low, high = int(arrays[key].min()), int(arrays[key].max())
    if low < 0 or (vocab is not None and high >= vocab):
      raise ValueError(f"batch[{key!r}] holds token id {low if low < 0 else high}, outside the model's vocabulary"
                       + (f" 0..{vocab - 1}" if vocab is not None else " (ids are >= 0)"))
  if (arrays["weights"] < 0).any():  # NaN passes: a non-finite loss is a bad step, skipped, not a bad request
    raise ValueError(f"batch['weights'] holds {arrays['weights'].min()}; weights are >= 0")
  if positions is not None and shape[1] > positions:
    raise ValueError(f"the batch's {shape[1]} positions are more than the model's max_positions {positions}")
  return shape[0]


@jax.tree_util.register_pytree_node_class
class Residuals:
  """What a layer's backward needs from its forward (a `jax.vjp`'s residuals) as outputs of the forward's call, each
  its own device buffer with a slot per device (a leading axis laid out `PER_DEVICE`), less the layer's weights (any
  residual that is a leaf of the call's weight trees): the backward takes those again rather than the forward
  returning copies. `layout` (static): the vjp's tree structure and, per residual, which kept array (>= 0) or weight
  leaf (-1 - j, counting the trees' leaves in order) it is."""

  def __init__(self, kept: list, layout: tuple):
    self.kept, self.layout = kept, layout

  @classmethod
  def of(cls, vjp, *weights) -> "Residuals":
    """The residuals of `vjp` (a `jax.vjp` function traced on `weights`, trees of one layer's, inside
    `Placement.local`)."""
    leaves, structure = jax.tree.flatten(vjp)
    weight_leaf = {id(w): j for j, w in enumerate(jax.tree.leaves(weights))}
    kept, sources = [], []
    for leaf in leaves:
      if id(leaf) in weight_leaf:
        sources.append(-1 - weight_leaf[id(leaf)])
      else:
        sources.append(len(kept))
        kept.append(leaf[None])
    return cls(kept, (structure, tuple(sources)))

  def vjp(self, *weights):
    """The vjp function again, its weights' residuals taken from `weights` (the same layer's, as `of` took them)."""
    structure, sources = self.layout
    weight_leaves = jax.tree.leaves(weights)
    return structure.unflatten([self.kept[i][0] if i >= 0 else weight_leaves[-1 - i] for i in sources])

  def tree_flatten(self):
    return tuple(self.kept), self.layout

  @classmethod
  def tree_unflatten(cls, layout, kept):
    return cls(list(kept), layout)


def _one_layer(stacked, layer):
  """Layer `layer` (traced) of stacked layer params, stacked as a group of one."""
  return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, layer, 1), stacked)


def _accumulate_layer(acc, grads, layer, first, layers: int):
  """`accumulate` for one layer of a stacked group's accumulator: its slot at `layer` becomes grads (first, a first
  sub-batch: as accumulate(None, ...) makes it) or gains them, in place; acc None: the accumulator is made here."""

  def add(slot, grad):
    grad = grad.astype(jnp.float32)[None]
    if slot is None:
      slot = jnp.zeros((1, layers, *grad.shape[2:]), jnp.float32)
    old = jax.lax.dynamic_slice_in_dim(slot, layer, 1, axis=1)
    return jax.lax.dynamic_update_slice_in_dim(slot, jnp.where(first, grad, old + grad), layer, axis=1)

  if acc is None:
    return jax.tree.map(lambda g: add(None, g), grads)
  return jax.tree.map(add, acc, grads)


def _clip(grads, norm, max_norm):
  """optax.clip_by_global_norm's arithmetic, with the norm computed over all groups beforehand."""
  return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm), grads)


def cast_layers(stacked, layer_dtypes):
  """Stacked layer params (a group's master weights) in the dtypes `layer_dtypes` the layers run in."""
  return jax.tree.map(lambda x, dtype: x.astype(dtype), stacked, layer_dtypes)


# The jitted calls of the models (and optimizers) engines were made for lately, by model and mesh: a new engine of
# the same model (another split or placement, the same step again, the planner sizing the calls, another object of
# the same config) finds them traced and compiled. They hold their models alive, so only the latest few.
SHARED_CALLS = 8
_SHARED = collections.OrderedDict()  # key -> (the model's cfg when made, the calls)


def shared_calls(key: tuple, cfg, make: Callable):
  """make(), or what it made for the same key while the key's model had the same (or an equal) cfg."""
  try:
    hit = _SHARED.get(key)
  except TypeError:  # an unhashable model or optimizer: its engine's own calls
    return make()
  if hit is None or (hit[0] is not cfg and hit[0] != cfg):
    hit = _SHARED[key] = (cfg, make())
    while len(_SHARED) > SHARED_CALLS:
      _SHARED.popitem(last=False)
  _SHARED.move_to_end(key)
  return hit[1]


@jax.jit
def _sq_norm(tree):
  return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


@functools.cache
def _narrowing(dtype: str) -> Callable:
  """A tree's leaves cast to `dtype`, donated; float32 (the gradients' own dtype): unchanged."""
  if jnp.dtype(dtype) == jnp.float32:
    return lambda tree: tree
  return jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree), donate_argnums=0)


class _ModelCalls:
  """An engine's jitted calls of its model (run without remat) on a mesh: per-sub-batch calls see the whole weights
  and this device's rows, outputs are rows or per-device slots (Placement.local)."""

  def __init__(self, model, sizes, mesh):
    self.model = model = model.without_remat() if getattr(model.cfg, "remat", False) else model
    self.layer_dtypes = layer_compute_dtypes(model, sizes.layer_shapes)
    place = Placement(mesh)
    local, whole, rows = place.local, REPLICATED, PER_DEVICE
    self.embed = local(lambda outer, tokens: model.embed(outer, tokens), (whole, rows), rows)
    self.forward = local(model.layers, (whole, rows), rows)  # its input is still being stashed: not donated
    # The last group, one layer a call: (weights, layer, x) -> (y, the layer's residuals); (outer, h, targets,
    # loss_weights, inv_total, outer_grads) -> (loss, dh, outer_grads); (weights, layer, first, residuals, dy, grads)
    # -> (dx, grads). Each donates the activation it replaces; the residuals are freed as their backward runs.
    self.tail_forward = local(self._tail_forward_fn, (whole, whole, rows), rows, donate=(2,))
    self.head = local(self._head_fn, (whole, rows, rows, rows, whole, rows), rows, donate=(1, 5))
    self.tail_backward = local(self._tail_backward_fn, (whole, whole, whole, rows, rows, rows), rows, donate=(4, 5))
    self.backward = local(self._backward_fn, (whole, rows, rows, rows), rows, donate=(1, 3))
    self.embed_backward = local(self._embed_backward_fn, (whole, rows, rows, rows), rows, donate=(3,))
    self.last_group_loss = local(self._last_group_loss_fn, (whole, whole, rows, rows, rows, whole), rows)
    self.quantize = local(quantize_rows, (rows,), (rows, rows))
    self.dequantize = local(functools.partial(dequantize_rows, dtype=jnp.dtype(model.cfg.dtype)), (rows, rows), rows)
    self.cast = jax.jit(functools.partial(cast_layers, layer_dtypes=self.layer_dtypes))
    # State is created in its final layout: no process ever holds more than its own devices' parts.
    sharded = lambda tree: place.shardings(tree, DEVICE, place.state_spec)
    self.init_layers = jax.jit(model.init_layers, out_shardings=sharded(sizes.layer_shapes))
    # Embeddings + head: master weights split over fsdp like a group's (gathered whole per step).
    self.init_outer = jax.jit(model.init_outer, out_shardings=sharded(sizes.outer_shapes))

  def _tail_forward_fn(self, weights, layer, x):
    one = _one_layer(weights, layer)
    y, vjp = jax.vjp(self.model.layers, one, x)
    return y, Residuals.of(vjp, one)

  def _head_fn(self, outer, h, targets, loss_weights, inv_total, outer_grads):
    def loss_fn(outer, h):
      return self.model.head_loss(outer, h, targets, loss_weights) * inv_total

    loss, (d_outer, dh) = jax.value_and_grad(loss_fn, argnums=(0, 1))(outer, h)
    return loss[None], dh, accumulate(outer_grads, d_outer)  # loss: this device's rows' part

  def _tail_backward_fn(self, weights, layer, first, residuals, dy, grads):
    d_weights, dx = residuals.vjp(_one_layer(weights, layer))(dy)
    return dx, _accumulate_layer(grads, d_weights, layer, first, jax.tree.leaves(weights)[0].shape[0])

  def _last_group_loss_fn(self, weights, outer, x, targets, loss_weights, inv_total):
    h = self.model.layers(weights, x)
    return (self.model.head_loss(outer, h, targets, loss_weights) * inv_total)[None]  # this device's rows' part

  def _backward_fn(self, weights, x, dy, grads):
    _, vjp = jax.vjp(self.model.layers, weights, x)
    d_weights, dx = vjp(dy)
    return dx, accumulate(grads, d_weights)

  def _embed_backward_fn(self, outer, tokens, dh, outer_grads):
    _, vjp = jax.vjp(lambda o: self.model.embed(o, tokens), outer)
    return accumulate(outer_grads, vjp(dh)[0])


class _OptimizerCalls:
  """An engine's jitted optimizer calls: its update (with the engine's clipping) and its state's init, in the
  layout of a model's state on a mesh."""

  def __init__(self, optimizer, grad_clip_norm: float, sizes, mesh):
    self.optimizer, self.grad_clip_norm = optimizer, grad_clip_norm
    self.update = jax.jit(self._update_fn, donate_argnums=(0, 1))  # elementwise: runs on the shards
    self.updated_copy = jax.jit(self._update_fn)  # for params(): leaves the state it reads alone
    place = Placement(mesh)
    sharded = lambda tree: place.shardings(tree, DEVICE, place.state_spec)
    self.init_opt = jax.jit(optimizer.init, out_shardings=sharded(jax.eval_shape(optimizer.init, sizes.layer_shapes)))
    self.init_outer_opt = jax.jit(optimizer.init,
                                  out_shardings=sharded(jax.eval_shape(optimizer.init, sizes.outer_shapes)))

  def _update_fn(self, master, opt_state, grads, norm, ok):
    """The optimizer's update, or (ok false: a non-finite step) the state unchanged."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # a parked gradient may wait narrower
    if self.grad_clip_norm > 0:
      grads = _clip(grads, norm, self.grad_clip_norm)
    updates, new_opt_state = self.optimizer.update(grads, opt_state, master)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    return keep(optax.apply_updates(master, updates), master), keep(new_opt_state, opt_state)


class Engine:
  """Trains `model` (any models.common.TrainingModel) with `optimizer` layer-major.

  `optimizer` is applied group by group, so it must treat each parameter independently (AdamW, SGD, Lion, ...);
  global-norm clipping is the engine's own `grad_clip_norm`, computed exactly over all groups.

  Each layer leaf runs in the dtype the model gives it (`models.common.layer_compute_dtypes`: by default matmul
  kernels in cfg.dtype, vectors as stored), so a step computes what the model computes on its master weights. A model
  with cfg.remat runs without it (`without_remat()`): each group's backward already recomputes the group's forward.
  """

  def __init__(self, model, optimizer: optax.GradientTransformation, cfg: EngineConfig,
               placement: Placement | None = None):
    check_model(model)
    sizes = model_sizes(model)  # its params' shapes, read once per model object: a plan of the model read them too
    num_layers = model.cfg.num_layers
    if cfg.sub_batches < 1 or cfg.live_layers < 1:
      raise ValueError(f"sub_batches and live_layers must be >= 1, got {cfg.sub_batches} and {cfg.live_layers}")
    if not 0 <= cfg.tail_layers <= num_layers:
      raise ValueError(f"tail_layers must be in 0..{num_layers} (the model's layers), got {cfg.tail_layers}")
    if cfg.live_layers > num_layers:
      raise ValueError(f"live_layers must be at most the model's {num_layers} layers, got {cfg.live_layers}")
    if cfg.parked_grads_dtype not in PARKED_GRADS_DTYPES:
      raise ValueError(f"parked_grads_dtype must be one of {', '.join(PARKED_GRADS_DTYPES)}, got "
                       f"{cfg.parked_grads_dtype!r}")
    layer_shapes, outer_shapes = sizes.layer_shapes, sizes.outer_shapes
    check_per_parameter(optimizer, layer_shapes, outer_shapes)
    self.place = placement or Placement.single()
    # The jitted calls of this model on this mesh (and of this optimizer and clipping), shared by all its
    # engines: another engine of the model, or the planner sizing its calls, traces and compiles none of them again.
    # Models that compare by value (models.common.LayerMajorModel) share them by the model they run: one with remat
    # and its twin without, too (two new twins compare equal only where models compare by value).
    key = model
    if getattr(model.cfg, "remat", False) and model.without_remat() == model.without_remat():
      key = model.without_remat()
    calls = shared_calls(("model", key, self.place.mesh), key.cfg, lambda: _ModelCalls(model, sizes, self.place.mesh))
    updates = shared_calls(("optimizer", optimizer, cfg.grad_clip_norm, model, self.place.mesh), model.cfg,
                           lambda: _OptimizerCalls(optimizer, cfg.grad_clip_norm, sizes, self.place.mesh))
    model = calls.model  # without remat: per-layer remat inside a recomputed group would recompute twice
    self.model, self.optimizer, self.cfg = model, optimizer, cfg
    # Both hold weak references: a state the caller drops (for a restored one, say) is freed at once, not kept alive
    # in pinned memory by the engine's bookkeeping.
    self._retired = collections.deque()  # lists of replaced host buffers, oldest first (see _retire)
    # Host groups' new state as it leaves the device (see _admit); bounded, for callers of `calls.apply` that never
    # admit (the step always admits before it appends, so nothing is dropped unwaited).
    self._written_back = collections.deque(maxlen=UPDATES_IN_FLIGHT)
    self.groups = cfg.bounds(num_layers)
    self.state_on_device = state_on_device(len(self.groups), cfg.device_state_groups)
    self.compute_dtype = jnp.dtype(model.cfg.dtype)  # of the activations
    self.layer_dtypes = calls.layer_dtypes  # what each leaf of a group runs in
    # A host group keeps a copy in those dtypes, the one that crosses PCIe, when any leaf's differs from its master's.
    self.separate_weights = any(jax.tree.leaves(jax.tree.map(lambda x, d: x.dtype != d, layer_shapes,
                                                             self.layer_dtypes)))

    (self._embed, self._forward, self._tail_forward, self._head, self._tail_backward, self._backward,
     self._embed_backward, self._last_group_loss, self._quantize, self._dequantize, self._cast, self._init_layers,
     self._init_outer) = (calls.embed, calls.forward, calls.tail_forward, calls.head, calls.tail_backward,
                          calls.backward, calls.embed_backward, calls.last_group_loss, calls.quantize, calls.dequantize,
                          calls.cast, calls.init_layers, calls.init_outer)
    self._update, self._updated_copy, self._init_opt, self._init_outer_opt = (
        updates.update, updates.updated_copy, updates.init_opt, updates.init_outer_opt)
    # The calls' layer indices and first-sub-batch flags, on the device once: arguments, so one compile serves all.
    start, stop = self.groups[-1]
    self._layer_indices = self.place.to_device([np.int32(i) for i in range(stop - start)])
    self._first = self.place.to_device([np.bool_(False), np.bool_(True)])
    # Gradient accumulators: fp32 whatever the compute dtype, a slot per device (leading axis) so that no sub-batch
    # call communicates; placed like the step's outputs so nothing recompiles.
    self._zeros = self.place.zero_slots
    self._sq_norm = _sq_norm
    self._narrow = _narrowing(cfg.parked_grads_dtype)

  def _last_group(self, weights, outer, x, targets, loss_weights, inv_total, grads, outer_grads):
    """One sub-batch through the last group, the head and back (see Calls.last_group): one call per layer forward,
    keeping each layer's residuals in buffers of its own, the head's call, one call per layer backward."""
    first = self._first[grads is None]
    kept = []
    for layer in self._layer_indices:
      x, residuals = self._tail_forward(weights, layer, x)
      kept.append(residuals)
    loss, dy, outer_grads = self._head(outer, x, targets, loss_weights, inv_total, outer_grads)
    for layer in reversed(self._layer_indices):
      dy, grads = self._tail_backward(weights, layer, first, kept.pop(), dy, grads)  # frees that layer's residuals
    return loss, dy, grads, outer_grads

  def cast_layers(self, stacked):
    """Stacked layer params (a group's master weights) in the dtypes the layers run in."""
    return cast_layers(stacked, self.layer_dtypes)

  # ---- state ---------------------------------------------------------------------------------------------------

  def _home(self, g: int, tree):
    """Puts group g's master weights or optimizer state where the config keeps them, split over fsdp."""
    put = self.place.to_device if self.state_on_device[g] else self.place.to_host
    return put(tree, self.place.state_spec)

  def _make_group(self, g: int, master, opt_state=None) -> dict:
    """A group's state: fp32 master + optimizer state, and (host groups, low-precision compute) the compute-dtype
    copy that crosses to the device each step. A device group derives its compute weights from its master."""
    opt_state = self._init_opt(master) if opt_state is None else opt_state
    group = {"master": self._home(g, master), "opt": self._home(g, opt_state)}
    if self.separate_weights and not self.state_on_device[g]:
      group["weights"] = self.place.to_host(self._cast(master), self.place.state_spec)
    return group

  def _fetch_weights(self, group: dict):
    """Group weights, whole on every device: this device's shard crosses PCIe, then one all-gather over fsdp (of the
    cast to the layers' dtypes, for a group that keeps no separate compute copy)."""
    shards = self.place.to_device(group.get("weights", group["master"]))
    if self.separate_weights and "weights" not in group:
      shards = self._cast(shards)
    return self.place.gather(shards)

  def init(self, key: jax.Array) -> dict:
    """Random init, one group at a time on the device, so the whole model never has to fit there.

    Equal to `model.init(key)` laid out by `from_params`.
    """
    outer_key, layers_key = jax.random.split(key)
    layer_keys = jax.random.split(layers_key, self.model.cfg.num_layers)
    outer = self._init_outer(outer_key)
    groups = [self._make_group(g, self._init_layers(layer_keys[a:b])) for g, (a, b) in enumerate(self.groups)]
    return self._state(outer, groups)

  def from_params(self, params) -> dict:
    """Lays out full-model params as engine state: {"outer", "layers"} (on any device or numpy), or a reader with
    outer() and layers(start, stop) (models.hf.HFWeights), read one group at a time so that the whole model never
    has to be in host RAM. The same on every process."""
    reader = params_reader(params)
    copy = lambda tree, spec: self.place.to_device(jax.tree.map(np.array, tree), spec)  # not the caller's arrays
    groups = [self._make_group(g, copy(reader.layers(a, b), self.place.state_spec))
              for g, (a, b) in enumerate(self.groups)]
    return self._state(copy(reader.outer(), self.place.state_spec), groups)

  def abstract_state(self, key: jax.Array) -> dict:
    """Shapes, dtypes and shardings (memory kinds and mesh layout included) of `init(key)`, allocating nothing: a
    checkpoint written under any mesh restores into this engine's mesh."""
    shapes = jax.eval_shape(self.init, key)
    placed = lambda tree, kind, spec: jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        tree, self.place.shardings(tree, kind, spec))
    groups = [{name: placed(tree, DEVICE if self.state_on_device[g] and name != "weights" else HOST,
                            self.place.state_spec) for name, tree in group.items()}
              for g, group in enumerate(shapes["groups"])]
    split = lambda name: placed(shapes[name], DEVICE, self.place.state_spec)
    return {"step": placed(shapes["step"], DEVICE, REPLICATED), "outer": split("outer"),
            "outer_opt": split("outer_opt"), "groups": groups}

  def with_compute_copies(self, state: dict) -> dict:
    """`state` with each host group's compute copy ("weights") made from its master weights as `_make_group` makes
    it: what a restored checkpoint, which holds none, lacks."""
    groups = []
    for g, group in enumerate(state["groups"]):
      group = {name: value for name, value in group.items() if name != "weights"}
      if self.separate_weights and not self.state_on_device[g]:
        master = self.place.to_device(group["master"], self.place.state_spec)
        # Waited for: dispatched ahead, every host group's master would be on the device at once.
        group["weights"] = jax.block_until_ready(self.place.to_host(self._cast(master), self.place.state_spec))
      groups.append(group)
    return {**state, "groups": groups}

  def _state(self, outer, groups) -> dict:
    return {"step": self.place.to_device(np.zeros((), np.int32)), "outer": outer,
            "outer_opt": self._init_outer_opt(outer), "groups": groups}

  def params(self, state: dict) -> dict:
    """Full-model params, whole on every device (for tests and export; needs the whole model to fit there), with
    any parked update applied. New arrays the caller owns: a later `step(state, ...)`, which consumes `state`, leaves them alone."""
    parked, layers = state.get("parked"), []
    for g, group in enumerate(state["groups"]):
      master = self.place.to_device(group["master"])
      if parked is not None:  # the step's update, applied to copies
        master, _ = self._updated_copy(master, self.place.to_device(group["opt"]),
                                       self.place.to_device(parked["grads"][g]), parked["norm"], parked["ok"])
      layers.append(self.place.gather(master))
    params = {"outer": self.place.gather(state["outer"]),
              "layers": jax.tree.map(lambda *xs: jnp.concatenate(xs), *layers)}
    return jax.tree.map(jnp.copy, params)  # gather and concatenate return their input when there is nothing to do

  # ---- transfers -----------------------------------------------------------------------------------------------

  def _stash(self, x):
    """Keeps a group's input for the backward pass: in pinned host memory (as int8 rows if asked) or on device."""
    if not self.cfg.activations_on_host:
      return x
    return self.place.to_host(self._quantize(x) if self.cfg.int8_exchange else x)

  def _unstash(self, stashed):
    if not self.cfg.activations_on_host:
      return stashed
    moved = self.place.to_device(stashed)
    return self._dequantize(*moved) if self.cfg.int8_exchange else moved

  # ---- the step ------------------------------------------------------------------------------------------------

  def _sub_batches(self, batch: dict):
    """(tokens, targets, loss weights) of each sub-batch, its rows split over every device, and 1 / the whole batch's
    weight: each sub-batch's weighted sum times it, as models.common.LayerMajorModel.loss does. Checks the batch."""
    n = self.cfg.sub_batches
    check_batch(check_training_batch(batch, self.model.cfg), n, self.place.mesh)
    tokens, targets, loss_weights = (
        [self.place.to_device(part, PER_DEVICE) for part in np.split(np.asarray(batch[key]), n)]
        for key in ("inputs", "targets", "weights"))
    inv_total = np.float32(1) / loss_denominator(np.sum(np.asarray(batch["weights"], np.float32), dtype=np.float32))
    return tokens, targets, loss_weights, inv_total

  def step(self, state: dict, batch: dict) -> tuple[dict, jax.Array]:
    """One optimizer step on `batch` ({"inputs", "targets", "weights"}: [B, S] numpy arrays, B = N x b; weights
    >= 0). Returns (the new state, the loss: sum(weights x token losses) / sum(weights) over the whole batch, 0 when
    every weight is 0, NaN when the step was skipped).

    Consumes `state`: its device arrays are donated and its host buffers freed, so only the returned state may be
    used afterwards (take `params(state)` before stepping to keep a copy).

    With clipping, the layer groups' updates need the global gradient norm, known only after the whole backward. The
    returned state then holds them parked ("parked": each group's gradient and the norm), and the next step applies
    group g's just before its forward reads group g's weights, so their copies hide behind that forward. `settle`
    applies them at once (before a checkpoint); `params` sees them applied."""
    n = self.cfg.sub_batches
    tokens, targets, loss_weights, inv_total = self._sub_batches(batch)

    outer, groups, parked = self.place.gather(state["outer"]), state["groups"], state.get("parked")
    last = len(groups) - 1
    new_groups = list(groups)
    # Each group's weights cross to the device once forward, once backward; the last group's stay for both. A group
    # with a parked update instead brings its state (and parked gradient) in for the forward, and its updated
    # weights come from the device's new master weights.
    order = [(g, True) for g in range(last + 1)] + [(g, False) for g in range(last - 1, -1, -1)]
    stream = prefetch(order, lambda item: self._fetch(*item, new_groups, parked))
    forward_weights = lambda g: self._settle_group(g, next(stream), new_groups, parked)

    # Forward, layer-major. `level` holds the current group's input for every sub-batch on the device; a copy of
    # it is stashed (boundaries[g]) for the backward pass while the group computes.
    level = [self._embed(outer, tokens[s]) for s in range(n)]
    boundaries = []
    for g in range(last):
      w = forward_weights(g)
      boundaries.append([self._stash(x) for x in level])
      level = [self._forward(w, x) for x in level]

    # The last group: forward, head + loss and backward of one sub-batch at a time, its residuals kept between its
    # layers' calls (one sub-batch's at once); nothing to stash.
    clipping, parked_grads = self.cfg.grad_clip_norm > 0, [None] * len(groups)
    w = forward_weights(last)
    grads = outer_grads = None  # the first sub-batch's call makes the accumulators (see _add)
    losses, cotangents, incoming = [], [], None
    for s, x in enumerate(level):
      loss, dx, grads, outer_grads = self._last_group(
          w, outer, x, targets[s], loss_weights[s], inv_total, grads, outer_grads)
      losses.append(loss)
      cotangents.append(dx)
      # The update's state is queued behind the first sub-batch's work, so it never delays a sub-batch's inputs.
      incoming = incoming or (None if clipping else self._take_state(last, new_groups[last]))
    del level
    # The loss is known before any update: a non-finite step changes nothing (with clipping, nor does a non-finite
    # gradient, since every update then waits for the global norm).
    loss = self.place.reduce(sum(losses), sharded=False)
    ok = jnp.isfinite(loss)
    pending = (last, incoming, self.place.reduce(grads))  # the group's one reduce; its update is issued below

    # Backward through the other groups in reverse, recomputing each group's forward inside its vjp. The gradient
    # flowing between groups stays on the device; only the stashed inputs come back, in one stream over the groups
    # (see backward_inputs).
    inputs = backward_inputs(boundaries, self._unstash)
    for g in range(last - 1, -1, -1):
      w = next(stream)
      grads, dxs, incoming = None, [], None
      for s, dy in enumerate(cotangents):
        x = next(inputs)
        if s == 1 and not clipping:
          # This group's state, for its update, is issued before the second call, after the third call's input:
          # the next input copied behind it (3.2 GB at llama13b: more than one call's time) is needed two calls
          # later. Issued after the first call, the third call's input crossed behind it while the GPU waited.
          incoming = self._take_state(g, new_groups[g])
        dx, grads = self._backward(w, x, dy, grads)
        dxs.append(dx)
        if s == 0:
          # The group after this one is updated only now, so its state leaves the device behind this group's first
          # inputs, and this group's state comes in behind them: the copy streams carry both directions, and
          # otherwise each group's inputs would wait behind the previous group's outgoing state.
          self._finish_group(*pending, ok, new_groups, parked_grads)
      if n == 1 and not clipping:
        incoming = self._take_state(g, new_groups[g])  # behind the one call and the update before it
      cotangents = dxs
      pending = (g, incoming, self.place.reduce(grads))  # the group's one reduce
    self._finish_group(*pending, ok, new_groups, parked_grads)

    for s, dh in enumerate(cotangents):
      outer_grads = self._embed_backward(outer, tokens[s], dh, outer_grads)
    outer_grads = self.place.reduce(outer_grads)  # to the shards of the embeddings + head

    norm = jnp.zeros((), jnp.float32)
    if clipping:  # every gradient is known only now: the groups' updates wait for the next step (or `settle`)
      norm = jnp.sqrt(sum(sq for _, sq in parked_grads) + self._sq_norm(outer_grads))
      ok = ok & jnp.isfinite(norm)
    new_outer, new_outer_opt = self._update(state["outer"], state["outer_opt"], outer_grads, norm, ok)
    new_state = {"step": state["step"] + ok.astype(jnp.int32), "outer": new_outer, "outer_opt": new_outer_opt,
                 "groups": new_groups}
    if clipping:
      new_state["parked"] = {"grads": [grads for grads, _ in parked_grads], "norm": norm, "ok": ok}
    return new_state, jnp.where(ok, loss, jnp.nan)  # NaN tells the caller this step was skipped

  def settle(self, state: dict) -> dict:
    """`state` with the group updates its step parked (clipping) applied: what a checkpoint holds and what
    `abstract_state` describes. Consumes `state`, like `step`; a state with nothing parked comes back as it is."""
    parked = state.get("parked")
    if parked is None:
      return state
    groups = list(state["groups"])
    for g in range(len(groups)):
      self._settle_group(g, self._fetch(g, True, groups, parked), groups, parked)
    return {name: value for name, value in state.items() if name != "parked"} | {"groups": groups}

  def eval_loss(self, state: dict, batch: dict) -> jax.Array:
    """The loss of `batch` under the state's params, what `model.loss` gives (the same weighted mean over the whole
    batch), by a forward-only pass in the step's order: each group's weights fetched once, every sub-batch through
    them, the last group with the head. Reads `state` and changes nothing (a step after it is the step without it).
    A state holding parked updates is refused, since they are not in its weights yet: see `evaluate`."""
    if state.get("parked") is not None:
      raise ValueError("the state holds parked updates (clipping): evaluate engine.settle(state), or take "
                       "engine.evaluate(state, batch), which applies them")
    return self.evaluate(state, batch)[1]

  def evaluate(self, state: dict, batch: dict) -> tuple[dict, jax.Array]:
    """(`settle(state)`, `eval_loss` of `batch` on it) in one pass: each parked update is applied just before its
    group's forward, its state brought in ahead as the step's forward does, so that its copies overlap the eval's
    compute instead of adding to it. Consumes `state` when it holds parked updates, like `settle`; else reads it and
    returns it as it is."""
    n = self.cfg.sub_batches
    tokens, targets, loss_weights, inv_total = self._sub_batches(batch)
    outer, parked, groups = self.place.gather(state["outer"]), state.get("parked"), list(state["groups"])
    stream = prefetch(range(len(groups)), lambda g: self._fetch(g, True, groups, parked))
    weights = lambda g: self._settle_group(g, next(stream), groups, parked)
    # The host waits for the group before the one it issued last, so that no more weights are in flight than in the
    # step's forward (a call allocates its outputs when it is issued).
    pace, last = InFlight(1), len(groups) - 1
    level = [self._embed(outer, tokens[s]) for s in range(n)]
    for g in range(last):
      w = weights(g)
      level = [self._forward(w, x) for x in level]
      pace.add(level[-1])
    w = weights(last)
    losses = [self._last_group_loss(w, outer, x, targets[s], loss_weights[s], inv_total) for s, x in enumerate(level)]
    if parked is not None:
      state = {name: value for name, value in state.items() if name != "parked"} | {"groups": groups}
    return state, self.place.reduce(sum(losses), sharded=False)

  def _fetch(self, g: int, forward: bool, groups: list, parked: dict | None):
    """What group g's turn in the step needs on the device, issued ahead of it: its weights, or (forward, with its
    update parked) its master weights, optimizer state and parked gradient."""
    if forward and parked is not None:
      arriving = parked.setdefault("arriving", {})
      for ahead in range(g, min(g + STATE_LEAD, len(groups))):
        if ahead in arriving or parked["grads"][ahead] is None:
          continue
        if not self._admit(ahead, sum(not self.state_on_device[a] for a in arriving), needed_now=ahead == g):
          break  # the device holds its bound of host groups' state: this one comes on a later group's turn
        # Taken out of the consumed state: a device group's parked gradient is freed once its update has run,
        # not held (as ~30 GiB for llama13b) through the step that parks the next ones.
        grads, parked["grads"][ahead] = parked["grads"][ahead], None
        arriving[ahead] = self._take((groups[ahead]["master"], groups[ahead]["opt"], grads))
      return arriving[g]  # counted there until its update has run (`_settle_group`)
    return self._fetch_weights(groups[g])

  def _settle_group(self, g: int, fetched, groups: list, parked: dict | None):
    """Group g's weights for its forward pass; first, when its update is parked, applies it (`fetched`: its state
    and gradient on the device), replacing groups[g], and takes the weights from the new master weights."""
    if parked is None:
      return fetched
    master, opt_state, grads = fetched
    master, opt_state = self._update(master, opt_state, grads, parked["norm"], parked["ok"])
    self._retire(groups[g].get("weights"))  # the old compute copy: its last fetch was the last step's backward
    groups[g] = self._written(g, self._make_group(g, master, opt_state))
    del parked["arriving"][g]  # its new state is counted as it leaves (`_written`)
    return self.place.gather(self._cast(master) if self.separate_weights else master)

  def _take_state(self, g: int, group: dict):
    """Starts bringing group g's master weights and optimizer state to the device, ahead of its update."""
    self._admit(g)
    return self._take((group["master"], group["opt"]))

  def _admit(self, g: int, arriving: int = 0, needed_now: bool = True) -> bool:
    """Whether host group g's state may come to the device now: at most UPDATES_IN_FLIGHT host groups' state (with
    clipping, with their parked gradients) there, counting the `arriving` ones (brought in, their updates not run)
    and those whose new state is still leaving. The host waits for the oldest of the latter to have left while that
    is what stands in the way; a group needed now then comes (it finds no other arriving but the one updated before
    it: those after it come in after it), one brought in ahead only within the bound (False: it comes on a later
    group's turn). Waiting here, ahead of its turn, rather than deferring it: the host runs groups ahead of the
    device, and a copy into device memory starts only once every call issued before it has run (see
    `backward_inputs`), so state deferred to its group's turn would still be crossing when the group's update is
    due, leaving the GPU idle (each host group of llama13b's clipped forward, 4.5 GB: 86 ms against a group's 66)."""
    if self.state_on_device[g]:
      return True
    while self._written_back and all(x.is_ready() for x in _alive(self._written_back[0])):
      self._written_back.popleft()  # its copies out have landed, freeing its device buffers
    while self._written_back and len(self._written_back) + arriving >= UPDATES_IN_FLIGHT:
      jax.block_until_ready(_alive(self._written_back.popleft()))  # its buffers are freed once it has left
    return needed_now or len(self._written_back) + arriving < UPDATES_IN_FLIGHT

  def _take(self, tree):
    """Moves host-resident state to the device and retires its host buffers (device state moves nowhere)."""
    moved = self.place.to_device(tree)
    self._retire(tree)
    return moved

  def _retire(self, tree):
    """Frees replaced pinned host buffers RETIRE_LAG retirements after their last copy was issued. A step consumes
    its input state (as donation does on the device), so host state is never held twice (llama13b's, twice, is more
    than XLA's pinned pool holds); the lag keeps each free clear of copies still in flight."""
    self._retired.append([weakref.ref(x) for x in jax.tree.leaves(tree) if x.sharding.memory_kind == HOST])
    while len(self._retired) > RETIRE_LAG:
      for x in _alive(self._retired.popleft()):
        x.delete()

  def _finish_group(self, g: int, incoming, grads, ok, new_groups: list, parked_grads: list):
    """Updates group g now that its gradient is complete, or (clipping) keeps its gradient for the global norm."""
    if self.cfg.grad_clip_norm > 0:
      sq_norm = self._sq_norm(grads)  # of the fp32 gradient, before it is parked (perhaps narrower)
      parked_grads[g] = (self._park(g, grads), sq_norm)
    else:
      self._retire(new_groups[g].get("weights"))  # the old compute copy: its last fetch (for backward) is issued
      new_groups[g] = self._apply(g, incoming, grads, jnp.zeros((), jnp.float32), ok)

  def _park(self, g: int, grads):
    """A parked gradient waits where its group's state lives, in the shards' layout (a host group's leaves the
    device while the backward goes on), in cfg.parked_grads_dtype."""
    grads = self._narrow(grads)
    return grads if self.state_on_device[g] else self.place.to_host(grads)

  def _apply(self, g: int, incoming, grads, norm, ok) -> dict:
    master, opt_state = incoming
    return self._written(g, self._make_group(g, *self._update(master, opt_state, grads, norm, ok)))

  def _written(self, g: int, group: dict) -> dict:
    """Notes a host group's new state, whose copies out free the device memory its update held."""
    if not self.state_on_device[g]:
      self._written_back.append([weakref.ref(x) for x in jax.tree.leaves(group)])
    return group

  # ---- the pieces, for other orders of the same calls -----------------------------------------------------------

  @property
  def calls(self) -> "Calls":
    """The step's jitted calls and transfers, for schedules that order them differently (the benchmarks' baselines)
    and for sizing them (compiled memory analysis)."""
    return Calls(embed=self._embed, forward=self._forward, last_group=self._last_group, backward=self._backward,
                 embed_backward=self._embed_backward, zeros=self._zeros, cast=self.cast_layers,
                 fetch_weights=self._fetch_weights, update=self._update, apply=self._apply,
                 tail_forward=self._tail_forward, head=self._head, tail_backward=self._tail_backward)


class Calls(NamedTuple):
  """What `Engine.step` is made of; shapes as in the module docstring (x, dy: one sub-batch's hidden states)."""

  embed: Callable  # (outer, tokens) -> x
  forward: Callable  # (weights, x) -> the group's output
  # (weights, outer, x, targets, loss_weights, inv_total, grads, outer_grads) -> (loss, dx, grads, outer_grads):
  # the last group's forward, head + loss and backward for one sub-batch, residuals kept (not recomputed), as the
  # calls tail_forward (each layer), head, tail_backward (each layer); donates x and both accumulators
  last_group: Callable
  backward: Callable  # (weights, x, dy, grads) -> (dx, grads): recomputes the group's forward; donates x, grads
  embed_backward: Callable  # (outer, tokens, dx, outer_grads) -> outer_grads; donates outer_grads
  # The accumulators (grads, outer_grads) may be None, for a first sub-batch: the calls then make them.
  zeros: Callable  # tree -> fp32 gradient accumulators, one slot per device (reduce with Placement.reduce)
  cast: Callable  # stacked layer params -> the same in the dtypes the layers run in (not jitted: for eval_shape)
  fetch_weights: Callable  # group state -> its weights in the dtypes they run in, whole on every device
  update: Callable  # (master, opt_state, grads, norm, ok) -> (master, opt_state); donates master and opt_state
  apply: Callable  # (g, (master, opt_state) on the device, reduced grads, norm, ok) -> group g's new state
  # The last group's calls, for sizing them. layer, first: int32 and bool scalars on the device (layer counts within
  # the group; first: the sub-batch is the step's first, its gradient slot is set instead of added to).
  tail_forward: Callable  # (weights, layer, x) -> (y, Residuals); donates x
  head: Callable  # (outer, h, targets, loss_weights, inv_total, outer_grads) -> (loss, dh, outer_grads); donates h, outer_grads
  tail_backward: Callable  # (weights, layer, first, residuals, dy, grads) -> (dx, grads); donates dy, grads

