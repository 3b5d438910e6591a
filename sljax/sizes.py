"""A model's sizes for the planners (training and generation), read from the shapes of its params: any model of the
contract in models.common plans, not only the presets. Loads no engine, so inference can use it."""

import dataclasses
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.common import check_model, layer_compute_dtypes
from sljax.memory import tree_bytes


@dataclasses.dataclass(frozen=True)
class ModelSizes:
  """What the planners need to know of a model, read from the shapes of its params (`model_sizes`)."""

  num_layers: int
  layer_params: int  # parameters in one decoder layer
  outer_params: int  # embeddings, final norm, head
  layer_master_bytes: int  # one layer's master weights (as init_layers makes them)
  outer_master_bytes: int
  layer_weight_bytes: int  # one layer's weights in the dtypes the engine runs them in (what crosses PCIe)
  separate_weights: bool  # those dtypes differ from the master's somewhere: host groups keep a second copy
  hidden: int  # D: the width of h_BxSxD between layers
  activation_itemsize: int  # bytes per element of h_BxSxD
  kv_bytes_per_token: int  # one layer's KV cache for one token of one row (0: the model does not generate)
  flops_per_token: Callable[[int], float]  # training model FLOPs per token at a sequence length
  # The master weights' shapes (jax.ShapeDtypeStruct trees): one layer's, stacked on a leading axis of 1, and the
  # embeddings' + head's; what an optimizer's state is sized from (sljax.plan.optimizer_state_bytes).
  layer_shapes: Any = dataclasses.field(compare=False)
  outer_shapes: Any = dataclasses.field(compare=False)

  def activation_bytes(self, rows: int, seq_len: int) -> int:
    return rows * seq_len * self.hidden * self.activation_itemsize


def model_sizes(model) -> ModelSizes:
  """Sizes of any models.common.TrainingModel from jax.eval_shape of its init_layers / init_outer / embed / layers
  (and init_cache, for a GenerationModel): nothing is allocated, no preset field is read. The FLOPs are the config's
  `flops_per_token(seq_len)` where it has one, else 6 x params + causal attention (6 L S D per token). Read once per
  model object while its cfg stays the same (or an equal) one: a plan asks for them at every layout it tries."""
  check_model(model)
  try:
    cfg, sizes = _SIZES[model]
    if cfg is model.cfg or cfg == model.cfg:
      return sizes
  except (KeyError, TypeError):  # not read yet, or a model that cannot be weakly referenced or hashed
    pass
  sizes = _read_sizes(model)
  try:
    _SIZES[model] = (model.cfg, sizes)
  except TypeError:
    pass
  return sizes


def stacked_layer_shapes(model, layers: int):
  """The shapes of model.init_layers of `layers` keys (each leaf stacked on a leading axis of `layers`), from
  model_sizes' one layer: no trace of the model's init."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((layers, *x.shape[1:]), x.dtype), model_sizes(model).layer_shapes)


_SIZES = weakref.WeakKeyDictionary()  # model -> (its cfg, its ModelSizes): each read traces its init and layers


def _read_sizes(model) -> ModelSizes:
  key = jax.random.key(0)
  layer = jax.eval_shape(lambda: model.init_layers(jax.random.split(key, 1)))
  outer = jax.eval_shape(model.init_outer, key)
  dtypes = layer_compute_dtypes(model, layer)
  weights = jax.tree.map(lambda x, dtype: jax.ShapeDtypeStruct(x.shape, dtype), layer, dtypes)
  h = jax.eval_shape(model.layers, weights, jax.eval_shape(model.embed, outer, jax.ShapeDtypeStruct((1, 1), jnp.int32)))
  kv_token = tree_bytes(jax.eval_shape(lambda: model.init_cache(1, 1, 1))) if hasattr(model, "init_cache") else 0
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  num_layers, layer_params, outer_params = model.cfg.num_layers, count(layer), count(outer)
  flops = getattr(model.cfg, "flops_per_token", None) or (
      lambda seq_len: 6 * (num_layers * layer_params + outer_params) + 6 * num_layers * seq_len * h.shape[-1])
  return ModelSizes(
      num_layers=num_layers, layer_params=layer_params, outer_params=outer_params,
      layer_master_bytes=tree_bytes(layer), outer_master_bytes=tree_bytes(outer),
      layer_weight_bytes=tree_bytes(weights),
      separate_weights=any(x.dtype != w.dtype for x, w in zip(jax.tree.leaves(layer), jax.tree.leaves(weights))),
      hidden=h.shape[-1], activation_itemsize=h.dtype.itemsize, kv_bytes_per_token=kv_token, flops_per_token=flops,
      layer_shapes=layer, outer_shapes=outer)
