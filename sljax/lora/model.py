"""LoRA adapters on any layer-major model whose layers are Flax linen modules (models.common.LayerMajorModel): each
targeted `nn.Dense` of a layer gets two more params beside its kernel, lora_a [in, r] and lora_b [r, out], and
computes y = x W + (alpha / r) (x A) B. The models' code is untouched: a Flax method interceptor adds the adapter
term to each Dense that carries one. `merge` folds the adapters into their kernels, so that the plain base model
computes the fine-tuned one.

The frozen base may hold its kernels as group-wise int8 / int4 codes with scales (`base_bits`, sljax.quant, as
generation compresses streamed layers): the layers dequantize them inside the call that runs them, so the model is
exactly the base model on the dequantized kernels, and only the adapters are trained.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from models.common import check_model, layer_compute_dtypes, loss_denominator
from sljax.quant import CODES, dequantize_layers

ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int = 16  # r: the adapters' inner width
  alpha: float = 16.0  # the adapter term is scaled by alpha / rank
  # Names of the Dense modules inside a layer that get adapters; () targets every one (all the projections).
  targets: tuple[str, ...] = ()
  # the frozen base's kernels as 8- or 4-bit group-wise codes with scales (QLoRA's base), dequantized inside each
  # layer call; 0: in the dtype the base model runs them in
  base_bits: int = 0

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
    if self.base_bits not in (0, *CODES):
      raise ValueError(f"--base_bits must be 8 or 4 (0: the base unquantized), got {self.base_bits}")
    if not math.isfinite(self.alpha) or self.alpha <= 0:
      raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def split_adapters(stacked) -> tuple[dict, dict]:
  """(base, adapters) of layer params that carry adapters: the adapters are the lora_a / lora_b leaves, each at its
  Dense's path; the base is everything else."""
  flat = traverse_util.flatten_dict(stacked)
  pick = lambda adapter: traverse_util.unflatten_dict({k: v for k, v in flat.items()
                                                       if (k[-1] in ADAPTER_LEAVES) == adapter})
  return pick(False), pick(True)


def join_adapters(base, adapters) -> dict:
  """Layer params with the adapters inserted beside the kernels they adapt (the inverse of split_adapters)."""
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **traverse_util.flatten_dict(adapters)})


class LoraModel:
  """`model` (a models.common.LayerMajorModel, or any model whose layers are linen modules applied inside its
  `layers` / `layers_cached`) with LoRA adapters in its layer params. The same contract as the model: params are
  {"outer", "layers"}, and "layers" holds the adapters beside the kernels (split_adapters takes them apart)."""

  def __init__(self, model, lora: LoraConfig):
    check_model(model)
    self.base, self.lora, self.cfg = model, lora, model.cfg

  def __eq__(self, other) -> bool:  # as its base model's: the same base and adapters are the same model
    return type(self) is type(other) and (self.base, self.lora) == (other.base, other.lora)

  def __hash__(self) -> int:
    return hash((type(self), self.base, self.lora))

  def without_remat(self) -> "LoraModel":
    return LoraModel(self.base.without_remat(), self.lora)

  def _targeted(self, path: tuple) -> bool:
    return path[-1] == "kernel" and (not self.lora.targets or path[-2] in self.lora.targets)

  def init_adapters(self, key: jax.Array, base_layers) -> dict:
    """Adapters for stacked base layer params (arrays or shapes): lora_a uniform in +-1/sqrt(in) (as PEFT's default
    init), lora_b zeros, so a fresh adapter leaves the model unchanged. fp32 whatever the base's dtype."""
    kernels = {path: x for path, x in traverse_util.flatten_dict(base_layers).items() if self._targeted(path)}
    names = sorted({path[-2] for path in traverse_util.flatten_dict(base_layers) if path[-1] == "kernel"})
    unknown = [name for name in self.lora.targets if name not in names]  # a typo would silently adapt less
    if unknown or not kernels:
      raise ValueError(f"no Dense module of the layers is named {', '.join(unknown)} (LoRA targets "
                       f"{', '.join(self.lora.targets)}): the layers' are {', '.join(names)}")
    adapters = {}
    for key_i, (path, kernel) in zip(jax.random.split(key, len(kernels)), kernels.items()):
      layers, fan_in, fan_out = kernel.shape
      bound = 1 / math.sqrt(fan_in)
      adapters[(*path[:-1], "lora_a")] = jax.random.uniform(key_i, (layers, fan_in, self.lora.rank), jnp.float32,
                                                            -bound, bound)
      adapters[(*path[:-1], "lora_b")] = jnp.zeros((layers, self.lora.rank, fan_out), jnp.float32)
    return traverse_util.unflatten_dict(adapters)

  def _adapt(self, next_fun, args, kwargs, context):
    """Adds (alpha / r) (x A) B to the output of each Dense that carries adapters, in the Dense's compute dtype."""
    y = next_fun(*args, **kwargs)
    module = context.module
    if (isinstance(module, nn.Dense) and context.method_name == "__call__"
        and module.has_variable("params", "lora_a")):
      a, b = (module.get_variable("params", name).astype(y.dtype) for name in ADAPTER_LEAVES)
      y = y + (self.lora.scale * ((args[0].astype(y.dtype) @ a) @ b)).astype(y.dtype)
    return y

  # ---- the model contract: the base model's pieces, its layers with the adapters applied -------------------------

  def init_outer(self, key):
    return self.base.init_outer(key)

  def init_layers(self, keys):
    base = self.base.init_layers(keys)
    return join_adapters(base, self.init_adapters(jax.random.fold_in(keys[0], 1), base))

  def init(self, key):
    outer_key, layers_key = jax.random.split(key)
    return {"outer": self.init_outer(outer_key),
            "layers": self.init_layers(jax.random.split(layers_key, self.cfg.num_layers))}

  def embed(self, outer, tokens_BxS, positions_BxS=None):
    return self.base.embed(outer, tokens_BxS, positions_BxS)

  def layers(self, stacked, h_BxSxD):
    """The base's layers with the adapters applied; compressed kernels (base_bits) dequantized here, in the call."""
    with nn.intercept_methods(self._adapt):
      return self.base.layers(dequantize_layers(stacked, self.cfg.dtype), h_BxSxD)

  def layers_cached(self, stacked, h_BxSxD, cache, offset, start_B):
    with nn.intercept_methods(self._adapt):
      return self.base.layers_cached(dequantize_layers(stacked, self.cfg.dtype), h_BxSxD, cache, offset, start_B)

  def init_cache(self, num_layers, batch, max_len):
    return self.base.init_cache(num_layers, batch, max_len)

  def head_loss(self, outer, h_BxSxD, targets_BxS, weights_BxS):
    return self.base.head_loss(outer, h_BxSxD, targets_BxS, weights_BxS)

  def logits(self, outer, h_BxSxD):
    return self.base.logits(outer, h_BxSxD)

  def loss(self, params, batch):
    """The weighted mean token loss, as models.common.LayerMajorModel.loss computes it (the plain step's)."""
    h = self.layers(params["layers"], self.embed(params["outer"], batch["inputs"]))
    total = self.head_loss(params["outer"], h, batch["targets"], batch["weights"])
    return total * (1 / loss_denominator(jnp.sum(batch["weights"])))

  def compute_dtypes(self, stacked):
    """The base's leaves in the dtypes the base model runs them in; adapters fp32 (cast inside each Dense)."""
    base, adapters = split_adapters(stacked)
    return join_adapters(layer_compute_dtypes(self.base, base), jax.tree.map(lambda x: jnp.dtype(x.dtype), adapters))


def merge(lora: LoraConfig, stacked) -> dict:
  """Layer params with each adapter folded into its kernel, W + (alpha / r) A B (in the kernel's dtype, computed in
  fp32): the base model's params, for export (models.hf) or for generating without the adapter term."""
  base, adapters = split_adapters(stacked)
  flat, updates = traverse_util.flatten_dict(base), traverse_util.flatten_dict(adapters)
  for path, a in updates.items():
    if path[-1] == "lora_a":
      kernel_path, b = (*path[:-1], "kernel"), updates[(*path[:-1], "lora_b")]
      kernel = flat[kernel_path]
      delta = lora.scale * jnp.einsum("lir,lro->lio", jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
      flat[kernel_path] = (jnp.asarray(kernel, jnp.float32) + delta).astype(kernel.dtype)
  return traverse_util.unflatten_dict(flat)
