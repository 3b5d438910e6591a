"""OPT in Flax: learned positions (offset 2), biases, ReLU MLP, pre- or post-LayerNorm, tied head.

Without per-layer remat, as LLaMA's layer (models/llama.py), the LayerNorms, ReLU's output (fc2's input) and the
reshape before out_proj are recomputed in the backward from what the matmuls and the attention keep anyway.
"""

import flax.linen as nn
import jax.numpy as jnp

from models.common import KVCache, LayerMajorModel, attention, cached_attention
from models.config import ModelConfig

_init = nn.initializers.normal(0.02)
POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (Hugging Face / metaseq convention)


class OPTBlock(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxSxD, cache: KVCache | None = None):
    """One layer over x; with a cache, x's tokens attend through it and (x, updated cache) is returned."""
    cfg = self.cfg
    dense = lambda features, name: nn.Dense(
        features, dtype=cfg.dtype, param_dtype=cfg.param_dtype, kernel_init=_init, name=name)
    recomputed = (lambda fn: fn) if cfg.remat else nn.remat
    norm = lambda name: recomputed(nn.LayerNorm)(cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)
    batch, seq, _ = x_BxSxD.shape
    n, h = cfg.num_heads, cfg.head_dim
    pre, post = cfg.layer_norm_before, not cfg.layer_norm_before

    y_BxSxD = norm("self_attn_layer_norm")(x_BxSxD) if pre else x_BxSxD
    q_BxSxNxH = dense(n * h, "q_proj")(y_BxSxD).reshape(batch, seq, n, h)
    k_BxSxNxH = dense(n * h, "k_proj")(y_BxSxD).reshape(batch, seq, n, h)
    v_BxSxNxH = dense(n * h, "v_proj")(y_BxSxD).reshape(batch, seq, n, h)
    if cache is None:
      att_BxSxNxH = attention(q_BxSxNxH, k_BxSxNxH, v_BxSxNxH, cfg)
    else:
      att_BxSxNxH, cache = cached_attention(q_BxSxNxH, k_BxSxNxH, v_BxSxNxH, cache)
    out = lambda block, att_BxSxNxH: dense(cfg.hidden_size, "out_proj")(att_BxSxNxH.reshape(batch, seq, n * h))
    x_BxSxD = x_BxSxD + recomputed(out)(self, att_BxSxNxH)
    x_BxSxD = norm("self_attn_layer_norm")(x_BxSxD) if post else x_BxSxD

    y_BxSxD = norm("final_layer_norm")(x_BxSxD) if pre else x_BxSxD
    h_BxSxF = dense(cfg.intermediate_size, "fc1")(y_BxSxD)
    down = lambda block, h_BxSxF: dense(cfg.hidden_size, "fc2")(nn.relu(h_BxSxF))
    x_BxSxD = x_BxSxD + recomputed(down)(self, h_BxSxF)
    x_BxSxD = norm("final_layer_norm")(x_BxSxD) if post else x_BxSxD
    return x_BxSxD if cache is None else (x_BxSxD, cache)


class OPTOuter(nn.Module):
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    embed = lambda rows, width: nn.Embed(
        rows, width, dtype=cfg.dtype, param_dtype=cfg.param_dtype, embedding_init=_init)
    project = lambda features: nn.Dense(
        features, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, kernel_init=_init)
    self.embed_tokens = embed(cfg.vocab_size, cfg.embed_dim)
    self.embed_positions = embed(cfg.max_positions + POSITION_OFFSET, cfg.hidden_size)
    if cfg.embed_dim != cfg.hidden_size:
      self.project_in = project(cfg.hidden_size)
      self.project_out = project(cfg.embed_dim)
    if cfg.layer_norm_before:
      self.final_layer_norm = nn.LayerNorm(cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)

  def embed(self, tokens_BxS, positions_BxS=None):
    """positions default to 0..S-1 in every row."""
    x_BxSxE = self.embed_tokens(tokens_BxS)
    x_BxSxD = self.project_in(x_BxSxE) if self.cfg.embed_dim != self.cfg.hidden_size else x_BxSxE
    if positions_BxS is None:
      positions_BxS = jnp.arange(tokens_BxS.shape[1])[None, :]
    return x_BxSxD + self.embed_positions(positions_BxS + POSITION_OFFSET)

  def logits(self, h_BxSxD):
    if self.cfg.layer_norm_before:
      h_BxSxD = self.final_layer_norm(h_BxSxD)
    h_BxSxE = self.project_out(h_BxSxD) if self.cfg.embed_dim != self.cfg.hidden_size else h_BxSxD
    return self.embed_tokens.attend(h_BxSxE)  # the head is tied to the token embedding

  def __call__(self, tokens_BxS):
    return self.logits(self.embed(tokens_BxS))


class OPT(LayerMajorModel):
  block = OPTBlock
  outer = OPTOuter
