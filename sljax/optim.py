"""AdamW with linear warmup, cosine or linear decay and global-norm clipping, the optimizer every engine uses; and
each preset's training recipe, from its paper."""

import dataclasses
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.config import ModelConfig
from models.presets import PRESETS

DecayShape = typing.Literal["cosine", "linear"]
DECAY_SHAPES = typing.get_args(DecayShape)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW hyperparameters and the learning-rate schedule.

  The schedule warms up linearly from 0 to `learning_rate` over `warmup_steps`, then decays (`decay_shape`: a cosine
  or a straight line) down to `min_lr_ratio * learning_rate` at `decay_steps` and stays there. `decay_steps=0` keeps
  the rate constant after warmup (sljax.launch fills in the run's steps instead). The defaults are llama-tiny's quick
  CPU recipe; RECIPES holds every preset's.
  """

  learning_rate: float = 3e-3  # peak learning rate
  warmup_steps: int = 20  # linear warmup steps
  decay_steps: int = 0  # steps until the rate reaches its floor; 0: constant after warmup
  decay_shape: DecayShape = "cosine"  # decay after warmup
  min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
  weight_decay: float = 0.1  # AdamW weight decay
  b1: float = 0.9  # Adam beta1
  b2: float = 0.95  # Adam beta2
  eps: float = 1e-8  # Adam epsilon
  grad_clip_norm: float = 1.0  # clip gradients to this global norm, 0: off
  moments_dtype: str = "float32"  # dtype of Adam's first moment (optax keeps the second in the params' dtype)

  def __post_init__(self):
    # Written so that NaN fails every check: a NaN learning rate would train, and save, an all-NaN model.
    if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
      raise ValueError(f"learning_rate must be positive and finite, got {self.learning_rate}")
    if self.warmup_steps < 0 or self.decay_steps < 0:
      raise ValueError(f"warmup_steps and decay_steps must be >= 0, got {self.warmup_steps}, {self.decay_steps}")
    if self.decay_steps and self.decay_steps <= self.warmup_steps:
      raise ValueError(f"decay_steps ({self.decay_steps}) must exceed warmup_steps ({self.warmup_steps})")
    if self.decay_shape not in DECAY_SHAPES:
      raise ValueError(f"decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
    for name, off in (("eps", ""), ("weight_decay", ""), ("grad_clip_norm", " (0: off)")):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0{off}, got {value}")
    try:
      floating = jnp.issubdtype(jnp.dtype(self.moments_dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise ValueError(f"moments_dtype must be a float dtype (float32, bfloat16), got {self.moments_dtype!r}")

  def describe(self) -> str:
    decay = (f"{self.decay_shape} to {self.min_lr_ratio:g}x at step {self.decay_steps}" if self.decay_steps
             else "then constant")
    clip = f"clip {self.grad_clip_norm:g}" if self.grad_clip_norm else "no clipping"
    return (f"AdamW lr {self.learning_rate:g}, {self.warmup_steps} warmup, {decay}; b1 {self.b1:g}, b2 {self.b2:g}, "
            f"eps {self.eps:g}, weight decay {self.weight_decay:g}, {clip}, {self.moments_dtype} first moment")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a preset is trained: its optimizer, the context it trains at, and the batch (None: the plan chooses it on
  the offload engine; DataConfig's otherwise)."""

  optim: OptimConfig
  seq_len: int
  batch_size: int | None
  source: str  # where the values come from


# LLaMA-2 (Touvron et al. 2023, section 2.2): the paper pretrained at 4096 tokens (--seq_len=4096 gives it); 2048 is
# the context the one-GPU runs and plans use.
_LLAMA2 = OptimConfig(learning_rate=3e-4, warmup_steps=2000, decay_shape="cosine", min_lr_ratio=0.1,
                      weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-5, grad_clip_norm=1.0)
# OPT (Zhang et al. 2022, section 2.2 and Table 1): 2000 warmup steps is OPT-175B's (the smaller models warmed up over
# 375M tokens), then a linear decay to 10% of the peak; the peak differs per size.
_OPT = OptimConfig(learning_rate=1.2e-4, warmup_steps=2000, decay_shape="linear", min_lr_ratio=0.1,
                   weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, grad_clip_norm=1.0)
_OPT_PEAKS = {"opt-125m": 6.0e-4, "opt-350m": 3.0e-4, "opt-1.3b": 2.0e-4, "opt-2.7b": 1.6e-4, "opt-6.7b": 1.2e-4,
              "opt-13b": 1.0e-4, "opt-30b": 1.0e-4, "opt-66b": 0.8e-4, "opt-175b": 1.2e-4}

RECIPES: dict[str, Recipe] = {
    # Quick on two CPU cores: `python train.py` goes from ~5.6 to ~2.2 in 300 steps.
    "llama-tiny": Recipe(OptimConfig(), seq_len=128, batch_size=8, source="sljax's CPU recipe"),
    "llama7b": Recipe(_LLAMA2, 2048, None, "LLaMA-2 paper"),
    "llama13b": Recipe(_LLAMA2, 2048, None, "LLaMA-2 paper"),
    "llama70b": Recipe(dataclasses.replace(_LLAMA2, learning_rate=1.5e-4), 2048, None, "LLaMA-2 paper"),
    **{name: Recipe(dataclasses.replace(_OPT, learning_rate=peak), 2048, None, "OPT paper")
       for name, peak in _OPT_PEAKS.items()},
}


def recipe_for(cfg: ModelConfig) -> str:
  """The preset whose recipe a model without a preset name (--hf_dir) trains with: its family's nearest in parameter
  count (in log scale)."""
  same_family = [name for name in RECIPES if PRESETS[name].family == cfg.family]
  return min(same_family, key=lambda name: abs(math.log(PRESETS[name].param_count() / cfg.param_count())))


def run_decay_steps(steps: int, warmup_steps: int, peak: float) -> tuple[int, str]:
  """(decay_steps, a note or "") for a run of `steps` that leaves --decay_steps unset. The warmup is the recipe's in
  steps whatever the run's length, and the rate decays over the rest of the run; a run that ends within the warmup
  does not decay (0) and never reaches the peak: it is the first `steps` of the long run's schedule, so a short smoke
  run shows the losses a long run starts with. (Warmup squeezed into half of a short run reached the peak within a
  few steps, where Adam's first updates move every weight by about the rate in the gradient's sign: llama13b at
  --steps=20 went from 11.43 to 18.71 at step 10.) A run of at least twice the warmup gets what it always got."""
  if steps > warmup_steps:
    return steps, ""
  last_rate = peak * (steps - 1) / warmup_steps  # update n runs at rate(n - 1)
  return 0, (f"note: --steps={steps} ends within the {warmup_steps} warmup steps: the learning rate rises to "
             f"{last_rate:.3g} by the last step ({last_rate / peak:.1%} of the peak {peak:g}) and no decay follows, "
             f"the first {steps} steps of a long run's schedule (--warmup_steps, --decay_steps set them)")


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  if not cfg.decay_steps:
    return optax.join_schedules([warmup, optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps])
  end, length = cfg.min_lr_ratio * cfg.learning_rate, cfg.decay_steps - cfg.warmup_steps
  decay = (optax.cosine_decay_schedule(cfg.learning_rate, length, alpha=cfg.min_lr_ratio) if cfg.decay_shape == "cosine"
           else optax.linear_schedule(cfg.learning_rate, end, length))
  return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, clip: bool = True) -> optax.GradientTransformation:
  """AdamW behind global-norm clipping; `clip=False` leaves the clipping to the caller (the offload engine clips
  over all layer groups itself, since it updates one group at a time)."""
  adamw = optax.adamw(
      learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
      mu_dtype=jnp.dtype(cfg.moments_dtype))
  if clip and cfg.grad_clip_norm:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
  return adamw


def check_per_parameter(optimizer: optax.GradientTransformation, layer_shapes, outer_shapes):
  """ValueError unless `optimizer` updates each parameter on its own, as an engine that updates one layer group at
  a time (and the embeddings + head apart) needs for its steps to be exact. The check is a probe, not a list of
  known transforms (a chain of per-parameter ones passes, a user's own global one fails): the model's trees with each
  axis cut to 2 (two layers, then the groups {layer 0} and {layer 1}), random params and gradients large enough that
  a norm-based transform acts, two updates of the whole model against the same updates of each part alone."""
  shrink = lambda tree, lead: jax.tree.map(lambda s: (2,) * len(s.shape) if lead else
                                           tuple(min(n, 2) for n in s.shape), tree)
  shapes = {"outer": shrink(outer_shapes, False), "layers": shrink(layer_shapes, True)}
  leaves, structure = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(0)
  draw = lambda scale: structure.unflatten([(scale * rng.standard_normal(s)).astype(np.float32) for s in leaves])
  params, gradients = draw(1.0), [draw(10.0), draw(10.0)]
  layer = lambda tree, i: jax.tree.map(lambda x: x[i:i + 1], tree)
  parts = [lambda tree: tree["outer"], lambda tree: layer(tree["layers"], 0), lambda tree: layer(tree["layers"], 1)]

  def updates(params, gradients):
    state, out = optimizer.init(params), []
    for grads in gradients:
      update, state = optimizer.update(grads, state, params)
      out.append(update)
    return out

  try:
    cpu = jax.local_devices(backend="cpu")[0]  # tiny arrays, op by op: no accelerator compiles or memory; this
    # process's own (jax.devices() lists every process's: on the second host [0] is the first host's)
  except RuntimeError:  # JAX_PLATFORMS leaves no CPU backend
    cpu = None
  try:
    with jax.default_device(cpu):
      whole = updates(params, gradients)
      alone = [updates(part(params), [part(g) for g in gradients]) for part in parts]
  except Exception as error:  # e.g. labels (optax.multi_transform) given as a tree of the whole model's structure
    raise ValueError(f"the optimizer cannot update a layer group alone ({type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else ''}); the engine updates one group at a time, "
                     f"so it needs a per-parameter optimizer (AdamW, SGD, Lion, ...)") from None
  for step in range(len(gradients)):
    for part, got in zip(parts, alone):
      want = part(whole[step])
      difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (np.abs(np.asarray(b)) + 1e-6)))
                       for a, b in zip(jax.tree.leaves(got[step]), jax.tree.leaves(want)))
      if difference > 1e-3:
        raise ValueError(
            f"the optimizer is not per-parameter: its update of one layer group alone differs from its update of "
            f"the whole model (by up to {difference:.0%} of an element), as a global transform's does "
            f"(optax.clip_by_global_norm, a global-norm scale); the engine updates one group at a time, so only "
            f"per-parameter optimizers (AdamW, SGD, Lion, ...) are exact: for global-norm clipping drop it from the "
            f"optimizer and set EngineConfig.grad_clip_norm (train.py --grad_clip_norm), which the engine computes "
            f"over all groups")
