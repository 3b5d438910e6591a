"""Group-wise int8 / int4 compression of layer weights, for streaming fewer bytes across PCIe.

Each matmul kernel of a layer stack, `[L, in, out]`, is split along its contraction axis (`in`) into groups of
`group_size` consecutive rows; every (group, output column) pair gets one float16 scale, the group's largest |w| over
the largest code (127 for int8, 7 for int4), and the codes are round(w / scale). int4 codes are a native `jnp.int4`
array, which XLA stores two to a byte (on the device and in pinned host memory alike) and can read straight into a
matmul when the call that multiplies by it dequantizes it. Leaves that are not kernels (norm scales, biases) stay as
they are: they are a few KB per layer and the models apply them in full precision.

Bytes per kernel value: int8 1 + 2/group_size, int4 0.5 + 2/group_size (bf16: 2). Error per value: at most half a
code step, |w - dequantize(quantize(w))| <= max|group| / (2 * code), plus the float16 rounding of the scale.
"""

import dataclasses

import jax
import jax.numpy as jnp

CODES = {8: 127, 4: 7}  # symmetric: int4 leaves -8 unused, so that 0 stays exact and the range is even
WEIGHT_BITS = (16, 8, 4)  # what a layer's weights may be kept as: the compute dtype, or int8 / int4 codes


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  bits: int = 8  # 8 or 4
  group_size: int = 128  # rows of the contraction axis sharing a scale (the largest divisor of that axis up to this)

  def __post_init__(self):
    if self.bits not in CODES:
      raise ValueError(f"bits must be 8 or 4, got {self.bits}")
    if self.group_size < 1:
      raise ValueError(f"group_size must be >= 1, got {self.group_size}")


def is_kernel(path, leaf) -> bool:
  """Matmul kernels of a layer stack: `[L, in, out]` leaves named kernel."""
  return leaf.ndim == 3 and getattr(path[-1], "key", None) == "kernel"


def group_rows(rows: int, group_size: int) -> int:
  """The group actually used for a contraction axis of `rows`: the largest divisor of it not above `group_size`."""
  return max(d for d in range(1, min(group_size, rows) + 1) if rows % d == 0)


def quantize_kernel(w_LxIxO: jax.Array, cfg: QuantConfig) -> dict:
  """{"codes": int8 or int4 [L, I, O], "scale": float16 [L, I/G, O]}."""
  layers, rows, cols = w_LxIxO.shape
  group = group_rows(rows, cfg.group_size)
  code = CODES[cfg.bits]
  w_LxNxGxO = w_LxIxO.astype(jnp.float32).reshape(layers, rows // group, group, cols)
  scale_LxNx1xO = (jnp.max(jnp.abs(w_LxNxGxO), axis=2, keepdims=True) / code).astype(jnp.float16)
  safe = jnp.where(scale_LxNx1xO > 0, scale_LxNx1xO, 1).astype(jnp.float32)
  codes = jnp.clip(jnp.round(w_LxNxGxO / safe), -code, code).astype(jnp.int8).reshape(layers, rows, cols)
  if cfg.bits == 4:
    codes = codes.astype(jnp.int4)
  return {"codes": codes, "scale": scale_LxNx1xO[:, :, 0, :]}


def dequantize_kernel(packed: dict, dtype) -> jax.Array:
  """The kernel in `dtype` from its codes and scales (in fp32, so that every product is exact before the cast)."""
  codes, scale_LxNxO = packed["codes"], packed["scale"]
  layers, rows, cols = codes.shape
  groups = scale_LxNxO.shape[1]
  w = codes.astype(jnp.float32).reshape(layers, groups, rows // groups, cols) * scale_LxNxO[:, :, None, :].astype(
      jnp.float32)
  return w.reshape(layers, rows, cols).astype(dtype)


def is_packed(node) -> bool:
  """A compressed kernel: {"codes", "scale"}."""
  return isinstance(node, dict) and set(node) == {"codes", "scale"}


def map_packed(fn, stacked: dict) -> dict:
  """`stacked` with fn applied to each compressed kernel; other leaves unchanged."""
  return jax.tree.map(lambda node: fn(node) if is_packed(node) else node, stacked, is_leaf=is_packed)


def quantize_layers(stacked: dict, cfg: QuantConfig) -> dict:
  """A layer stack with every kernel compressed (see the module docstring); other leaves unchanged."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: quantize_kernel(leaf, cfg) if is_kernel(path, leaf) else leaf, stacked)


def dequantize_layers(stacked: dict, dtype) -> dict:
  """The inverse, in `dtype`, for use inside a jitted call (so only the codes cross PCIe); a stack with nothing
  compressed comes back as it is."""
  return map_packed(lambda node: dequantize_kernel(node, dtype), stacked)
