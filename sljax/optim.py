"""AdamW with linear warmup, cosine or linear decay and global-norm clipping, the optimizer every engine uses, its
moments in fp32, bf16 (the first) or 8-bit block-wise codes (`scale_by_adam_8bit`); and each preset's training recipe,
from its paper."""

import dataclasses
import functools
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
INT8 = "int8"  # moments_dtype of the 8-bit moments


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
  # Adam's moments: float32 / bfloat16 the first moment's dtype (optax keeps the second in fp32); int8 both as 8-bit
  # codes with an fp32 scale per block of 256 (2 bytes per parameter instead of 8, each moment within 3.7%)
  moments_dtype: str = "float32"

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
    if not (floating or self.moments_dtype == INT8):
      raise ValueError(f"moments_dtype must be float32, bfloat16 (a float dtype) or int8, got {self.moments_dtype!r}")

  def describe(self) -> str:
    decay = (f"{self.decay_shape} to {self.min_lr_ratio:g}x at step {self.decay_steps}" if self.decay_steps
             else "then constant")
    clip = f"clip {self.grad_clip_norm:g}" if self.grad_clip_norm else "no clipping"
    moments = "8-bit moments" if self.moments_dtype == INT8 else f"{self.moments_dtype} first moment"
    return (f"AdamW lr {self.learning_rate:g}, {self.warmup_steps} warmup, {decay}; b1 {self.b1:g}, b2 {self.b2:g}, "
            f"eps {self.eps:g}, weight decay {self.weight_decay:g}, {clip}, {moments}")


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


# ---- 8-bit moments ---------------------------------------------------------------------------------------------

# Values along a parameter's last axis share a scale in blocks of this many (the last block of a row padded, in the
# computation only): small enough that a block spans a narrow range of magnitudes (neighbouring weights of one row,
# which see alike gradients), large enough that its fp32 scale costs 4/256 of a byte per value. The presets' widths
# are multiples of it. Blocks never cross the leading (layer) axis, so a layer group's state is the whole model's
# sliced, and each group updates alone.
MOMENT_BLOCK = 256


class Quantized(typing.NamedTuple):
  """One moment of one parameter as 8-bit codes (`LogCode`)."""

  codes: jax.Array  # the parameter's shape, int8 (signed) or uint8
  scales: jax.Array  # fp32, shape[:-1] + (blocks,): each block's largest magnitude


@dataclasses.dataclass(frozen=True)
class LogCode:
  """8-bit codes of magnitudes on a log scale relative to their block's largest (its scale): code k in 1..levels
  stands for scale * dynamic_range ** ((k - levels) / (levels - 1)), its sign the value's, and 0 for an exact 0.
  A magnitude in [scale / dynamic_range, scale] comes back within a factor exp(step / 2) of itself (`relative_error`
  bounds the difference), a smaller one as scale / dynamic_range: never 0, so a second moment never vanishes under
  its first (which would make Adam's update m / eps). A log scale, unlike a linear one, keeps a small value's
  relative error as small as the largest's, and is elementwise (no table to search)."""

  dtype: typing.Any  # int8: signed codes, 127 levels a sign; uint8: non-negative values, 255 levels
  dynamic_range: float

  @property
  def levels(self) -> int:
    return int(jnp.iinfo(self.dtype).max)

  @property
  def step(self) -> float:  # between neighbouring levels, in log of the magnitude
    return math.log(self.dynamic_range) / (self.levels - 1)

  @property
  def relative_error(self) -> float:
    return math.expm1(self.step / 2)

  # Jitted (inlined into a jitted caller): op by op, as check_per_parameter runs an optimizer, one compile per shape
  # instead of one per operation and shape (llama-tiny's probe after an fp32 one: 19 s to 3).
  @functools.partial(jax.jit, static_argnums=0)
  def quantize(self, x: jax.Array) -> Quantized:
    x_NxB = _blocks(x.astype(jnp.float32))
    scale_N = jnp.max(jnp.abs(x_NxB), axis=-1)
    ratio_NxB = jnp.abs(x_NxB) / jnp.where(scale_N > 0, scale_N, 1)[..., None]
    level = jnp.clip(self.levels + jnp.round(jnp.log(ratio_NxB) / self.step), 1, self.levels)
    codes_NxB = jnp.where(ratio_NxB > 0, jnp.sign(x_NxB) * level, 0).astype(self.dtype)
    return Quantized(_unblocks(codes_NxB, x.shape), scale_N)

  def zeros(self, shape: tuple[int, ...]) -> Quantized:
    """quantize(zeros(shape)), built directly: XLA would constant-fold that quantization at compile time (seconds a
    leaf on the GPU, minutes for llama13b's state)."""
    blocks = -(-(shape[-1] if shape else 1) // MOMENT_BLOCK)
    return Quantized(jnp.zeros(shape, self.dtype), jnp.zeros((*shape[:-1], blocks), jnp.float32))

  @functools.partial(jax.jit, static_argnums=0)
  def dequantize(self, q: Quantized) -> jax.Array:
    codes_NxB = _blocks(q.codes.astype(jnp.float32))
    magnitude_NxB = q.scales[..., None] * jnp.exp((jnp.abs(codes_NxB) - self.levels) * self.step)
    return _unblocks(jnp.sign(codes_NxB) * magnitude_NxB, q.codes.shape)


def _blocks(x: jax.Array) -> jax.Array:
  """x [..., n] (a scalar as [1]) as [..., blocks, MOMENT_BLOCK], zero-padded."""
  x = x.reshape(*x.shape[:-1], x.shape[-1] if x.ndim else 1)
  pad = -x.shape[-1] % MOMENT_BLOCK
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], x.shape[-1] // MOMENT_BLOCK, MOMENT_BLOCK)


def _unblocks(x_NxB: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The inverse of _blocks, back to `shape`."""
  x = x_NxB.reshape(*x_NxB.shape[:-2], -1)
  return x[..., :shape[-1] if shape else 1].reshape(shape)


# Ranges: an element whose gradient is 1e-4 of its block's largest keeps both moments (sqrt(v) spans what m does).
# Relative error: m 3.7%, v 3.7% (1.8% on sqrt(v), what the update divides by).
FIRST_MOMENT = LogCode(jnp.int8, 1e4)
SECOND_MOMENT = LogCode(jnp.uint8, 1e8)


class ScaleByAdam8bitState(typing.NamedTuple):
  count: jax.Array  # int32 []: updates so far, for the bias correction
  mu: optax.Updates  # the params' tree of Quantized: the first moment, FIRST_MOMENT's codes
  nu: optax.Updates  # the second moment, SECOND_MOMENT's codes


def scale_by_adam_8bit(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  """optax.scale_by_adam with both moments held as 8-bit codes between updates. Each update dequantizes them, runs
  optax's own Adam update in fp32, and requantizes the new moments; the update it returns is computed from the new
  moments before they are requantized, so a step equals optax.scale_by_adam's on the dequantized moments exactly."""
  adam = optax.scale_by_adam(b1, b2, eps)
  per_param = lambda fn, tree: jax.tree.map(fn, tree, is_leaf=lambda x: isinstance(x, Quantized))

  def quantized(state: optax.ScaleByAdamState) -> ScaleByAdam8bitState:
    return ScaleByAdam8bitState(state.count, per_param(FIRST_MOMENT.quantize, state.mu),
                                per_param(SECOND_MOMENT.quantize, state.nu))

  def init(params):
    zeros = lambda code: jax.tree.map(lambda p: code.zeros(p.shape), params)
    return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), zeros(FIRST_MOMENT), zeros(SECOND_MOMENT))  # optax's count

  def update(updates, state: ScaleByAdam8bitState, params=None):
    moments = optax.ScaleByAdamState(state.count, per_param(FIRST_MOMENT.dequantize, state.mu),
                                     per_param(SECOND_MOMENT.dequantize, state.nu))
    updates, moments = adam.update(updates, moments, params)
    return updates, quantized(moments)

  return optax.GradientTransformation(init, update)


@functools.lru_cache(maxsize=16)
def make_optimizer(cfg: OptimConfig, clip: bool = True) -> optax.GradientTransformation:
  """AdamW behind global-norm clipping; `clip=False` leaves the clipping to the caller (the offload engine clips
  over all layer groups itself, since it updates one group at a time). The chain is optax.adamw's, with the moments
  kept as `cfg.moments_dtype` says. One object per config: the plan and the step of a run (and every run of a config)
  share the calls jitted for it (sljax.schedule.shared_calls)."""
  adam = (scale_by_adam_8bit(cfg.b1, cfg.b2, cfg.eps) if cfg.moments_dtype == INT8 else
          optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps, mu_dtype=jnp.dtype(cfg.moments_dtype)))
  adamw = optax.chain(adam, optax.add_decayed_weights(cfg.weight_decay),
                      optax.scale_by_learning_rate(learning_rate_schedule(cfg)))
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
