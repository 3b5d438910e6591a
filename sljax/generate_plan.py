"""The generation planner: the layout of a generation (batch, sub-batches, resident layers, the KV cache's place)
with the best estimated throughput that fits given memory budgets, from the bytes a generation keeps (`footprint`)
and moves (`pass_cost`) in sljax.generate's loop, and the machine's rates (sljax.machines)."""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.presets import build
from sljax.generate import IN_FLIGHT, OffloadConfig, layer_groups
from sljax.machines import GIB, REFERENCE, Machine, default_budget
from sljax.memory import tree_bytes
from sljax.quant import QuantConfig, quantize_layers


def _sizes(cfg: ModelConfig) -> tuple[int, int, int]:
  """Bytes of one layer's weights, of the outer weights, and of one layer's keys + values for one token."""
  item = jnp.dtype(cfg.dtype).itemsize
  return (cfg.layer_param_count() * item, cfg.outer_param_count() * item, 2 * cfg.kv_heads * cfg.head_dim * item)


@functools.cache
def stored_layer_bytes(cfg: ModelConfig, bits: int, group_size: int) -> int:
  """Bytes of one layer as the generator keeps it: in the compute dtype (16), or with int8 / int4 kernels and their
  scales (sljax.quant), from the shapes of the model's own params."""
  if bits == 16:
    return _sizes(cfg)[0]
  model = build(cfg)
  layer = jax.eval_shape(lambda: jax.tree.map(lambda x: x.astype(cfg.dtype),
                                              model.init_layers(jax.random.split(jax.random.key(0), 1))))
  packed = jax.eval_shape(lambda tree: quantize_layers(tree, QuantConfig(bits=bits, group_size=group_size)), layer)
  return tree_bytes(packed)


def _stored(cfg: ModelConfig, offload: OffloadConfig) -> tuple[int, int]:
  """(bytes of a streamed layer, of a resident layer) as stored."""
  return tuple(stored_layer_bytes(cfg, bits, offload.weight_group_size)
               for bits in (offload.streamed_bits, offload.resident_bits))


def footprint(cfg: ModelConfig, offload: OffloadConfig, batch: int, prompt_len: int, max_len: int) -> tuple[int, int]:
  """(device bytes, pinned host bytes) that a generation keeps at its peak (the prompt's pass)."""
  layer, outer, kv_token = _sizes(cfg)
  streamed_layer, resident_layer = _stored(cfg, offload)
  item = jnp.dtype(cfg.dtype).itemsize
  rows = batch // offload.sub_batches
  streamed = cfg.num_layers - offload.resident_layers
  live = min(offload.live_layers, max(streamed, 1))
  group_cache = offload.live_layers * rows * max_len * kv_token  # one sub-batch's cache for one group
  cache = cfg.num_layers * batch * max_len * kv_token
  # One call's temporaries: attention scores over every slot (fp32, their fp32 softmax, its cast back), the MLP,
  # the projections, and the group's cache written anew (scan outputs do not alias their inputs).
  scores = rows * cfg.num_heads * prompt_len * max_len * (4 + 4 + item)
  temporaries = scores + rows * prompt_len * (3 * cfg.intermediate_size + 6 * cfg.hidden_size) * item + group_cache
  in_flight = IN_FLIGHT + 1
  device = outer + offload.resident_layers * resident_layer + (in_flight * live * streamed_layer if streamed else 0)
  if min(offload.streamed_bits, offload.resident_bits) < 16:
    # A compressed group's kernels dequantized for its sub-batches' calls; the next group's is made while they run.
    device += 2 * offload.live_layers * layer
  device += in_flight * group_cache if offload.kv_on_host else cache
  # Hidden states in and out; one call's scratch, which the next call reuses (the device runs them in order).
  device += 2 * batch * prompt_len * cfg.hidden_size * item + temporaries
  host = streamed * streamed_layer + (cache if offload.kv_on_host else 0)
  return device, host


class PassCost(NamedTuple):
  host_to_device: int  # bytes
  device_to_host: int  # bytes
  seconds: float  # estimate: the slowest of copies in, out, both at once, FLOPs, memory reads and dispatch


def pass_cost(cfg: ModelConfig, offload: OffloadConfig, batch: int, seq: int, max_len: int, prompt: bool,
              machine: Machine = REFERENCE) -> PassCost:
  """Bytes moved and estimated time of one pass of `seq` tokens per row (the prompt's pass, or one decode pass), at
  `machine`'s rates."""
  layer, outer, kv_token = _sizes(cfg)
  streamed_layer, resident_layer = _stored(cfg, offload)
  streamed = cfg.num_layers - offload.resident_layers
  cache = cfg.num_layers * batch * max_len * kv_token
  cache_in = cache if offload.kv_on_host and not prompt else 0  # the prompt's pass starts its caches on the device
  cache_out = cache if offload.kv_on_host else 0
  copied_in = streamed * streamed_layer + cache_in
  flops = batch * seq * cfg.num_layers * (2 * cfg.layer_param_count() + 4 * max_len * cfg.hidden_size)
  flops += 2 * batch * cfg.vocab_size * cfg.embed_dim
  calls = len(layer_groups(cfg.num_layers, offload.resident_layers, offload.live_layers)[0])
  # Device memory traffic: every sub-batch reads every layer's weights and the caches; a compressed layer is first
  # dequantized once (its codes read, its kernels written).
  compressed = sum(layers * (stored + layer) for layers, bits, stored in (
      (streamed, offload.streamed_bits, streamed_layer), (offload.resident_layers, offload.resident_bits, resident_layer))
      if bits < 16)
  seconds = max(copied_in / machine.copy_bytes_per_s, cache_out / machine.copy_to_host_bytes_per_s,
                (copied_in + cache_out) / machine.copy_both_bytes_per_s, flops / machine.generation_flops,
                (offload.sub_batches * cfg.num_layers * layer + outer + cache + compressed) / machine.memory_bytes_per_s,
                (calls * offload.sub_batches + 3) * machine.dispatch_seconds)
  return PassCost(copied_in, cache_out, seconds)


@dataclasses.dataclass(frozen=True)
class Plan:
  offload: OffloadConfig
  batch: int
  prompt_len: int
  new_tokens: int
  device_bytes: int
  host_bytes: int
  device_budget: int
  host_budget: int
  prefill: PassCost  # the prompt's pass
  decode: PassCost  # one decode pass: one new token for every row

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
            "tokens_per_s": self.tokens_per_s, "decode_bytes_per_token": self.decode_bytes_per_token}

  def describe(self, cfg: ModelConfig) -> str:
    o, n = self.offload, self.offload.sub_batches
    layer, _, kv_token = _sizes(cfg)
    streamed = cfg.num_layers - o.resident_layers
    max_len = self.prompt_len + self.new_tokens
    cache = cfg.num_layers * self.batch * max_len * kv_token
    return "\n".join([
        f"batch {self.batch} = {n} sub-batch{'es' * (n > 1)} of {self.batch // n} rows; "
        f"prompt {self.prompt_len} + {self.new_tokens} new tokens ({max_len} cache slots per row)",
        f"weights ({cfg.dtype}): {o.resident_layers} of {cfg.num_layers} layers resident on the device, {streamed} "
        f"streamed from pinned host in groups of {o.live_layers} ({layer / 1e9:.3g} GB per layer)" + "".join(
            f"; {what} kernels as int{bits} ({stored_layer_bytes(cfg, bits, o.weight_group_size) / 1e9:.3g} GB "
            f"per layer)" for what, bits in (("streamed", o.streamed_bits), ("resident", o.resident_bits))
            if bits < 16),
        f"KV cache: {cache / GIB:.2f} GiB ({max_len * cfg.num_layers * kv_token / 2**20:.1f} MiB per row), "
        f"{'in pinned host memory' if o.kv_on_host else 'on the device'}",
        f"memory: device {self.device_bytes / GIB:.2f} of {self.device_budget / GIB:.2f} GiB, "
        f"pinned host {self.host_bytes / GIB:.2f} of {self.host_budget / GIB:.2f} GiB",
        f"per decode pass: {self.decode.host_to_device / 1e9:.3g} GB host->device, "
        f"{self.decode.device_to_host / 1e9:.3g} GB device->host = {self.decode_bytes_per_token / 1e6:.4g} MB per "
        f"generated token",
        f"estimate: prompt pass {self.prefill.seconds:.3g} s, decode pass {self.decode.seconds:.3g} s -> "
        f"{self.tokens_per_s:.4g} generated tokens/s"])


def _make_plan(cfg, offload, batch, prompt_len, new_tokens, budgets, machine) -> Plan:
  max_len = prompt_len + new_tokens
  device, host = footprint(cfg, offload, batch, prompt_len, max_len)
  return Plan(offload, batch, prompt_len, new_tokens, device, host, *budgets,
              pass_cost(cfg, offload, batch, prompt_len, max_len, True, machine),
              pass_cost(cfg, offload, batch, 1, max_len, False, machine))


def plan(cfg: ModelConfig, prompt_len: int, new_tokens: int, device_budget: int, host_budget: int, *,
         batch: int | None = None, sub_batches: int | None = None, live_layers: int = 1,
         resident_layers: int | None = None, kv_on_host: bool | None = None, machine: Machine = REFERENCE,
         max_batch: int = 1024, streamed_bits: int = 16, resident_bits: int = 16, weight_group_size: int = 128) -> Plan:
  """The generation layout with the best estimated throughput that fits both memory budgets (bytes).

  Knobs given (not None) are kept; the others are searched: the batch over powers of two up to max_batch and
  max_batch itself, the KV cache on the device or in pinned host memory, sub-batches over the batch's divisors, and
  as many resident layers as fit. Of the layouts within 3% of the best estimate it takes the smallest batch, then the
  cache on the device, then the fewest sub-batches. Compressed layers (`streamed_bits`, `resident_bits` < 16) count
  their smaller bytes, so more of them fit on the device. Raises ValueError, with the GiB needed and available, when
  nothing fits.
  """
  max_len = prompt_len + new_tokens
  if min(prompt_len, new_tokens, live_layers, batch or 1, sub_batches or 1, max_batch) < 1:
    raise ValueError("prompt_len, new_tokens, live_layers, batch, sub_batches and max_batch must be positive")
  if max_len > cfg.max_positions:
    raise ValueError(f"{prompt_len} prompt + {new_tokens} new tokens exceed the model's {cfg.max_positions} positions")
  if batch and sub_batches and batch % sub_batches:
    raise ValueError(f"batch {batch} does not split into {sub_batches} equal sub-batches")
  if resident_layers is not None and not 0 <= resident_layers <= cfg.num_layers:
    raise ValueError(f"resident_layers must be in 0..{cfg.num_layers}, got {resident_layers}")
  budgets = (device_budget, host_budget)
  fitting, closest = [], None  # closest: (shortfall in bytes, offload, batch, device, host) of the best misfit
  for b in [batch] if batch else sorted({2**i for i in range(max_batch.bit_length())} | {max_batch}):
    for on_host in [kv_on_host] if kv_on_host is not None else [False, True]:
      for n in [sub_batches] if sub_batches else [n for n in range(1, b + 1) if b % n == 0]:
        if b % n:
          continue
        for r in [resident_layers] if resident_layers is not None else range(cfg.num_layers, -1, -1):
          offload = OffloadConfig(n, live_layers, r, on_host, streamed_bits, resident_bits, weight_group_size)
          device, host = footprint(cfg, offload, b, prompt_len, max_len)
          shortfall = max(device - device_budget, 0) + max(host - host_budget, 0)
          if not shortfall:
            fitting.append(_make_plan(cfg, offload, b, prompt_len, new_tokens, budgets, machine))
            break  # the most resident layers that fit: fewer would only move more bytes
          if closest is None or shortfall < closest[0]:
            closest = (shortfall, offload, b, device, host)
  if not fitting:
    if closest is None:
      raise ValueError(f"no batch up to {max_batch} splits into {sub_batches} equal sub-batches")
    _, o, b, device, host = closest
    raise ValueError(
        f"batch {b} with {prompt_len} + {new_tokens} tokens does not fit: its smallest layout ({o.sub_batches} "
        f"sub-batches, {o.resident_layers} resident layers, KV cache {'on host' if o.kv_on_host else 'on device'}) "
        f"needs {device / GIB:.2f} GiB of device memory ({device_budget / GIB:.2f} available) and {host / GIB:.2f} "
        f"GiB of pinned host memory ({host_budget / GIB:.2f} available)")
  best = max(p.tokens_per_s for p in fitting)
  return next(p for p in fitting if p.tokens_per_s >= 0.97 * best)


def memory_budgets(device: jax.Device | None = None) -> tuple[int, int]:
  """(device bytes, pinned host bytes) a generation may use here: the default budgets (sljax.machines), less 3% and
  1 GiB of the device's for fragmentation and XLA's own scratch, which `footprint` does not count."""
  budget = default_budget(device)
  return max(int(0.97 * budget.device_bytes) - GIB, 0), budget.host_bytes
