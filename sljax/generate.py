"""Offloaded inference: layer-major prefill and decode, with the KV cache exchanged through pinned host memory.

One generation (`OffloadedGenerator.generate`), top to bottom:

  prompts, left-padded to P tokens -> N sub-batches of b rows
  one pass for the prompt (cache slots 0..P-1), then one pass per new token t (slot P + t):
    embed every sub-batch
    for each group g of `live_layers` layers:
      W_g on the device: resident groups stay there (spread among the others, see layer_groups); the others come
          from pinned host, prefetched one group ahead; compressed kernels (int8 / int4) are dequantized once here
          for the prompt's pass and whenever several sub-batches share them, else (a decode pass of one call per
          group) inside that call
      for each sub-batch s:  its cache for g, prefetched one sub-batch ahead from pinned host (or kept on the device)
        h[s], cache = group g over sub-batch s          (the cache is donated: updated in place)
        cache -> pinned host
    last-position logits of every sub-batch -> sample the next token of every row

A streamed group's weights cross PCIe once per pass, whatever N is; a sub-batch's cache for a group is one contiguous
[live, b, T, K, H] array for k and one for v, each crossing in one copy. The sub-batches exist for the prompt's pass,
whose temporaries grow with its rows: when the cache stays on the device, the sub-batches' caches are joined before
the first decode pass (`_join_rows`), which then runs all B rows in one call per group, reading each group's weights
once per pass instead of N times. The loop waits for the device only to bound how far it runs ahead (IN_FLIGHT),
since every copy it issues allocates its destination at once.

`sljax.generate_plan.plan` picks the batch, sub-batches, resident layers and the KV cache's place for given memory
budgets; `generate_on_device` is the plain loop that tests compare to.
"""

import collections
import dataclasses
import functools
import itertools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.common import cache_positions, check_model, params_reader
from sljax.memory import InFlight, Placement, prefetch
from sljax.quant import WEIGHT_BITS, QuantConfig, dequantize_layers, quantize_layers

IN_FLIGHT = 2  # group calls the host may dispatch ahead of the device; more would hold more copies on the device


# ---- configs ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """What to generate: how many tokens, how to pick each, when a sequence ends."""

  max_new_tokens: int = 32
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0  # nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p
  stop_tokens: tuple[int, ...] = ()  # a row ends with the first of these it generates (kept in the output)
  pad_token: int = 0  # fills each row after its stop token, and left-pads shorter prompts (never attended to)
  seed: int = 0

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """Where weights and caches live and how the batch is cut; `plan` chooses one for given memory budgets."""

  sub_batches: int = 1  # N: the batch runs as N sub-batches that share each fetch of a group's weights
  live_layers: int = 1  # layers per group: one jitted call runs one group over one sub-batch
  resident_layers: int = 0  # layers whose weights stay on the device (spread among the others, which stream)
  kv_on_host: bool = True  # each sub-batch's KV cache waits in pinned host memory between passes
  # Streamed (and resident) layers' matmul kernels as int8 / int4 codes with a scale per group of `weight_group_size`
  # rows (sljax.quant), dequantized on the device (see the module docstring); 16: the compute dtype, exact.
  streamed_bits: int = 16
  resident_bits: int = 16
  weight_group_size: int = 128

  def __post_init__(self):
    if self.sub_batches < 1 or self.live_layers < 1 or self.resident_layers < 0:
      raise ValueError(f"sub_batches and live_layers must be >= 1 and resident_layers >= 0, got {self}")
    for name in ("streamed_bits", "resident_bits"):
      if getattr(self, name) not in WEIGHT_BITS:
        raise ValueError(f"{name} must be one of {', '.join(map(str, WEIGHT_BITS))}, got {getattr(self, name)}")
    if self.weight_group_size < 1:
      raise ValueError(f"weight_group_size must be >= 1, got {self.weight_group_size}")


# ---- sampling and the jitted pieces ------------------------------------------------------------------------------

def sample(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
  """Next token of every row: argmax at temperature 0, else a draw from softmax(logits / temperature) cut to top_p."""
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV.astype(jnp.float32) / temperature
  if top_p < 1:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    kept_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV < top_p  # the mass before a token is short of top_p
    threshold_B = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1)
    logits_BxV = jnp.where(logits_BxV < threshold_B[:, None], -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _next_tokens(logits_BxV, done_B, key, step, temperature, top_p, pad_token, stop_tokens):
  token_B = sample(logits_BxV, jax.random.fold_in(key, step), temperature, top_p)
  token_B = jnp.where(done_B, pad_token, token_B)
  return token_B, done_B | jnp.isin(token_B, jnp.asarray(stop_tokens, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _embed(model, outer, tokens_BxS, offset, start_B, parts: int):
  """Embeddings of the tokens in cache slots offset.., split into `parts` sub-batches."""
  h_BxSxD = model.embed(outer, tokens_BxS, cache_positions(offset, start_B, tokens_BxS.shape[1]))
  return jnp.split(h_BxSxD, parts)


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(3,))
def _layers(model, stacked, h_BxSxD, cache, offset, start_B, max_len: int):
  """A group of layers over one sub-batch through its cache; cache None starts an empty one (the prompt's pass).
  Compressed kernels are dequantized here, inside the call, where XLA can read the codes straight into the matmuls."""
  if cache is None:
    cache = model.init_cache(jax.tree.leaves(stacked)[0].shape[0], h_BxSxD.shape[0], max_len)
  return model.layers_cached(dequantize_layers(stacked, model.cfg.dtype), h_BxSxD, cache, offset, start_B)


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize(stacked, dtype):
  """A compressed group's kernels in the compute dtype, made once per pass when several sub-batches' calls share
  them: dequantizing inside each of those calls would repeat it per sub-batch."""
  return dequantize_layers(stacked, dtype)


@jax.jit
def _concat_rows(parts):
  """One group's sub-batch caches as one cache of all their rows, in order."""
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *parts)  # [L, B, T, K, H]


@functools.partial(jax.jit, static_argnums=(0,))
def _last_logits(model, outer, hs):
  """fp32 logits at the last position of every row of every sub-batch: [B, V]."""
  h_Bx1xD = jnp.concatenate([h_bxSxD[:, -1:] for h_bxSxD in hs])
  return model.logits(outer, h_Bx1xD)[:, 0].astype(jnp.float32)


# ---- the loop both generators share -----------------------------------------------------------------------------

class Generation(NamedTuple):
  tokens: np.ndarray  # [B, max_new_tokens] int32; pad_token after a row's stop token
  lengths: np.ndarray  # [B] tokens generated per row, its stop token included
  prefill_seconds: float  # prompts in, first tokens out (compilation included, on a first call)
  decode_seconds: float  # the other max_new_tokens - 1 tokens


def left_pad(prompts: Sequence[Sequence[int]], pad_token: int, prompt_len: int | None = None):
  """(tokens [B, P] int32, start [B] int32): each prompt right-aligned in P slots, starting at slot start[b]."""
  lengths = np.array([len(p) for p in prompts])
  if not len(prompts) or lengths.min() < 1:
    raise ValueError("every prompt needs at least one token" if len(prompts) else "no prompts")
  prompt_len = prompt_len or int(lengths.max())
  if lengths.max() > prompt_len:
    raise ValueError(f"a prompt has {lengths.max()} tokens, more than prompt_len {prompt_len}")
  tokens_BxP = np.full((len(prompts), prompt_len), pad_token, np.int32)
  for row, prompt in enumerate(prompts):
    tokens_BxP[row, prompt_len - len(prompt):] = prompt
  return tokens_BxP, (prompt_len - lengths).astype(np.int32)


def _generate(model, open_passes: Callable, prompts, sampling: SamplingConfig, prompt_len: int | None,
              max_len: int | None) -> Generation:
  """Prompt pass, then sample -> pass -> sample ...; `open_passes(start_B, max_len)` returns the generation's
  `run(tokens_BxS, offset) -> logits_BxV`, which owns the KV cache."""
  tokens_BxP, start_B = left_pad(prompts, sampling.pad_token, prompt_len)
  batch, prompt_len = tokens_BxP.shape
  new_tokens = sampling.max_new_tokens
  max_len = max_len or prompt_len + new_tokens
  if max_len < prompt_len + new_tokens or max_len > model.cfg.max_positions:
    raise ValueError(f"{prompt_len} prompt + {new_tokens} new tokens need a cache of {prompt_len + new_tokens} "
                     f"slots; got max_len {max_len}, and the model takes at most {model.cfg.max_positions} positions")
  run = open_passes(start_B, max_len)
  key = jax.random.key(sampling.seed)
  rule = (sampling.temperature, sampling.top_p, sampling.pad_token, tuple(sampling.stop_tokens))

  begin = time.perf_counter()
  logits_BxV = run(tokens_BxP, 0)
  done_B, outputs = jnp.zeros(batch, bool), []
  for t in range(new_tokens):
    if t and sampling.stop_tokens and np.asarray(done_B).all():  # done as of token t - 1: computed by now
      break
    token_B, done_B = _next_tokens(logits_BxV, done_B, key, t, *rule)
    outputs.append(token_B)
    if t == 0:  # the one wait that timing needs: the prompt's pass ends with the first tokens
      jax.block_until_ready(token_B)
      prefilled = time.perf_counter()
    if t + 1 < new_tokens:
      logits_BxV = run(token_B[:, None], prompt_len + t)
  tokens = np.full((batch, new_tokens), sampling.pad_token, np.int32)
  tokens[:, :len(outputs)] = np.stack(jax.device_get(outputs), axis=1)
  end = time.perf_counter()

  stopped = np.isin(tokens, sampling.stop_tokens)
  lengths = np.where(stopped.any(axis=1), stopped.argmax(axis=1) + 1, new_tokens)
  return Generation(tokens, lengths, prefilled - begin, end - prefilled)


def generate_on_device(model, params: dict, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                       prompt_len: int | None = None, max_len: int | None = None) -> Generation:
  """The plain loop: the whole model and its cache on the default device, one call per pass. The reference."""

  class Passes:
    def __init__(self, start_B, max_len):
      self.start_B, self.max_len, self.cache = jnp.asarray(start_B), max_len, None

    def __call__(self, tokens_BxS, offset):
      (h_BxSxD,) = _embed(model, params["outer"], tokens_BxS, offset, self.start_B, 1)
      h_BxSxD, self.cache = _layers(model, params["layers"], h_BxSxD, self.cache, offset, self.start_B, self.max_len)
      return _last_logits(model, params["outer"], [h_BxSxD])

  return _generate(model, Passes, prompts, sampling, prompt_len, max_len)


# ---- the offloaded generator -------------------------------------------------------------------------------------

def layer_groups(num_layers: int, resident_layers: int, live_layers: int) -> tuple[list[tuple[int, int]], list[bool]]:
  """([start, stop) of each group, whether it is resident). The streamed and the resident layers each form groups of
  up to live_layers, and the resident groups are spread evenly among the streamed ones rather than put last: while
  the device runs the resident groups between two streamed ones, the next streamed group is already crossing PCIe,
  so a pass costs about its copies alone instead of its copies plus the resident groups' work."""
  sizes = lambda layers: [min(live_layers, layers - a) for a in range(0, layers, live_layers)]
  streamed, resident = sizes(num_layers - resident_layers), sizes(resident_layers)
  n, r = len(streamed) + len(resident), len(resident)
  flags = [(k + 1) * r // n > k * r // n for k in range(n)]  # r of n, evenly spaced
  size_of = {False: iter(streamed), True: iter(resident)}
  groups, start = [], 0
  for flag in flags:
    stop = start + next(size_of[flag])
    groups.append((start, stop))
    start = stop
  return groups, flags


class OffloadedGenerator:
  """Generates with `model` (any models.common.GenerationModel) layer-major, as the module docstring describes.

  Weights are kept in the model's compute dtype: `load` or `init` lays them out as {"outer": on the device,
  "groups": [group g's stacked layers, on the device if resident, else in pinned host memory]}.
  """

  def __init__(self, model, offload: OffloadConfig, placement: Placement | None = None):
    check_model(model, generation=True)
    num_layers = model.cfg.num_layers
    if offload.resident_layers > num_layers:
      raise ValueError(f"resident_layers {offload.resident_layers} exceeds the model's {num_layers} layers")
    self.model, self.offload = model, offload
    self.place = placement or Placement.single()
    self.groups, self.resident = layer_groups(num_layers, offload.resident_layers, offload.live_layers)

  def load(self, params) -> dict:
    """Weights laid out by group, from full-model params ({"outer", "layers"}: numpy or jax, e.g. from
    models.hf.load_hf) or from a reader with outer() and layers(start, stop) (models.hf.HFWeights), which is read
    one group at a time: only that group is ever in host RAM outside its home, so the model may exceed host RAM."""
    reader = params_reader(params)
    dtype = jnp.dtype(self.model.cfg.dtype)
    cast = lambda tree: jax.tree.map(lambda x: np.asarray(x).astype(dtype, copy=False), tree)
    groups = [self._home(g, self._compress(self._bits(g), cast(reader.layers(a, b))))
              for g, (a, b) in enumerate(self.groups)]
    return {"outer": self.place.to_device(cast(reader.outer())), "groups": groups}

  def _bits(self, g: int) -> int:
    return self.offload.resident_bits if self.resident[g] else self.offload.streamed_bits

  def _compress(self, bits: int, stacked):
    """Layers as the config keeps them: in the compute dtype (16), or with int8 / int4 kernels."""
    if bits == 16:
      return stacked
    return quantize_layers(stacked, QuantConfig(bits=bits, group_size=self.offload.weight_group_size))

  def init(self, key: jax.Array, host_buffers: int | None = None) -> dict:
    """Random weights, made one group at a time on the device, so the whole model never has to fit there;
    equal to `load(model.init(key))`.

    host_buffers: make at most this many distinct pinned-host groups of each size and reuse them for the other
    streamed groups. For benchmarks of models larger than host memory: the same bytes cross PCIe and the same
    FLOPs run, but the weights repeat.
    """
    dtype = self.model.cfg.dtype
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    outer_key, layers_key = jax.random.split(key)
    layer_keys = jax.random.split(layers_key, self.model.cfg.num_layers)
    make_outer = jax.jit(lambda k: cast(self.model.init_outer(k)), out_shardings=self.place.device())
    make = {resident: jax.jit(lambda keys, bits: self._compress(bits, cast(self.model.init_layers(keys))),
                              static_argnums=1, out_shardings=sharding)
            for resident, sharding in ((True, self.place.device()), (False, self.place.host()))}
    made, used = collections.defaultdict(list), collections.Counter()  # by group size: distinct host groups, uses
    groups = []
    for g, (a, b) in enumerate(self.groups):
      if self.resident[g]:
        groups.append(make[True](layer_keys[a:b], self._bits(g)))
        continue
      pool = made[b - a]
      if host_buffers is None or len(pool) < host_buffers:
        pool.append(make[False](layer_keys[a:b], self._bits(g)))
      groups.append(pool[used[b - a] % len(pool)])
      used[b - a] += 1
    return {"outer": make_outer(outer_key), "groups": groups}

  def generate(self, weights: dict, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
               prompt_len: int | None = None, max_len: int | None = None) -> Generation:
    """Continues every prompt (B of them, a multiple of sub_batches). prompt_len: left-pad every prompt to this many
    tokens (default: the longest); max_len: cache slots per row (default: prompt_len + max_new_tokens). Fixing both
    keeps the shapes, and so the compiled calls, of one generation for the next."""
    open_passes = lambda start_B, max_len: _OffloadedPasses(self, weights, start_B, max_len)
    return _generate(self.model, open_passes, prompts, sampling, prompt_len, max_len)

  def prompt_logits(self, weights: dict, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """fp32 logits of the token after each prompt, [B, V]: the prompt's pass alone."""
    tokens_BxP, start_B = left_pad(prompts, pad_token=0)
    return np.asarray(_OffloadedPasses(self, weights, start_B, tokens_BxP.shape[1])(tokens_BxP, 0))

  def _home(self, g: int, tree):
    return self.place.to_device(tree) if self.resident[g] else self.place.to_host(tree)

  def fetch_cache(self, cache):
    return self.place.to_device(cache) if self.offload.kv_on_host and cache is not None else cache

  def stash_cache(self, cache):
    return self.place.to_host(cache) if self.offload.kv_on_host else cache


class _OffloadedPasses:
  """The passes of one generation: its sub-batches' caches and the endless stream of streamed groups' weights."""

  def __init__(self, generator: OffloadedGenerator, weights: dict, start_B: np.ndarray, max_len: int):
    if len(start_B) % generator.offload.sub_batches:
      raise ValueError(f"{len(start_B)} prompts do not split into {generator.offload.sub_batches} equal sub-batches")
    self.gen, self.weights, self.max_len = generator, weights, max_len
    self.start_B = jnp.asarray(start_B)
    self.starts = [jnp.asarray(part) for part in np.split(start_B, generator.offload.sub_batches)]
    self.caches = [[None] * len(self.starts) for _ in generator.groups]  # caches[g][s]: (k, v) of sub-batch s, group g
    streamed = [w for w, resident in zip(weights["groups"], generator.resident) if not resident]
    # Every pass visits the streamed groups in the same order, so the next pass's first fetch starts in this one.
    self.weight_stream = prefetch(itertools.cycle(streamed), generator.place.to_device)
    self.in_flight = InFlight(IN_FLIGHT)  # at most IN_FLIGHT + 1 groups' weights and sub-batches' caches on the device

  def __call__(self, tokens_BxS, offset) -> jax.Array:
    gen, outer = self.gen, self.weights["outer"]
    if offset and len(self.starts) > 1 and not gen.offload.kv_on_host:
      self._join_rows()
    hs = list(_embed(gen.model, outer, tokens_BxS, offset, self.start_B, len(self.starts)))
    slots = [(g, s) for g in range(len(gen.groups)) for s in range(len(hs))]
    cache_stream = prefetch((self.caches[g][s] for g, s in slots), gen.fetch_cache)  # read lazily: frees as it goes
    for (g, s), cache in zip(slots, cache_stream):
      if s == 0:
        weights = self.weights["groups"][g] if gen.resident[g] else next(self.weight_stream)
        # One dequantize call for the group's calls, but a decode pass with one call per group dequantizes inside
        # it (benchmarks.int4_matmul: fused, a decode step's matmul takes about half the time); the prompt's pass,
        # compute-bound, keeps the separate call.
        if gen._bits(g) < 16 and (len(hs) > 1 or tokens_BxS.shape[1] > 1):
          weights = _dequantize(weights, gen.model.cfg.dtype)
      hs[s], cache = _layers(gen.model, weights, hs[s], cache, offset, self.starts[s], self.max_len)
      self.caches[g][s] = gen.stash_cache(cache)
      self.in_flight.add(hs[s])
    return _last_logits(gen.model, outer, hs)

  def _join_rows(self):
    """Decoding from here on runs every row in one call per group (the module docstring says why). Group by group,
    so that only one group's cache is ever held twice."""
    for g in range(len(self.caches)):
      self.caches[g] = [_concat_rows(self.caches[g])]
    self.starts = [self.start_B]
