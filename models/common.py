"""What every layer-major model shares: the three-piece interface, attention and the loss."""

import jax
import jax.numpy as jnp
import optax
from jax import lax

from models.config import ModelConfig

Params = dict  # {"outer": embeddings/norm/head params, "layers": per-layer params stacked on a leading L axis}


def attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, cfg: ModelConfig, scale: float | None = None):
  """Causal attention; K may divide N (grouped-query). cuDNN flash attention on GPU, plain XLA elsewhere."""
  implementation = cfg.attention
  if implementation == "auto":
    fast_dtype = q_BxSxNxH.dtype in (jnp.bfloat16, jnp.float16)
    implementation = "cudnn" if jax.default_backend() == "gpu" and fast_dtype else "xla"
  return jax.nn.dot_product_attention(
      q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, is_causal=True, scale=scale, implementation=implementation)


class LayerMajorModel:
  """A decoder-only LM cut into the three pieces a layer-major engine drives.

  Subclasses set `block` (one decoder layer, a linen Module over [B, S, D]) and `outer` (a linen Module with
  `embed(tokens) -> h` and `logits(h) -> logits`). Params are {"outer": ..., "layers": ...}, with every leaf of
  "layers" stacked on a leading axis of length num_layers, so any slice [i:j] is a group of consecutive layers.
  """

  block: type
  outer: type

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg

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

  def embed(self, outer, tokens_BxS: jax.Array) -> jax.Array:
    return self.outer(self.cfg).apply({"params": outer}, tokens_BxS, method="embed")

  def layers(self, stacked, h_BxSxD: jax.Array) -> jax.Array:
    """Runs the layers whose params are stacked in `stacked` (any number of them), in order."""
    block = self.block(self.cfg)

    def one_layer(h, layer_params):
      return block.apply({"params": layer_params}, h), None

    if self.cfg.remat:
      one_layer = jax.checkpoint(one_layer, prevent_cse=False)
    h_BxSxD, _ = lax.scan(one_layer, h_BxSxD.astype(self.cfg.dtype), stacked)
    return h_BxSxD

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
    """Mean token cross-entropy over the batch (weights mask padding)."""
    h = self.layers(params["layers"], self.embed(params["outer"], batch["inputs"]))
    total = self.head_loss(params["outer"], h, batch["targets"], batch["weights"])
    return total / jnp.maximum(jnp.sum(batch["weights"]), 1.0)
