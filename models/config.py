"""One frozen config for every decoder-only model sljax knows (LLaMA-2 and OPT)."""

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder-only transformer.

  Fields that only one family reads say so; the rest mean the same in both.
  """

  family: str = "llama"  # "llama" or "opt"
  vocab_size: int = 256
  hidden_size: int = 256
  intermediate_size: int = 688
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2  # < num_heads: grouped-query attention (LLaMA only; OPT uses num_heads)
  max_positions: int = 512
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0  # LLaMA
  word_embed_proj_dim: int = 0  # OPT: embedding width when it differs from hidden_size (opt-350m); 0 = same
  layer_norm_before: bool = True  # OPT: pre-LayerNorm (False: post-LayerNorm, opt-350m)
  dtype: str = "bfloat16"  # compute dtype
  param_dtype: str = "float32"  # dtype of the master weights
  attention: str = "auto"  # "auto" (cuDNN flash attention on GPU with bf16/fp16, else XLA), "cudnn", "xla"
  remat: bool = True  # recompute each layer's activations in backward

  def __post_init__(self):
    if self.family not in ("llama", "opt"):
      raise ValueError(f"family must be 'llama' or 'opt', got {self.family!r}")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
    if self.attention not in ("auto", "cudnn", "xla"):
      raise ValueError(f"attention must be 'auto', 'cudnn' or 'xla', got {self.attention!r}")
    for name in ("dtype", "param_dtype"):
      jnp.dtype(getattr(self, name))  # raises on an unknown dtype name

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads if self.family == "llama" else self.num_heads

  @property
  def embed_dim(self) -> int:
    return self.word_embed_proj_dim or self.hidden_size

  def layer_param_count(self) -> int:
    """Parameters in one decoder layer."""
    d, f, kv = self.hidden_size, self.intermediate_size, self.kv_heads * self.head_dim
    if self.family == "llama":
      return d * d * 2 + 2 * d * kv + 3 * d * f + 2 * d
    return 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d

  def outer_param_count(self) -> int:
    """Parameters outside the decoder layers: embeddings, final norm, head."""
    d, e, v = self.hidden_size, self.embed_dim, self.vocab_size
    if self.family == "llama":
      return 2 * v * d + d
    projections = 2 * d * e if e != d else 0
    final_norm = 2 * d if self.layer_norm_before else 0
    return v * e + (self.max_positions + 2) * d + projections + final_norm

  def param_count(self) -> int:
    return self.outer_param_count() + self.num_layers * self.layer_param_count()

  def flops_per_token(self, seq_len: int) -> float:
    """Training model FLOPs per token: 6 x matmul params + causal attention (no recompute counted)."""
    d, v = self.hidden_size, self.vocab_size
    matmul_params = self.num_layers * (self.layer_param_count()) + v * self.embed_dim
    # QK^T and AV: 2 matmuls x 2 flops x seq x d per layer forward, halved by the causal mask; x3 for training.
    attention = 3 * self.num_layers * 2 * 2 * seq_len * d / 2
    return 6 * matmul_params + attention
