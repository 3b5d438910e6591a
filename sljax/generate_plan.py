"""The generation planner: the layout of a generation (batch, sub-batches, resident layers, the KV cache's place)
with the best estimated throughput that fits given memory budgets, from the bytes a generation keeps
(`layout_footprint`) and moves (`pass_cost`) in sljax.generate's loop. A search policy over the planning core
(sljax.footprint: the tiers, the margin, the copy-time model, whose rates). Any models.common.GenerationModel plans:
its sizes come from its params' shapes and one traced layer (`generation_sizes`)."""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.common import check_model
from models.config import ModelConfig
from models.presets import build
from sljax.footprint import MARGIN, SCRATCH, Footprint, copy_seconds, dequantize_bytes, machine_for, margin_bytes
from sljax.generate import IN_FLIGHT, OffloadConfig, layer_groups
from sljax.machines import GIB, REFERENCE, Budget, Machine, default_budget, target_budget
from sljax.memory import tree_bytes
from sljax.quant import QuantConfig, quantize_layers


@dataclasses.dataclass(frozen=True)
class GenerationSizes:
  """What the generation planner needs of a model, read from its params' shapes and one cached layer's jaxpr: any
  models.common.GenerationModel plans, not only the presets (for which these are the config's own numbers)."""

  num_layers: int
  max_positions: int
  dtype: jnp.dtype  # the compute dtype: the generator keeps every leaf in it
  layer_params: int
  layer_bytes: int  # one layer's weights in the compute dtype
  outer_bytes: int  # embeddings, final norm, head
  kv_bytes_per_token: int  # one layer's keys + values for one token of one row
  hidden: int  # D
  heads: int  # attention score rows per query token: the query heads
  ffn: int  # the widest per-token intermediate other than D: the MLP's
  head_flops_per_token: int  # 2 x the head's vocab x width


_SIZES: dict = {}  # by _key
_STORED: dict = {}  # compressed layer bytes by (_key, bits, group size)
# A query length and a cache length no layer dimension is likely to equal, to tell the attention scores
# [.., S, T] and the per-token intermediates [1, S, X] apart in the traced layer.
_PROBE_S, _PROBE_T = 11, 13


def generation_sizes(model) -> GenerationSizes:
  """`model`'s sizes (a GenerationModel, or a preset's ModelConfig, which is built), by jax.eval_shape and
  jax.make_jaxpr: nothing is allocated or compiled."""
  model = _built(model)
  key = _key(model)
  if key not in _SIZES:
    _SIZES[key] = _read_sizes(model)
  return _SIZES[key]


def _built(model):
  return build(model) if isinstance(model, ModelConfig) else model


_KEPT: list = []  # models known by id: kept alive, so that no other model can take their id


def _key(model):
  """What the planner's caches know a model by: its type and config, or (a config that is not hashable) itself."""
  try:
    hash((type(model), model.cfg))
    return type(model), model.cfg
  except TypeError:
    if not any(kept is model for kept in _KEPT):
      _KEPT.append(model)
    return id(model)


def _read_sizes(model) -> GenerationSizes:
  check_model(model, generation=True)
  cfg, rng = model.cfg, jax.random.key(0)
  dtype = jnp.dtype(cfg.dtype)
  cast = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), tree)
  layer = cast(jax.eval_shape(lambda: model.init_layers(jax.random.split(rng, 1))))
  outer = cast(jax.eval_shape(model.init_outer, rng))
  one = lambda *shape, kind=jnp.int32: jax.ShapeDtypeStruct(shape, kind)
  hidden = jax.eval_shape(model.embed, outer, one(1, 1), one(1, 1)).shape[-1]
  vocab = jax.eval_shape(model.logits, outer, one(1, 1, hidden, kind=dtype)).shape[-1]
  width = max((d for x in jax.tree.leaves(outer) if x.ndim == 2 and vocab in x.shape for d in x.shape if d != vocab),
              default=hidden)  # the head's (or the tied embedding's) other dimension
  s, t = _PROBE_S, _PROBE_T
  cache = jax.eval_shape(lambda: model.init_cache(1, 1, t))
  jaxpr = jax.make_jaxpr(lambda w, h, c, start: model.layers_cached(w, h, c, 0, start))(
      layer, one(1, s, hidden, kind=dtype), cache, one(1))
  shapes = [v.aval.shape for eqn in _equations(jaxpr.jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape")]
  heads = max((math.prod(shape) // (s * t) for shape in shapes if len(shape) >= 2 and shape[-2:] == (s, t)), default=1)
  ffn = max((shape[-1] for shape in shapes if len(shape) == 3 and shape[:2] == (1, s) and shape[-1] != hidden),
            default=hidden)
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  return GenerationSizes(
      num_layers=cfg.num_layers, max_positions=cfg.max_positions, dtype=dtype, layer_params=count(layer),
      layer_bytes=tree_bytes(layer), outer_bytes=tree_bytes(outer),
      kv_bytes_per_token=tree_bytes(jax.eval_shape(lambda: model.init_cache(1, 1, 1))), hidden=hidden, heads=heads,
      ffn=ffn, head_flops_per_token=2 * vocab * width)


def _equations(jaxpr):
  """Every equation of a jaxpr, those of the jaxprs inside it (scan bodies, calls) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for inner in (param if isinstance(param, (tuple, list)) else [param]):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


def _sizes(model) -> tuple[int, int, int]:
  """Bytes of one layer's weights, of the outer weights, and of one layer's keys + values for one token."""
  sizes = generation_sizes(model)
  return sizes.layer_bytes, sizes.outer_bytes, sizes.kv_bytes_per_token


def stored_layer_bytes(model, bits: int, group_size: int) -> int:
  """Bytes of one layer as the generator keeps it: in the compute dtype (16), or with int8 / int4 kernels and their
  scales (sljax.quant), from the shapes of the model's own params."""
  if bits == 16:
    return _sizes(model)[0]
  model = _built(model)
  key = (_key(model), bits, group_size)
  if key not in _STORED:
    dtype = generation_sizes(model).dtype
    layer = jax.eval_shape(lambda: jax.tree.map(lambda x: x.astype(dtype),
                                                model.init_layers(jax.random.split(jax.random.key(0), 1))))
    packed = jax.eval_shape(lambda tree: quantize_layers(tree, QuantConfig(bits=bits, group_size=group_size)), layer)
    _STORED[key] = tree_bytes(packed)
  return _STORED[key]


def _stored(model, offload: OffloadConfig) -> tuple[int, int]:
  """(bytes of a streamed layer, of a resident layer) as stored."""
  return tuple(stored_layer_bytes(model, bits, offload.weight_group_size)
               for bits in (offload.streamed_bits, offload.resident_bits))


def layout_footprint(model, offload: OffloadConfig, batch: int, prompt_len: int, max_len: int,
                     target: Machine | None = None) -> Footprint:
  """What a generation keeps at its peak (the prompt's pass: a decode pass's temporaries are one token's, and joining
  the sub-batches' caches for it holds one group's twice), per memory tier; `model` as in generation_sizes, `target`
  as in `plan` (a GPU plan leaves the core's margin unplanned)."""
  cfg = generation_sizes(model)
  layer, outer, kv_token = _sizes(model)
  streamed_layer, resident_layer = _stored(model, offload)
  item = cfg.dtype.itemsize
  rows = batch // offload.sub_batches
  streamed = cfg.num_layers - offload.resident_layers
  live = min(offload.live_layers, max(streamed, 1))
  group_cache = offload.live_layers * rows * max_len * kv_token  # one sub-batch's cache for one group
  cache = cfg.num_layers * batch * max_len * kv_token
  in_flight = IN_FLIGHT + 1
  device = {
      MARGIN: margin_bytes(target), "outer weights": outer, "resident layers": offload.resident_layers * resident_layer,
      f"streamed groups ({in_flight} in flight)": in_flight * live * streamed_layer if streamed else 0,
      # A compressed group's kernels dequantized for its sub-batches' calls; the next group's is made while they run.
      "dequantized kernels (2 groups)": (2 * offload.live_layers * layer
                                         if min(offload.streamed_bits, offload.resident_bits) < 16 else 0),
      f"KV cache ({in_flight} groups in flight)" if offload.kv_on_host else "KV cache":
          in_flight * group_cache if offload.kv_on_host else cache,
      "hidden states in and out": 2 * batch * prompt_len * cfg.hidden * item,
      # One call's temporaries, from the shapes (the next call reuses them: the device runs the calls in order):
      # attention scores over every slot (fp32, their fp32 softmax, its cast back), the MLP, the projections, and the
      # group's cache written anew (scan outputs do not alias their inputs).
      SCRATCH: (rows * cfg.heads * prompt_len * max_len * (4 + 4 + item)
                + rows * prompt_len * (3 * cfg.ffn + 6 * cfg.hidden) * item + group_cache)}
  # In host memory, a sub-batch's new cache for a group is written before its old one is let go.
  host = {"streamed layers": streamed * streamed_layer,
          "KV cache (and one being replaced)": cache + group_cache if offload.kv_on_host else 0}
  return Footprint(device, host)


class PassCost(NamedTuple):
  host_to_device: int  # bytes
  device_to_host: int  # bytes
  seconds: float  # estimate: the slowest of copies in, out, both at once, FLOPs, memory reads and dispatch


def pass_cost(model, offload: OffloadConfig, batch: int, seq: int, max_len: int, prompt: bool,
              machine: Machine = REFERENCE) -> PassCost:
  """Bytes moved and estimated time of one pass of `seq` tokens per row (the prompt's pass, or one decode pass), at
  `machine`'s rates."""
  cfg = generation_sizes(model)
  layer, outer, kv_token = _sizes(model)
  streamed_layer, resident_layer = _stored(model, offload)
  streamed = cfg.num_layers - offload.resident_layers
  cache = cfg.num_layers * batch * max_len * kv_token
  cache_in = cache if offload.kv_on_host and not prompt else 0  # the prompt's pass starts its caches on the device
  cache_out = cache if offload.kv_on_host else 0
  copied_in = streamed * streamed_layer + cache_in
  flops = batch * seq * cfg.num_layers * (2 * cfg.layer_params + 4 * max_len * cfg.hidden)
  flops += batch * cfg.head_flops_per_token
  calls = len(layer_groups(cfg.num_layers, offload.resident_layers, offload.live_layers)[0])
  # Calls per group: one per sub-batch, but decoding with the cache on the device joins the sub-batches (generate's
  # _join_rows). Device memory traffic: every call reads every layer's weights and the caches; a compressed layer is
  # also dequantized once (its codes read, its kernels written).
  parts = offload.sub_batches if prompt or offload.kv_on_host else 1
  compressed = sum(layers * dequantize_bytes(stored, layer) for layers, bits, stored in (
      (streamed, offload.streamed_bits, streamed_layer), (offload.resident_layers, offload.resident_bits, resident_layer))
      if bits < 16)
  seconds = max(copy_seconds(machine, copied_in, cache_out), flops / machine.generation_flops,
                (parts * cfg.num_layers * layer + outer + cache + compressed) / machine.memory_bytes_per_s,
                (calls * parts + 3) * machine.dispatch_seconds)
  return PassCost(copied_in, cache_out, seconds)


@dataclasses.dataclass(frozen=True)
class Plan:
  offload: OffloadConfig
  batch: int
  prompt_len: int
  new_tokens: int
  footprint: Footprint  # what it keeps at its peak, by tier and part
  budget: Budget
  prefill: PassCost  # the prompt's pass
  decode: PassCost  # one decode pass: one new token for every row

  @property
  def device_bytes(self) -> int:
    return self.footprint.device_bytes

  @property
  def host_bytes(self) -> int:
    return self.footprint.host_bytes

  @property
  def tokens_per_s(self) -> float:
    """Estimated generated tokens per second, the prompt's pass included."""
    return self.batch * self.new_tokens / (self.prefill.seconds + (self.new_tokens - 1) * self.decode.seconds)

  @property
  def decode_bytes_per_token(self) -> float:
    """Bytes over PCIe, both ways, per token generated by a decode pass."""
    return (self.decode.host_to_device + self.decode.device_to_host) / self.batch

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "prefill": self.prefill._asdict(), "decode": self.decode._asdict(),
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "device_budget": self.budget.device_bytes,
            "host_budget": self.budget.host_bytes, "tokens_per_s": self.tokens_per_s,
            "decode_bytes_per_token": self.decode_bytes_per_token}

  def describe(self, model) -> str:
    o, n = self.offload, self.offload.sub_batches
    cfg = generation_sizes(model)
    layer, _, kv_token = _sizes(model)
    streamed = cfg.num_layers - o.resident_layers
    max_len = self.prompt_len + self.new_tokens
    cache = cfg.num_layers * self.batch * max_len * kv_token
    return "\n".join([
        f"batch {self.batch} = {n} sub-batch{'es' * (n > 1)} of {self.batch // n} rows; "
        f"prompt {self.prompt_len} + {self.new_tokens} new tokens ({max_len} cache slots per row)",
        f"weights ({cfg.dtype.name}): {o.resident_layers} of {cfg.num_layers} layers resident on the device, {streamed} "
        f"streamed from pinned host in groups of {o.live_layers} ({layer / 1e9:.3g} GB per layer)" + "".join(
            f"; {what} kernels as int{bits} ({stored_layer_bytes(model, bits, o.weight_group_size) / 1e9:.3g} GB "
            f"per layer)" for what, bits in (("streamed", o.streamed_bits), ("resident", o.resident_bits))
            if bits < 16),
        f"KV cache: {cache / GIB:.2f} GiB ({max_len * cfg.num_layers * kv_token / 2**20:.1f} MiB per row), "
        f"{'in pinned host memory' if o.kv_on_host else 'on the device'}",
        *self.footprint.describe(self.budget),
        f"per decode pass: {self.decode.host_to_device / 1e9:.3g} GB host->device, "
        f"{self.decode.device_to_host / 1e9:.3g} GB device->host = {self.decode_bytes_per_token / 1e6:.4g} MB per "
        f"generated token",
        f"estimate: prompt pass {self.prefill.seconds:.3g} s, decode pass {self.decode.seconds:.3g} s -> "
        f"{self.tokens_per_s:.4g} generated tokens/s"])


def _make_plan(model, offload, batch, prompt_len, new_tokens, budget, target) -> Plan:
  max_len = prompt_len + new_tokens
  machine = machine_for(target)
  return Plan(offload, batch, prompt_len, new_tokens, layout_footprint(model, offload, batch, prompt_len, max_len, target),
              budget, pass_cost(model, offload, batch, prompt_len, max_len, True, machine),
              pass_cost(model, offload, batch, 1, max_len, False, machine))


def plan(model, prompt_len: int, new_tokens: int, device_budget: int, host_budget: int, *,
         batch: int | None = None, sub_batches: int | None = None, live_layers: int = 1,
         resident_layers: int | None = None, kv_on_host: bool | None = None, target: Machine | None = None,
         max_batch: int = 1024, streamed_bits: int = 16, resident_bits: int = 16, weight_group_size: int = 128) -> Plan:
  """The generation layout with the best estimated throughput that fits both memory budgets (bytes).

  Knobs given (not None) are kept; the others are searched: the batch over powers of two up to max_batch and
  max_batch itself, the KV cache on the device or in pinned host memory, sub-batches over the batch's divisors, and
  as many resident layers as fit. It takes the smallest batch whose best layout is within 3% of the best estimate,
  then, of that batch's layouts within 3% of its best, the cache on the device, then the fewest sub-batches: fixing
  the batch a free search chose gives the same layout. Compressed layers (`streamed_bits`, `resident_bits` < 16) count
  their smaller bytes, so more of them fit on the device. target: plan for one GPU of that machine (its rates)
  instead of for this process's device (sljax.footprint.machine_for). Raises ValueError, with the GiB needed and
  available, when nothing fits. `model`: any models.common.GenerationModel, or a preset's ModelConfig (see
  generation_sizes).
  """
  cfg = generation_sizes(model)  # checks the model first
  max_len = prompt_len + new_tokens
  if min(prompt_len, new_tokens, live_layers, batch or 1, sub_batches or 1, max_batch) < 1:
    raise ValueError("prompt_len, new_tokens, live_layers, batch, sub_batches and max_batch must be positive")
  if max_len > cfg.max_positions:
    raise ValueError(f"{prompt_len} prompt + {new_tokens} new tokens exceed the model's {cfg.max_positions} positions")
  if batch and sub_batches and batch % sub_batches:
    raise ValueError(f"batch {batch} does not split into {sub_batches} equal sub-batches")
  if resident_layers is not None and not 0 <= resident_layers <= cfg.num_layers:
    raise ValueError(f"resident_layers must be in 0..{cfg.num_layers}, got {resident_layers}")
  budget = Budget(device_budget, host_budget)
  fitting, closest = [], None  # closest: (shortfall in bytes, offload, batch, footprint) of the best misfit
  for b in [batch] if batch else sorted({2**i for i in range(max_batch.bit_length())} | {max_batch}):
    for on_host in [kv_on_host] if kv_on_host is not None else [False, True]:
      for n in [sub_batches] if sub_batches else [n for n in range(1, b + 1) if b % n == 0]:
        if b % n:
          continue
        for r in [resident_layers] if resident_layers is not None else range(cfg.num_layers, -1, -1):
          offload = OffloadConfig(n, live_layers, r, on_host, streamed_bits, resident_bits, weight_group_size)
          held = layout_footprint(model, offload, b, prompt_len, max_len, target)
          shortfall = held.shortfall(budget)
          if not shortfall:
            fitting.append(_make_plan(model, offload, b, prompt_len, new_tokens, budget, target))
            break  # the most resident layers that fit: fewer would only move more bytes
          if closest is None or shortfall < closest[0]:
            closest = (shortfall, offload, b, held)
  if not fitting:
    if closest is None:
      raise ValueError(f"no batch up to {max_batch} splits into {sub_batches} equal sub-batches")
    _, o, b, held = closest
    raise ValueError(
        f"batch {b} with {prompt_len} + {new_tokens} tokens does not fit: its smallest layout ({o.sub_batches} "
        f"sub-batches, {o.resident_layers} resident layers, KV cache {'on host' if o.kv_on_host else 'on device'}) "
        f"needs {held.device_bytes / GIB:.2f} GiB of device memory ({device_budget / GIB:.2f} available) and "
        f"{held.host_bytes / GIB:.2f} GiB of pinned host memory ({host_budget / GIB:.2f} available)")
  # The batch first, then its layout, each within 3% of the best estimate: a run that fixes the batch (a benchmark,
  # --batch) then gets the layout a free search chose for that batch.
  best = max(p.tokens_per_s for p in fitting)
  chosen = min(p.batch for p in fitting if p.tokens_per_s >= 0.97 * best)
  at_batch = [p for p in fitting if p.batch == chosen]
  best = max(p.tokens_per_s for p in at_batch)
  return next(p for p in at_batch if p.tokens_per_s >= 0.97 * best)


def memory_budgets(target: Machine | None = None) -> tuple[int, int]:
  """(device bytes, pinned host bytes) a generation may use: one GPU's of `target` (sljax.machines.target_budget),
  else this process's default budgets (sljax.machines.default_budget). The plan leaves the core's margin
  (sljax.footprint.GPU_MARGIN_BYTES) of them unplanned."""
  budget = target_budget(target) if target else default_budget()
  return budget.device_bytes, budget.host_bytes
