"""What every layer-major model shares: the contract the engine and the generator drive (`TrainingModel`,
`GenerationModel`, checked by `check_model`), attention (plain and cached), the loss."""

import dataclasses
import inspect
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from models.config import ModelConfig

Params = dict  # {"outer": embeddings/norm/head params, "layers": per-layer params stacked on a leading L axis}


# ---- the contract ----------------------------------------------------------------------------------------------

class ModelConfigLike(Protocol):
  """What the engine reads of `model.cfg` (models.config.ModelConfig has it; any object with these fields will do)."""

  num_layers: int  # L
  dtype: Any  # compute dtype: activations, and the matmul kernels (see layer_compute_dtypes)
  param_dtype: Any  # dtype of the master weights the optimizer updates


@runtime_checkable
class TrainingModel(Protocol):
  """A decoder cut into the three pieces `sljax.Engine` and `sljax.make_plan` drive. Params are any pytrees;
  "layers" has every leaf stacked on a leading axis of length L, so a slice [i:j] is layers i..j-1.

  Optional: `compute_dtypes(stacked) -> a dtype per leaf` (default `default_compute_dtypes`), `without_remat()` (needed
  when cfg.remat is true: the engine's group backward already recomputes each group), `cfg.flops_per_token(seq_len)`
  (the planner's compute estimate; without it, 6 x params + attention from the params' shapes).
  """

  cfg: ModelConfigLike

  def init_outer(self, key: jax.Array) -> Params:
    """Embeddings, final norm and head: everything that is not a decoder layer."""

  def init_layers(self, keys_L: jax.Array) -> Params:
    """Params of len(keys_L) layers, layer i from keys_L[i], every leaf stacked on a leading L axis."""

  def embed(self, outer: Params, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None) -> jax.Array:
    """h_BxSxD; positions default to 0..S-1 in every row (the generator passes them, training does not)."""

  def layers(self, stacked: Params, h_BxSxD: jax.Array) -> jax.Array:
    """Runs the layers stacked in `stacked` (any number of them) in order: h_BxSxD -> h_BxSxD in cfg.dtype."""

  def head_loss(self, outer: Params, h_BxSxD: jax.Array, targets_BxS: jax.Array, weights_BxS: jax.Array
                ) -> jax.Array:
    """The weighted SUM over tokens of the token losses, an fp32 scalar (not a mean: the engine divides the sum over
    all sub-batches by the total weight of the effective batch)."""


@runtime_checkable
class GenerationModel(TrainingModel, Protocol):
  """What `sljax.generate.OffloadedGenerator` drives besides the training pieces; cfg also has max_positions."""

  def init_cache(self, num_layers: int, batch: int, max_len: int) -> Any:
    """An empty KV cache for num_layers layers and max_len slots, every leaf stacked on a leading axis of
    num_layers (LayerMajorModel: (k, v), each [L, B, T, K, H])."""

  def layers_cached(self, stacked: Params, h_BxSxD: jax.Array, cache: Any, offset, start_B: jax.Array
                    ) -> tuple[jax.Array, Any]:
    """`layers` for S new tokens written to cache slots offset..offset+S-1, attending through the cache; row b's
    sequence starts at slot start_B[b] (left padding). Returns (h_BxSxD, the updated cache)."""

  def logits(self, outer: Params, h_BxSxD: jax.Array) -> jax.Array:
    """logits_BxSxV."""


# Each piece with the positional arguments its callers pass: a model must accept them.
_TRAINING = {"init_outer": 1, "init_layers": 1, "embed": 2, "layers": 2, "head_loss": 4}
_GENERATION = {"embed": 3, "init_cache": 3, "layers_cached": 5, "logits": 2}


def check_model(model, generation: bool = False) -> None:
  """Raises TypeError naming what `model` lacks of TrainingModel (and, generation, of GenerationModel)."""
  kind = "GenerationModel" if generation else "TrainingModel"
  cfg_fields = ("num_layers", "dtype", "param_dtype") + (("max_positions",) if generation else ())
  cfg = getattr(model, "cfg", None)
  missing = ["model.cfg"] if cfg is None else [f"model.cfg.{f}" for f in cfg_fields if not hasattr(cfg, f)]
  methods = dict(_TRAINING, **_GENERATION) if generation else _TRAINING
  for name, args in methods.items():
    method = getattr(model, name, None)
    if not callable(method):
      missing.append(f"model.{name}")
    elif not _takes(method, args):
      missing.append(f"model.{name} taking {args} positional argument{'s' * (args > 1)}")
  if cfg is not None and getattr(cfg, "remat", False) and not callable(getattr(model, "without_remat", None)):
    missing.append("model.without_remat (cfg.remat is true)")
  if missing:
    raise TypeError(f"{', '.join(missing)} missing: {type(model).__name__} is not a models.common.{kind} (see its "
                    f"docstring for each piece's arguments and shapes)")


def _takes(fn, args: int) -> bool:
  try:
    inspect.signature(fn).bind(*range(args))
  except TypeError:
    return False
  except ValueError:  # no signature to read (a builtin or C callable): trust it
    return True
  return True


def default_compute_dtypes(stacked: Params, dtype) -> Any:
  """The dtype each stacked layer leaf runs in, unless the model says otherwise: matmul kernels (2 or more dims per
  layer) in the compute dtype, as Flax's Dense and most models cast them before multiplying; vectors (norm scales,
  biases) as stored, since a model that applies them in the compute dtype casts them itself, and one that applies
  them in fp32 (Flax's LayerNorm) must get them unrounded."""
  return jax.tree.map(lambda x: jnp.dtype(dtype) if x.ndim >= 3 else jnp.dtype(x.dtype), stacked)


def layer_compute_dtypes(model, stacked: Params) -> Any:
  """A dtype per leaf of the stacked layer params `stacked` (arrays or shapes): what the engine casts each leaf to
  before it crosses to the device, so the layers compute exactly what the model computes on its master weights."""
  own = getattr(model, "compute_dtypes", None)
  return own(stacked) if own is not None else default_compute_dtypes(stacked, model.cfg.dtype)


class InMemoryParams:
  """Full-model Params behind the reader interface that models.hf.HFWeights also has: outer(), layers(start, stop).
  What lays weights out group by group (the engine, the generator) takes either."""

  def __init__(self, params: Params):
    self.params = params

  def outer(self) -> Params:
    return self.params["outer"]

  def layers(self, start: int, stop: int) -> Params:
    return jax.tree.map(lambda x: x[start:stop], self.params["layers"])


def params_reader(params):
  """`params` as a reader: a Params dict is wrapped, a reader (models.hf.HFWeights) is returned as it is."""
  return InMemoryParams(params) if isinstance(params, dict) else params


def attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, cfg: ModelConfig, scale: float | None = None):
  """Causal attention; K may divide N (grouped-query). cuDNN flash attention on GPU, plain XLA elsewhere."""
  implementation = cfg.attention
  if implementation == "auto":
    fast_dtype = q_BxSxNxH.dtype in (jnp.bfloat16, jnp.float16)
    implementation = "cudnn" if jax.default_backend() == "gpu" and fast_dtype else "xla"
  return jax.nn.dot_product_attention(
      q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, is_causal=True, scale=scale, implementation=implementation)


class KVCache(NamedTuple):
  """One layer's keys and values for T cache slots, and where the S new tokens of a block's input go in it."""

  k_BxTxKxH: jax.Array
  v_BxTxKxH: jax.Array
  offset: jax.Array  # slot of the first new token; new token s goes to slot offset + s
  positions_BxS: jax.Array  # each new token's position within its own sequence (rows may be left-padded)
  visible_Bx1xSxT: jax.Array  # which slots each new token attends to


def cached_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, cache: KVCache, scale: float | None = None):
  """Writes the new keys and values into the cache at its offset, then attends over the visible slots.

  Returns (attention output, the cache with its k and v updated). Always XLA's attention: the visibility mask is
  arbitrary (left padding, unwritten slots), and decoding one token is bound by memory traffic, not by this.
  """
  k_BxTxKxH = lax.dynamic_update_slice_in_dim(cache.k_BxTxKxH, k_BxSxKxH.astype(cache.k_BxTxKxH.dtype), cache.offset, 1)
  v_BxTxKxH = lax.dynamic_update_slice_in_dim(cache.v_BxTxKxH, v_BxSxKxH.astype(cache.v_BxTxKxH.dtype), cache.offset, 1)
  att_BxSxNxH = jax.nn.dot_product_attention(
      q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, mask=cache.visible_Bx1xSxT, scale=scale, implementation="xla")
  return att_BxSxNxH, cache._replace(k_BxTxKxH=k_BxTxKxH, v_BxTxKxH=v_BxTxKxH)


def cache_positions(offset, start_B: jax.Array, seq: int) -> jax.Array:
  """Positions of the tokens in cache slots offset..offset+seq-1 of rows whose first token is in slot start_B."""
  return jnp.maximum(offset + jnp.arange(seq)[None, :] - start_B[:, None], 0)


class LayerMajorModel:
  """A GenerationModel (the contract above) built from Flax modules.

  Subclasses set `block` (one decoder layer, a linen Module over [B, S, D]) and `outer` (a linen Module with
  `embed(tokens) -> h` and `logits(h) -> logits`). Params are {"outer": ..., "layers": ...}, with every leaf of
  "layers" stacked on a leading axis of length num_layers, so any slice [i:j] is a group of consecutive layers.
  """

  block: type
  outer: type

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg

  # Pure math: a model is its family and config. Two objects of one config are the same model, so what is compiled
  # for one (sljax.schedule.shared_calls, functools caches) serves the other.
  def __eq__(self, other) -> bool:
    return type(self) is type(other) and self.cfg == other.cfg

  def __hash__(self) -> int:
    return hash((type(self), self.cfg))

  def without_remat(self) -> "LayerMajorModel":
    return type(self)(dataclasses.replace(self.cfg, remat=False))

  def init(self, key: jax.Array) -> Params:
    outer_key, layers_key = jax.random.split(key)
    return {"outer": self.init_outer(outer_key),
            "layers": self.init_layers(jax.random.split(layers_key, self.cfg.num_layers))}

  def init_outer(self, key: jax.Array):
    return self.outer(self.cfg).init(key, jnp.zeros((1, 1), jnp.int32))["params"]

  def init_layers(self, keys: jax.Array):
    """Params of len(keys) layers, stacked; init_layers(keys[i:j]) is layers i..j-1 of init_layers(keys)."""
    h_1x1xD = jnp.zeros((1, 1, self.cfg.hidden_size), self.cfg.dtype)
    return jax.vmap(lambda k: self.block(self.cfg).init(k, h_1x1xD)["params"])(keys)

  def embed(self, outer, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None) -> jax.Array:
    """Token (and, for OPT, position) embeddings; positions default to 0..S-1 in every row."""
    return self.outer(self.cfg).apply({"params": outer}, tokens_BxS, positions_BxS, method="embed")

  def layers(self, stacked, h_BxSxD: jax.Array) -> jax.Array:
    """Runs the layers whose params are stacked in `stacked` (any number of them), in order."""
    block = self.block(self.cfg)

    def one_layer(h, layer_params):
      return block.apply({"params": layer_params}, h), None

    if self.cfg.remat:
      one_layer = jax.checkpoint(one_layer, prevent_cse=False)
    h_BxSxD, _ = lax.scan(one_layer, h_BxSxD.astype(self.cfg.dtype), stacked)
    return h_BxSxD

  def init_cache(self, num_layers: int, batch: int, max_len: int) -> tuple[jax.Array, jax.Array]:
    """An empty KV cache for num_layers layers: (k, v), each [L, B, T, K, H] in the compute dtype."""
    shape = (num_layers, batch, max_len, self.cfg.kv_heads, self.cfg.head_dim)
    return jnp.zeros(shape, self.cfg.dtype), jnp.zeros(shape, self.cfg.dtype)

  def layers_cached(self, stacked, h_BxSxD: jax.Array, cache: tuple, offset, start_B: jax.Array):
    """`layers` for S new tokens that go into cache slots offset..offset+S-1, attending through the cache.

    cache: (k, v), each [L, B, T, K, H] for the layers in `stacked`. Row b's sequence starts at slot start_B[b]
    (prompts are left-padded), so its earlier slots are never attended to. Prefill is offset 0 with the whole prompt;
    decoding is one token at offset P + t. Returns (h, cache with the new keys and values written).
    """
    seq, max_len = h_BxSxD.shape[1], cache[0].shape[2]
    slot_S, slot_T = offset + jnp.arange(seq), jnp.arange(max_len)
    visible_BxSxT = (slot_T[None, None, :] <= slot_S[None, :, None]) & (slot_T[None, None, :] >= start_B[:, None, None])
    positions_BxS = cache_positions(offset, start_B, seq)
    block = self.block(self.cfg)

    def one_layer(h, layer):
      layer_params, k_BxTxKxH, v_BxTxKxH = layer
      h, cache = block.apply({"params": layer_params}, h,
                             KVCache(k_BxTxKxH, v_BxTxKxH, offset, positions_BxS, visible_BxSxT[:, None]))
      return h, (cache.k_BxTxKxH, cache.v_BxTxKxH)

    h_BxSxD, cache = lax.scan(one_layer, h_BxSxD.astype(self.cfg.dtype), (stacked, *cache))
    return h_BxSxD, cache

  def logits(self, outer, h_BxSxD: jax.Array) -> jax.Array:
    return self.outer(self.cfg).apply({"params": outer}, h_BxSxD, method="logits")

  def head_loss(self, outer, h_BxSxD, targets_BxS, weights_BxS) -> jax.Array:
    """Sum over tokens of weight x cross-entropy (fp32). Divide by the effective batch's total weight."""
    logits_BxSxV = self.logits(outer, h_BxSxD).astype(jnp.float32)
    losses_BxS = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, targets_BxS)
    return jnp.sum(losses_BxS * weights_BxS)

  def forward(self, params: Params, tokens_BxS: jax.Array) -> jax.Array:
    """Full-model logits: the three pieces composed."""
    h = self.layers(params["layers"], self.embed(params["outer"], tokens_BxS))
    return self.logits(params["outer"], h)

  def loss(self, params: Params, batch: dict) -> jax.Array:
    """The weighted mean of the token cross-entropies, sum(w x l) x (1 / sum(w)) for weights >= 0 (0 masks padding);
    0 for a batch whose weights are all 0. A product by the reciprocal (within an ulp of the quotient), as the engine
    computes it: each sub-batch's sum times one factor."""
    h = self.layers(params["layers"], self.embed(params["outer"], batch["inputs"]))
    total = self.head_loss(params["outer"], h, batch["targets"], batch["weights"])
    return total * (1 / loss_denominator(jnp.sum(batch["weights"])))


def loss_denominator(weight_sum):
  """What a weighted sum of token losses is divided by: the total weight, or 1 when it is 0 (then the sum is 0).
  Plain arithmetic, so numpy (the engine, on the host) and jax (`loss`) compute the same value."""
  return weight_sum + (weight_sum == 0)
