"""LLaMA-2 in Flax: RMSNorm, rotary embeddings (Hugging Face convention), grouped-query attention, SwiGLU.

Without per-layer remat (cfg.remat false: the engines, whose tails keep each layer's residuals), the norms (and so
their outputs, the projections' inputs), SwiGLU's product (the down projection's input) and the reshape before the
output projection are recomputed in the backward from what the matmuls and the attention keep anyway: left to
autodiff, a layer keeps each norm's input in fp32, its unscaled output and its output, SwiGLU's sigmoid, silu and
product, and the attention's output twice. For one row of 2048 tokens at llama70b's widths (with LoRA adapters) that
is 0.95 GiB a layer, against 0.36 GiB so (tests/test_models.py counts them). The values are the same and no matmul
runs again; a backward reruns the norms and a few elementwise ops. With remat the whole layer is recomputed anyway,
and the layer is left as it was.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import KVCache, LayerMajorModel, attention, cached_attention
from models.config import ModelConfig

_init = nn.initializers.normal(0.02)


class RMSNorm(nn.Module):
  eps: float
  dtype: str
  param_dtype: str

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return weight.astype(self.dtype) * normed.astype(self.dtype)


def swiglu(gate_BxSxF, up_BxSxF):
  return nn.silu(gate_BxSxF) * up_BxSxF


def rotary(x_BxSxNxH: jax.Array, theta: float, positions_BxS: jax.Array | None = None) -> jax.Array:
  """Rotates pairs (i, i + H/2) by position-dependent angles, as Hugging Face's rotate_half does; positions default
  to 0..S-1 in every row."""
  seq, head_dim = x_BxSxNxH.shape[1], x_BxSxNxH.shape[3]
  if positions_BxS is None:
    positions_BxS = jnp.arange(seq)[None, :]
  inv_freq_F = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BxSxF = positions_BxS.astype(jnp.float32)[:, :, None] * inv_freq_F
  angles_BxSxH = jnp.concatenate([angles_BxSxF, angles_BxSxF], axis=-1)
  cos, sin = jnp.cos(angles_BxSxH)[:, :, None, :], jnp.sin(angles_BxSxH)[:, :, None, :]
  x1, x2 = jnp.split(x_BxSxNxH.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x_BxSxNxH * cos + rotated * sin).astype(x_BxSxNxH.dtype)


class LlamaBlock(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxSxD, cache: KVCache | None = None):
    """One layer over x; with a cache, x's tokens attend through it and (x, updated cache) is returned."""
    cfg = self.cfg
    dense = lambda features, name: nn.Dense(
        features, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, kernel_init=_init, name=name)
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name=name)
    # Each region's inputs are kept and the rest recomputed in the backward but the matmuls (see the module docstring)
    recomputed = (lambda fn: fn) if cfg.remat else nn.remat
    batch, seq, _ = x_BxSxD.shape
    n, k, h = cfg.num_heads, cfg.kv_heads, cfg.head_dim

    positions_BxS = None if cache is None else cache.positions_BxS

    def qkv(block, x_BxSxD):
      y_BxSxD = norm("input_layernorm")(x_BxSxD)
      return (dense(n * h, "q_proj")(y_BxSxD).reshape(batch, seq, n, h),
              dense(k * h, "k_proj")(y_BxSxD).reshape(batch, seq, k, h),
              dense(k * h, "v_proj")(y_BxSxD).reshape(batch, seq, k, h))

    q_BxSxNxH, k_BxSxKxH, v_BxSxKxH = recomputed(qkv)(self, x_BxSxD)
    q_BxSxNxH = rotary(q_BxSxNxH, cfg.rope_theta, positions_BxS)
    k_BxSxKxH = rotary(k_BxSxKxH, cfg.rope_theta, positions_BxS)
    if cache is None:
      att_BxSxNxH = attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, cfg)
    else:
      att_BxSxNxH, cache = cached_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, cache)
    out = lambda block, att_BxSxNxH: dense(cfg.hidden_size, "o_proj")(att_BxSxNxH.reshape(batch, seq, n * h))
    x_BxSxD = x_BxSxD + recomputed(out)(self, att_BxSxNxH)

    def gate_up(block, x_BxSxD):
      y_BxSxD = norm("post_attention_layernorm")(x_BxSxD)
      return dense(cfg.intermediate_size, "gate_proj")(y_BxSxD), dense(cfg.intermediate_size, "up_proj")(y_BxSxD)

    gate_BxSxF, up_BxSxF = recomputed(gate_up)(self, x_BxSxD)
    down = lambda block, gate_BxSxF, up_BxSxF: dense(cfg.hidden_size, "down_proj")(swiglu(gate_BxSxF, up_BxSxF))
    x_BxSxD = x_BxSxD + recomputed(down)(self, gate_BxSxF, up_BxSxF)
    return x_BxSxD if cache is None else (x_BxSxD, cache)


class LlamaOuter(nn.Module):
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed_tokens = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype, embedding_init=_init)
    self.norm = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype)
    self.lm_head = nn.Dense(
        cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, kernel_init=_init)

  def embed(self, tokens_BxS, positions_BxS=None):
    del positions_BxS  # LLaMA's positions enter through the rotary embeddings inside each block
    return self.embed_tokens(tokens_BxS)

  def logits(self, h_BxSxD):
    return self.lm_head(self.norm(h_BxSxD))

  def __call__(self, tokens_BxS):
    return self.logits(self.embed(tokens_BxS))


class Llama(LayerMajorModel):
  block = LlamaBlock
  outer = LlamaOuter
