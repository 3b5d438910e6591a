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
# Rows, columns of each half that one program of dequantize_halves' GPU kernel writes, and its warps (None: Triton's
# default)
HALVES_BLOCK = (32, 256, None)


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
  if "halves" in packed:
    return dequantize_halves(packed, dtype)
  codes, scale_LxNxO = packed["codes"], packed["scale"]
  layers, rows, cols = codes.shape
  groups = scale_LxNxO.shape[1]
  w = codes.astype(jnp.float32).reshape(layers, groups, rows // groups, cols) * scale_LxNxO[:, :, None, :].astype(
      jnp.float32)
  return w.reshape(layers, rows, cols).astype(dtype)


def dequantize_halves(node: dict, dtype) -> jax.Array:
  """dequantize_kernel of pack_halves' layout, bit for bit: on a GPU one Pallas kernel per row block that writes both
  halves of its rows (where the blocks divide the kernel), else XLA's unpacking."""
  cols = _kernel_cols(node)
  if not cols:
    return dequantize_kernel(unpack_halves(node, jnp.int8), dtype)
  return dequantize_halves_kernel(node["halves"], node["scale"], dtype, HALVES_BLOCK[0], cols,
                                  num_warps=HALVES_BLOCK[2])


def dequantize_layer(stacked: dict, layer, dtype) -> dict:
  """Layer `layer` (may be traced) of a stack, every kernel dequantized, as leaves of one layer: what
  dequantize_layers(the layer's slice) gives, bit for bit, except that the GPU's kernel reads the bytes layout's codes
  in place in the stack (a slice before a custom call is a copy: 0.43 GB per llama70b layer)."""
  def one(node):
    if is_packed(node) and "halves" in node and (cols := _kernel_cols(node)):
      return dequantize_halves_kernel(node["halves"], node["scale"], dtype, HALVES_BLOCK[0], cols, layer=layer,
                                      num_warps=HALVES_BLOCK[2])
    sliced = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, layer, 1), node)
    return dequantize_kernel(sliced, dtype) if is_packed(node) else sliced
  return jax.tree.map(one, stacked, is_leaf=is_packed)


def _kernel_cols(node: dict) -> int:
  """The column block of the GPU's kernel for a pack_halves node, or 0 where XLA unpacks it (not a GPU, or the blocks
  do not divide the kernel or its scale groups)."""
  _, rows, half = node["halves"].shape
  group = rows // node["scale"].shape[1]
  cols = next((c for c in (HALVES_BLOCK[1] >> k for k in range(4)) if half % c == 0), 0)
  if jax.devices()[0].platform != "gpu" or rows % HALVES_BLOCK[0] or group % HALVES_BLOCK[0]:
    return 0
  return cols


def dequantize_halves_kernel(halves, scale, dtype, block_rows: int, block_cols: int, interpret: bool = False,
                             layer=None, num_warps: int | None = None):
  """dequantize_halves' GPU kernel (Pallas on Triton) with `block_rows` x `block_cols` of each half a program, on
  `num_warps` warps (None: Triton's default): every layer of the stack, or (`layer` given, may be traced) that one
  layer, read in place: [1, rows, out]. benchmarks/int4_matmul.py times block shapes against each other."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton

  layers, rows, half = halves.shape
  group = rows // scale.shape[1]
  scale = scale.reshape(layers, rows // group, 2, half)

  def dequantize(codes, low, high, out_ref):  # codes [R, C]; low, high [1, C]: the rows' group; out [R, 2, C]
    codes = codes.astype(jnp.int32)
    out_ref[:, 0, :] = (((codes & 0xF) - 8).astype(jnp.float32) * low.astype(jnp.float32)).astype(out_ref.dtype)
    out_ref[:, 1, :] = (((codes >> 4) - 8).astype(jnp.float32) * high.astype(jnp.float32)).astype(out_ref.dtype)

  # Each half's scales loaded by the ref's own indexing: Pallas' Triton lowering has no slice of a loaded value.
  if layer is None:
    def kernel(codes_ref, scale_ref, out_ref):  # blocks: codes [R, C]; scale [1, 2, C]
      dequantize(codes_ref[...], scale_ref[:, 0, :], scale_ref[:, 1, :], out_ref)

    grid, args = (layers, rows // block_rows, half // block_cols), (halves, scale)
    in_specs = [pl.BlockSpec((None, block_rows, block_cols), lambda l, i, j: (l, i, j)),
                pl.BlockSpec((None, 1, 2, block_cols), lambda l, i, j: (l, i * block_rows // group, 0, j))]
    out_spec = pl.BlockSpec((None, block_rows, 2, block_cols), lambda l, i, j: (l, i, 0, j))
    out_layers = layers
  else:
    def kernel(layer_ref, codes_ref, scale_ref, out_ref):  # the whole stack's refs, indexed at the layer
      l, i, j = layer_ref[0], pl.program_id(0), pl.program_id(1)
      r, c = pl.ds(i * block_rows, block_rows), pl.ds(j * block_cols, block_cols)
      g = pl.ds(i * block_rows // group, 1)
      dequantize(codes_ref[l, r, c], scale_ref[l, g, 0, c], scale_ref[l, g, 1, c], out_ref)

    grid, args = (rows // block_rows, half // block_cols), (jnp.asarray(layer, jnp.int32).reshape(1), halves, scale)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    in_specs = [whole((1,)), whole(halves.shape), whole(scale.shape)]
    out_spec = pl.BlockSpec((None, block_rows, 2, block_cols), lambda i, j: (0, i, 0, j))
    out_layers = 1

  out = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((out_layers, rows, 2, half), dtype), grid=grid, in_specs=in_specs,
      out_specs=out_spec, name="dequantize_halves",  # the kernel's name in a profile
      # Triton, as a GPU picks by default; also where it is only lowered
      compiler_params=pltriton.CompilerParams(num_warps=num_warps),
      interpret=interpret)(*args)
  return out.reshape(out_layers, rows, 2 * half)


def is_packed(node) -> bool:
  """A compressed kernel: {"codes", "scale"}, or int4 codes as bytes {"halves", "scale"} (pack_halves)."""
  return isinstance(node, dict) and set(node) in ({"codes", "scale"}, {"halves", "scale"})


# int4 codes as bytes, for a kernel dequantized whole in its own fusion (a training call's, where every call
# multiplies thousands of rows by it): XLA reads a native int4 array a value at a time there, at about a third of the
# HBM's rate (one llama70b layer 1.48 ms on the H200, benchmarks/results/int4_matmul_h200.json), while a byte holding
# column j's code and column j + out/2's unpacks into two contiguous halves of the row. A decode step's matmul reads
# native int4 straight into the dot instead, so generation keeps that layout.
def can_pack_halves(packed: dict) -> bool:
  return "codes" in packed and packed["codes"].dtype == jnp.int4 and packed["codes"].shape[-1] % 2 == 0


def pack_halves(packed: dict) -> dict:
  """Native int4 codes [L, I, O] as {"halves": uint8 [L, I, O/2], "scale"}: the low nibble holds column j's code
  + 8, the high nibble column j + O/2's. The same bytes as the native array."""
  codes = packed["codes"].astype(jnp.int8) + 8
  half = codes.shape[-1] // 2
  return {"halves": codes[..., :half].astype(jnp.uint8) | (codes[..., half:].astype(jnp.uint8) << 4),
          "scale": packed["scale"]}


def unpack_halves(node: dict, dtype=jnp.int4) -> dict:
  """pack_halves' inverse: {"codes": native int4 (or `dtype`), "scale"}."""
  halves = node["halves"]
  low, high = (halves & 0xF).astype(jnp.int8) - 8, (halves >> 4).astype(jnp.int8) - 8
  return {"codes": jnp.concatenate([low, high], axis=-1).astype(dtype), "scale": node["scale"]}


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
