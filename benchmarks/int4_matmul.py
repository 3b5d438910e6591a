"""Where int4 decoding spends its time: one compressed matmul kernel against the same kernel in bf16, four ways.

  python -m benchmarks.int4_matmul --out=benchmarks/results/int4_matmul_h200.json   # llama70b's kernels, one GPU
  python -m benchmarks.int4_matmul --smoke --out=/tmp/int4_matmul_smoke.json         # tiny shapes, any machine

Per kernel shape [in, out] and rows (tokens of one decode step), each timed as the median of --repeats calls:
  bf16            x @ w, w resident in bf16: the memory-bound floor of an uncompressed decode step
  dequantize      sljax.quant.dequantize_kernel as its own call (what generation runs once per pass when several
  + dot           sub-batches share a group), and the matmul on its bf16 output: the two calls' sum
  fused_int4      both in one call on the stored codes, a native int4 array (what a decode pass runs when every row
                  is in one call): XLA may read the codes straight into the matmul
  fused_uint8     the same in one call on the layout generation stored before, two int4 codes a byte in uint8
                  (unpacked with shifts and masks): does the native array matter?
Bytes are those each call must read and write at least; `gb_per_s` is them over its time, `tflop_per_s` the matmul's.
All products are checked against each other (`max_abs_diff_vs_dequantize_dot`). `storage`: the device bytes a native
int4 code takes and its copy time from pinned host memory beside the uint8 layout's (is it packed?). `whole_layer`:
one llama70b layer dequantized as generation's prompt pass does it (sljax.quant.dequantize_layers, every kernel of
the layer in one jitted call), from native int4 and from the uint8 layout, beside the sum of its kernels' own calls:
does one call for the whole layer cost what its kernels cost alone? And the LoRA engine's layout of the same codes
(sljax.quant.pack_halves: a byte holds column j's code and column j + out/2's), dequantized by dequantize_layers (on a
GPU, one Pallas kernel) and by XLA's unpacking, each checked bit for bit against the native array's; and that kernel
at other block shapes (`halves_blocks`, --halves_blocks; the one in use is `halves_block_now`), read in place from a
stack of layers as the LoRA tail's calls read it.
"""

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.common import GENERATION_SMOKE, define_flags, provenance, write_results
from models.presets import build, get_config
from sljax.machines import configure_process
from sljax.memory import tree_bytes
from sljax.quant import CODES, HALVES_BLOCK, QuantConfig, dequantize_halves_kernel, dequantize_kernel, \
    dequantize_layer, dequantize_layers, is_packed, map_packed, pack_halves, quantize_kernel, quantize_layers, \
    unpack_halves

define_flags("Tiny kernels on CPU: checks every variant runs and agrees.")
flags.DEFINE_list("rows", ["32", "256"], "Tokens per call (a decode step's rows).")
flags.DEFINE_integer("repeats", 20, "Timed calls per variant (after one warm-up call).")
flags.DEFINE_integer("group_size", 128, "Rows of the contraction axis sharing a scale.")
flags.DEFINE_list("halves_blocks", ["32x256", "32x256x8", "64x256", "64x512", "128x256", "32x512", "32x1024",
                                    "64x1024x8", "128x512x8", "16x256"],
                  "Block shapes ROWSxCOLS[xWARPS] of dequantize_halves' GPU kernel to time on one llama70b layer read "
                  "in place from a stack (the LoRA tail's call), each checked bit for bit; a GPU only.")
FLAGS = flags.FLAGS
LLAMA70B_KERNELS = {"q_proj": (8192, 8192), "up_proj": (8192, 28672), "down_proj": (28672, 8192)}
SMOKE_KERNELS = {"up_proj": (64, 128)}


def uint8_pairs(packed: dict) -> dict:
  """Native int4 codes as two a byte, side by side along out (1..15: the code + 8)."""
  nibbles = (packed["codes"].astype(jnp.int8) + 8).astype(jnp.uint8)
  return {"codes": nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), "scale": packed["scale"]}


def dequantize_pairs(pairs: dict, dtype) -> jax.Array:
  codes = pairs["codes"]
  low, high = (codes & 0xF).astype(jnp.int8) - 8, (codes >> 4).astype(jnp.int8) - 8
  unpacked = jnp.stack([low, high], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
  return dequantize_kernel({"codes": unpacked, "scale": pairs["scale"]}, dtype)


def timed_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def measure(name: str, shape: tuple[int, int], rows: int) -> dict:
  k_in, k_out = shape
  w = (jax.random.normal(jax.random.key(0), (1, k_in, k_out), jnp.float32) * 0.02).astype(jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (rows, k_in), jnp.bfloat16)
  packed = jax.jit(lambda w: quantize_kernel(w, QuantConfig(bits=4, group_size=FLAGS.group_size)))(w)
  pairs = jax.jit(uint8_pairs)(packed)
  dot = jax.jit(lambda x, w: x @ w[0])
  dequantize = jax.jit(lambda p: dequantize_kernel(p, jnp.bfloat16))
  fused_int4 = jax.jit(lambda x, p: x @ dequantize_kernel(p, jnp.bfloat16)[0])
  fused_uint8 = jax.jit(lambda x, p: x @ dequantize_pairs(p, jnp.bfloat16)[0])
  dense = dequantize(packed)
  want = dot(x, dense).astype(jnp.float32)
  diff = lambda y: float(jnp.max(jnp.abs(y.astype(jnp.float32) - want)))
  act, out = rows * k_in * 2, rows * k_out * 2
  codes, scales = k_in * k_out // 2, packed["scale"].size * 2
  ms = {"bf16": timed_ms(dot, x, w), "dequantize": timed_ms(dequantize, packed), "dot": timed_ms(dot, x, dense),
        "fused_int4": timed_ms(fused_int4, x, packed), "fused_uint8": timed_ms(fused_uint8, x, pairs)}
  ms["dequantize+dot"] = ms["dequantize"] + ms["dot"]
  least_bytes = {"bf16": act + 2 * k_in * k_out + out, "dequantize": codes + scales + 2 * k_in * k_out,
                 "dot": act + 2 * k_in * k_out + out, "fused_uint8": act + codes + scales + out,
                 "fused_int4": act + codes + scales + out}
  least_bytes["dequantize+dot"] = least_bytes["dequantize"] + least_bytes["dot"]
  flop = 2 * rows * k_in * k_out
  return {"kernel": name, "shape": [k_in, k_out], "rows": rows, "group_size": FLAGS.group_size, "ms": ms,
          "least_bytes": least_bytes,
          "gb_per_s": {k: least_bytes[k] / (v * 1e-3) / 1e9 for k, v in ms.items()},
          "tflop_per_s": {k: flop / (v * 1e-3) / 1e12 for k, v in ms.items() if k != "dequantize"},
          "max_abs_diff_vs_dequantize_dot": {"fused_int4": diff(fused_int4(x, packed)),
                                             "fused_uint8": diff(fused_uint8(x, pairs)), "bf16": diff(dot(x, w))},
          "code_max": CODES[4]}


def storage(values: int) -> dict:
  """How a native int4 array of `values` codes is held: device bytes per value (the allocator's count; None where
  the backend keeps none) and its copy from pinned host memory, against the stored layout's uint8 of half as many."""
  device = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  in_use = lambda: (device.memory_stats() or {}).get("bytes_in_use")
  before = in_use()
  codes = jax.block_until_ready(jnp.zeros((values,), jnp.int4))
  after = in_use()
  out = {"values": values, "device_bytes_per_value": None if before is None else (after - before) / values}
  for name, x in (("int4", codes), ("uint8_pairs", jnp.zeros((values // 2,), jnp.uint8))):
    staged = jax.block_until_ready(jax.device_put(x, host))
    out[f"{name}_copy_ms"] = timed_ms(lambda y: jax.device_put(y, on_device), staged)
  del codes
  return out


def whole_layer(smoke: bool) -> dict:
  cfg = get_config("llama70b", dict(GENERATION_SMOKE["llama"] if smoke else {}, dtype="bfloat16",
                                    param_dtype="bfloat16"))
  model = build(cfg)
  layer = jax.jit(lambda key: jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                           model.init_layers(jax.random.split(key, 1))))(jax.random.key(2))
  native = jax.jit(lambda tree: quantize_layers(tree, QuantConfig(bits=4, group_size=FLAGS.group_size)))(layer)
  del layer
  kernels = [node for node in jax.tree.leaves(native, is_leaf=is_packed) if is_packed(node)]
  pairs = map_packed(uint8_pairs, native)
  one = jax.jit(lambda p: dequantize_kernel(p, jnp.bfloat16))
  ms = {"one_call_int4": timed_ms(jax.jit(lambda t: dequantize_layers(t, jnp.bfloat16)), native),
        "one_call_uint8": timed_ms(jax.jit(lambda t: map_packed(lambda n: dequantize_pairs(n, jnp.bfloat16), t)),
                                   pairs),
        "kernel_calls_int4": sum(timed_ms(one, kernel) for kernel in kernels)}
  # The LoRA engine's layout (sljax.quant.pack_halves): dequantize_layers picks the GPU's kernel where it runs; the
  # XLA unpacking of the same bytes beside it.
  halves = jax.jit(lambda t: map_packed(pack_halves, t))(native)
  dequantize = jax.jit(lambda t: dequantize_layers(t, jnp.bfloat16))
  xla = jax.jit(lambda t: map_packed(lambda n: dequantize_kernel(unpack_halves(n, jnp.int8), jnp.bfloat16), t))
  ms["one_call_halves"], ms["one_call_halves_xla"] = timed_ms(dequantize, halves), timed_ms(xla, halves)
  # The LoRA tail's calls: one layer (a traced index) of a stack, read in place (sljax.quant.dequantize_layer) or
  # sliced out first; a stack of two copies of the layer, index 1.
  stack = jax.tree.map(lambda x: jnp.concatenate([x, x]), halves)
  in_place = jax.jit(lambda t, i: dequantize_layer(t, i, jnp.bfloat16))
  sliced = jax.jit(lambda t, i: dequantize_layers(jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1), t),
                                                  jnp.bfloat16))
  index = jnp.int32(1)
  ms["stack_layer_in_place"] = timed_ms(lambda t: in_place(t, index), stack)
  ms["stack_layer_sliced"] = timed_ms(lambda t: sliced(t, index), stack)
  want = dequantize(native)
  same = lambda got: all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
  blocks = halves_blocks(stack, index, same, interpret=jax.devices()[0].platform != "gpu")
  return {"kernels": len(kernels), "codes_bytes": sum(tree_bytes(k["codes"]) for k in kernels), "ms": ms,
          "halves_blocks": blocks, "halves_block_now": "x".join(str(x) for x in HALVES_BLOCK if x),
          "halves_bit_equal": {"one_call_halves": same(dequantize(halves)), "one_call_halves_xla": same(xla(halves)),
                               "stack_layer_in_place": same(in_place(stack, index)),
                               "stack_layer_sliced": same(sliced(stack, index))}}


def halves_blocks(stack: dict, index, same, interpret: bool) -> dict:
  """{"ROWSxCOLS[xWARPS]": {"ms", "bit_equal"}, or None where the shape does not divide the layer's kernels} of
  --halves_blocks: layer `index` of `stack` dequantized by the GPU kernel at that block shape, every kernel of the
  layer in one call, as the LoRA tail's calls read it (interpret: Pallas' interpreter, off a GPU)."""
  out = {}
  for spec in FLAGS.halves_blocks:
    rows, cols, *warps = (int(x) for x in spec.split("x"))
    nodes = [node for node in jax.tree.leaves(stack, is_leaf=is_packed) if is_packed(node)]
    fits = lambda node: (node["halves"].shape[1] % rows == 0 and node["halves"].shape[2] % cols == 0
                         and (node["halves"].shape[1] // node["scale"].shape[1]) % rows == 0)
    if not all(fits(node) for node in nodes):
      out[spec] = None
      continue
    kernel = lambda n, i: dequantize_halves_kernel(n["halves"], n["scale"], jnp.bfloat16, rows, cols, interpret,
                                                   layer=i, num_warps=warps[0] if warps else None)
    call = jax.jit(lambda t, i: jax.tree.map(
        lambda n: kernel(n, i) if is_packed(n) else jax.lax.dynamic_slice_in_dim(n, i, 1), t, is_leaf=is_packed))
    out[spec] = {"ms": timed_ms(lambda t: call(t, index), stack), "bit_equal": same(call(stack, index))}
    print(f"dequantize_halves {spec}: {out[spec]}", flush=True)
  return out


def main(argv):
  del argv
  configure_process()
  kernels, rows = (SMOKE_KERNELS, [4]) if FLAGS.smoke else (LLAMA70B_KERNELS, [int(r) for r in FLAGS.rows])
  if FLAGS.smoke:
    FLAGS.repeats, FLAGS.halves_blocks = 2, ["8x16", "8x16x2", "7x16"]
  results = []
  for name, shape in kernels.items():
    for r in rows:
      results.append(measure(name, shape, r))
      ms = results[-1]["ms"]
      print(f"{name} {shape} x {r} rows: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
  held = storage(2**10 if FLAGS.smoke else 2**31)  # 2 Gi codes: 1 GiB as uint8 pairs
  print(f"storage: {held}", flush=True)
  layer = whole_layer(FLAGS.smoke)
  print(f"whole layer: {layer}", flush=True)
  write_results(FLAGS.out, {**provenance(), "smoke": FLAGS.smoke, "results": results, "storage": held,
                            "whole_layer": layer})


if __name__ == "__main__":
  app.run(main)
