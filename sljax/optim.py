"""AdamW with linear warmup, cosine decay and global-norm clipping: the optimizer every engine uses."""

import dataclasses

import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW hyperparameters and the learning-rate schedule.

  The schedule warms up linearly from 0 to `learning_rate` over `warmup_steps`, then follows a cosine down to
  `min_lr_ratio * learning_rate` at `decay_steps` and stays there. `decay_steps=0` keeps the rate constant after
  warmup (train.py fills in the run's --steps instead).
  """

  learning_rate: float = 3e-3  # suits llama-tiny; large models want ~3e-4 or less
  warmup_steps: int = 20
  decay_steps: int = 0
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip_norm: float = 1.0  # 0: no clipping
  moments_dtype: str = "float32"  # Adam's first moment (optax keeps the second in the params' dtype)

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
    if self.warmup_steps < 0 or self.decay_steps < 0:
      raise ValueError(f"warmup_steps and decay_steps must be >= 0, got {self.warmup_steps}, {self.decay_steps}")
    if self.decay_steps and self.decay_steps <= self.warmup_steps:
      raise ValueError(f"decay_steps ({self.decay_steps}) must exceed warmup_steps ({self.warmup_steps})")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
    if self.grad_clip_norm < 0:
      raise ValueError(f"grad_clip_norm must be >= 0 (0: off), got {self.grad_clip_norm}")
    jnp.dtype(self.moments_dtype)  # raises on an unknown dtype name


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  if cfg.decay_steps:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.decay_steps, end_value=cfg.min_lr_ratio * cfg.learning_rate)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps), optax.constant_schedule(cfg.learning_rate)],
      [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, clip: bool = True) -> optax.GradientTransformation:
  """AdamW behind global-norm clipping; `clip=False` leaves the clipping to the caller (the offload engine clips
  over all layer groups itself, since it updates one group at a time)."""
  adamw = optax.adamw(
      learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
      mu_dtype=jnp.dtype(cfg.moments_dtype))
  if clip and cfg.grad_clip_norm:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
  return adamw
