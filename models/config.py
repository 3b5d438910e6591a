"""One frozen config for every decoder-only model sljax knows (LLaMA-2 and OPT)."""

import dataclasses
import math
import numbers

import jax.numpy as jnp

# Fields that count something, and the least each may be (word_embed_proj_dim 0: hidden_size).
COUNTS = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_layers": 1, "num_heads": 1,
          "num_kv_heads": 1, "max_positions": 1, "word_embed_proj_dim": 0}


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
    """ValueError (one line, naming the field) on a model no family can build: every CLI and library path makes
    its config here, so `--set num_layers=0` or `dtype=int8` is refused before anything is allocated."""
    if self.family not in ("llama", "opt"):
      raise ValueError(f"family must be 'llama' or 'opt', got {self.family!r}")
    for name, least in COUNTS.items():
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    for name in ("norm_eps", "rope_theta"):
      if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
        raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
    if self.attention not in ("auto", "cudnn", "xla"):
      raise ValueError(f"attention must be 'auto', 'cudnn' or 'xla', got {self.attention!r}")
    if self.family == "llama" and self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} (hidden_size / num_heads) must be even: rotary embeddings rotate "
                       f"pairs of it")
    for name in ("dtype", "param_dtype"):
      try:
        dtype = jnp.dtype(getattr(self, name))
      except TypeError:
        dtype = None
      if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise ValueError(f"{name} must be a float dtype (float32, bfloat16, float16), got {getattr(self, name)!r}")

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

  def layer_forward_flops(self, seq_len: int) -> float:
    """Forward FLOPs per token of one decoder layer: 2 x its params + causal attention (QK^T and AV: 2 matmuls x 2
    flops x seq x d, halved by the causal mask)."""
    return 2 * self.layer_param_count() + 2 * seq_len * self.hidden_size

  def flops_per_token(self, seq_len: int) -> float:
    """Training model FLOPs per token: 6 x matmul params + causal attention, i.e. forward and backward (twice the
    forward) of every layer and of the head (no recompute counted)."""
    return 3 * (self.num_layers * self.layer_forward_flops(seq_len) + 2 * self.vocab_size * self.embed_dim)


# The fields that fix the weights' shapes and structure, with num_heads (the layout of the attention kernels' columns):
# a saved model keeps them. max_positions is one only where there are position embeddings (OPT).
WEIGHT_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "word_embed_proj_dim", "layer_norm_before")


def saved_model_config(saved: dict, overrides: dict, where: str) -> ModelConfig:
  """The config of a saved model (`saved`: its fields, as a checkpoint's metadata holds them) with `overrides` (the
  --set fields) applied; ValueError (one line) when an override would change a field that shapes its weights (a
  truncated or misread model otherwise). Numerics (dtype, param_dtype, attention, norm_eps, rope_theta, remat) may
  change. `where` names the saved model in the message."""
  cfg = ModelConfig(**saved)
  shaping = WEIGHT_FIELDS + (("max_positions",) if cfg.family == "opt" else ())
  changed = [name for name in shaping if name in overrides and overrides[name] != getattr(cfg, name)]
  if changed:
    raise ValueError(f"--set {', '.join(f'{name}={overrides[name]}' for name in changed)}: {where} was saved with "
                     f"{', '.join(f'{name}={getattr(cfg, name)}' for name in changed)}, which shapes its weights; "
                     f"only fields that keep them (dtype, param_dtype, attention, ...) may be set on a saved model")
  return dataclasses.replace(cfg, **overrides)
