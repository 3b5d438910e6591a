"""Baseline for benchmarks.generate_throughput: the same workload through FlexGen (the `flexgen` 0.1.8 package: OPT
only, fp16), at its best setting on this machine, found by a sweep of its policy.

  python -m benchmarks.baselines.flexgen_generate --model=opt-66b \\
      --out=benchmarks/results/generate_opt-66b_flexgen_h200.json
  python -m benchmarks.baselines.flexgen_generate --model=opt-1.3b --out=/tmp/flexgen_opt-1.3b.json   # < 1 min
  python -m benchmarks.baselines.flexgen_generate --smoke --out=/tmp/flexgen_smoke.json   # tiny OPT, on CPU

Not part of sljax: FlexGen comes from .flexdeps/ through benchmarks/baselines/install_flexgen.sh and never enters
requirements.txt. The workload is generate_throughput's: random weights, prompts of --prompt_len random token ids,
greedy, exactly --new_tokens tokens per row; one warm-up generation (same batch and prompt, 2 new tokens), then one
timed. FlexGen times each token's pass over all layers: prefill_seconds is the first (the prompt pass, which yields
the first token), decode_seconds the rest; the tokens/s are generate_throughput's (prefill: batch x prompt_len /
prefill_seconds, decode: batch x (new_tokens - 1) / decode_seconds, generation: batch x new_tokens / both).

The sweep: each point is a FlexGen policy, named w<weights % on GPU>-c<KV cache % on GPU>-<gpu_batch_size>x<
num_gpu_batches>[-cpu_attention] (the rest of the weights and cache on the CPU, none on disk; activations on the GPU;
FlexGen's defaults otherwise: overlapped I/O, attention and MLP as separate layers, pinned weights, no compression).
Each point runs in its own subprocess (pinned host memory is not given back within a process, and a point that runs
out of memory or dies must not end the sweep); the JSON, rewritten after every point, holds all of them, each with
its status, and marks the fastest (generation_tokens_per_s). Before a point runs, its memory is worked out from
FlexGen's placement rule: a point whose GPU share (weights, KV cache, activations) exceeds --device_gib, or whose
host share (pinned weights, each rounded up to a power of two as torch's pinned allocator does, the copy threads'
pinned buffers, any KV cache on the CPU) exceeds --host_gib, is recorded as over budget and not run.

FlexGen places weights per layer: a weight goes to the GPU when the midpoint of its cumulative share of its layer
falls in the top w%. OPT's attention holds four equal matrices and its MLP two, so w steps in twelfths of the
decoder: w100 all, w85 11/12 (the query projections stay on the CPU), w65 7/12, w50 1/2. Every decode step copies
the CPU share over PCIe (~53 GB/s here) while the KV cache, FlexGen's fp16 (prompt_len + new_tokens - 1)-long
buffer per row, takes 1.19 GiB a row at OPT-66B: on an H200 the points trade the one for the other. The default
opt-66b sweep, best expected first: all weights on the GPU at 8 rows (one GPU batch, or two of 4), at 6 rows, 11/12
at 16 rows, and 7/12 at 40 rows (FlexGen's regime: large batches, most weights streamed). With the KV cache on the
CPU FlexGen computes attention there (-cpu_attention): at 64 rows ~400 GB go through host memory per decode step
(the cache, widened to fp32, then read), seconds a step on 16 cores, so no default point does;
--configs=w100-c0-16x4-cpu_attention runs one.

Patches to FlexGen 0.1.8, made at run time in the process that runs a point (install_flexgen.sh installs the wheel
unchanged):
  1. Random weights. FlexGen's dummy weights are np.ones arrays made on the host and copied to each weight's place
     (~130 GB of host writes and pageable copies in every OPT-66B point's start-up; and the workload's weights are
     random). `init_weight_list` is wrapped to mark the names it is given, and `TorchTensor.load_from_np_file` to
     draw marked weights in place instead of reading a file: norm weights 1, biases 0, the rest N(0, 0.02) (as the
     accelerate baseline), drawn on the GPU also for the weights FlexGen keeps in pinned host memory.
  2. No tokenizer. FlexGen's own benchmark entry (flex_opt.run_flexgen) fetches facebook/opt-30b's tokenizer from the
     hub to encode a fixed prompt; this script builds OptLM itself and gives `OptLM.generate` token ids.
  3. No GPU (--smoke without CUDA only): FlexGen's GPU is a second CPU device, torch.cuda.Stream/synchronize are
     no-ops, Tensor.cuda returns the tensor, pinned allocations are plain and the disk's copy threads (which pin 2 GiB
     each) are not started. Decode attention then takes FlexGen's CPU-attention path (it sees a cache not on CUDA).
No patch for torch 2, transformers 5 or numpy 2: of transformers FlexGen's modules import AutoTokenizer only, its
dtype tables key on numpy's scalar types (which numpy 2 keeps), and the smoke runs its generation loops on torch 2.13.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # models/ imports jax: keep it off the GPU that torch measures
# The all-on-GPU points leave a few GiB: segments that grow in place waste less of it than fixed-size ones.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import dataclasses
import json
import math
import re
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks.common import GENERATION_SMOKE, REPO, define_flags, provenance, write_results
from models.presets import get_config
from sljax.machines import GIB


def define_script_flags():
  """The script's flags, defined when it runs (not on import: the tests import it for its arithmetic beside
  other benchmarks that define the same names)."""
  flags.DEFINE_string("model", "opt-66b", "sljax OPT preset; FlexGen's config of the same name must match it.")
  flags.DEFINE_list("configs", [], "Sweep points in order, each in its own subprocess: w<weights % on GPU>-c<KV cache "
                    "% on GPU>-<gpu_batch_size>x<num_gpu_batches>[-cpu_attention] (empty: the model's default sweep).")
  flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per row.")
  flags.DEFINE_integer("new_tokens", 32, "Generated tokens per row.")
  flags.DEFINE_float("device_gib", 135, "GPU memory a point may need by the estimate (weights, KV cache, "
                     "activations).")
  flags.DEFINE_float("host_gib", 100, "Host memory a point's FlexGen allocations may need by the estimate (pinned "
                     "weights as allocated, the copy threads' pinned buffers, KV cache on the CPU).")
  flags.DEFINE_integer("config_timeout_s", 240, "A point's subprocess is killed after this long (recorded as such).")
  flags.DEFINE_string("run_config", "", "Run this one point in this process and write its result to --out (what the "
                      "sweep gives each of its subprocesses).")
  define_flags("Tiny OPT on CPU, FlexGen's CUDA calls stood in for where there is no GPU: checks the whole path, "
               "subprocesses, FlexGen's generation loops and the memory arithmetic included.",
               out="Write the results JSON here (rewritten after every point).")


FLAGS = flags.FLAGS

DEFAULT_SWEEPS = {
    "opt-66b": ["w100-c100-8x1", "w100-c100-4x2", "w100-c100-6x1", "w85-c100-8x2", "w65-c100-10x4",
                "w100-c100-32x2-w4", "w100-c100-64x4-w4-kv4", "w100-c100-96x2-w4-kv4"],
    "opt-1.3b": ["w100-c100-32x1", "w50-c100-16x2"],
}
SMOKE_SWEEP = ["w100-c100-2x1", "w50-c100-2x2"]
COPY_THREADS = 4  # FlexGen's TorchDisk default; each thread pins a relay buffer of 1 Gi fp16 elements
RELAY_BYTES = 2 * GIB
FP16_BYTES = 2
# FlexGen's 4-bit compression (groups of 64, an fp16 minimum and scale per group): bytes per fp16 byte.
COMPRESSED_RATIO = (0.5 + 2 * FP16_BYTES / 64) / FP16_BYTES
WEIGHTS_NOTE = ("random fp16 (norms 1, biases 0, the rest N(0, 0.02)), every tensor distinct, drawn on the GPU; "
                "FlexGen keeps its own copy of the output embedding")


@dataclasses.dataclass(frozen=True)
class SweepPoint:
  """One FlexGen policy of the sweep; the weights and cache not on the GPU are on the CPU."""

  weights_gpu_percent: int
  cache_gpu_percent: int
  gpu_batch_size: int
  num_gpu_batches: int
  cpu_attention: bool = False  # FlexGen's cpu_cache_compute: decode attention on the CPU, beside a CPU cache
  compress_weight: bool = False  # FlexGen's group-wise 4-bit weights (groups of 64, asymmetric)
  compress_cache: bool = False  # the same for its KV cache

  @property
  def batch(self) -> int:
    return self.gpu_batch_size * self.num_gpu_batches

  @property
  def name(self) -> str:
    return (f"w{self.weights_gpu_percent}-c{self.cache_gpu_percent}-{self.gpu_batch_size}x{self.num_gpu_batches}"
            + ("-cpu_attention" if self.cpu_attention else "") + ("-w4" if self.compress_weight else "")
            + ("-kv4" if self.compress_cache else ""))

  @classmethod
  def parse(cls, name: str) -> "SweepPoint":
    match = re.fullmatch(r"w(\d+)-c(\d+)-(\d+)x(\d+)(-cpu_attention)?(-w4)?(-kv4)?", name)
    if not match:
      raise ValueError(f"config {name!r} is not w<0-100>-c<0-100>-<gpu_batch_size>x<num_gpu_batches>"
                       "[-cpu_attention][-w4][-kv4]")
    weights, cache, size, batches = (int(group) for group in match.groups()[:4])
    if weights > 100 or cache > 100 or not size or not batches:
      raise ValueError(f"config {name!r}: percentages go to 100, batch sizes and counts from 1")
    return cls(weights, cache, size, batches, *(bool(match.group(i)) for i in (5, 6, 7)))


def check_supported(cfg):
  """FlexGen's OPT: pre-LayerNorm, an MLP 4x as wide as the model, embeddings as wide as the model."""
  if cfg.family != "opt" or not cfg.layer_norm_before or cfg.embed_dim != cfg.hidden_size or (
      cfg.intermediate_size != 4 * cfg.hidden_size):
    raise ValueError("FlexGen runs OPT models with pre-LayerNorm, intermediate_size = 4 x hidden_size and no "
                     "embedding projection (not opt-350m, not LLaMA)")


def flexgen_fields(cfg) -> dict:
  """The sljax config as FlexGen's OptConfig fields."""
  return dict(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size, input_dim=cfg.hidden_size,
              n_head=cfg.num_heads, ffn_embed_dim=cfg.intermediate_size, vocab_size=cfg.vocab_size,
              max_seq_len=cfg.max_positions)


def weight_shapes(cfg) -> list[list[tuple[int, ...]]]:
  """FlexGen's OPT weights, one list per FlexGen layer (the input embedding, each decoder layer's attention and its
  MLP apart, the output embedding with its own copy of the token embedding), each in the order FlexGen places it."""
  h = cfg.hidden_size
  attention = [(h, h), (h,)] * 4 + [(h,), (h,)]  # q, k, v, out projections with biases; LayerNorm
  mlp = [(4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,)]
  return ([[(cfg.vocab_size, h), (cfg.max_positions + 2, h)]] + [attention, mlp] * cfg.num_layers
          + [[(h,), (h,), (cfg.vocab_size, h)]])


def on_gpu(shapes: list[tuple[int, ...]], gpu_percent: float) -> list[bool]:
  """Which of one layer's weights FlexGen puts on the GPU: those whose midpoint, as a share of the layer's size, lies
  in the top gpu_percent (the rest go to the CPU)."""
  sizes = [math.prod(shape) for shape in shapes]
  ends = np.cumsum(sizes)
  return [(end - size / 2) / ends[-1] * 100 >= 100 - gpu_percent for size, end in zip(sizes, ends)]


def pinned_size(nbytes: int) -> int:
  """What torch's caching pinned allocator takes for a tensor: the next power of two."""
  return 1 << (nbytes - 1).bit_length()


def memory(cfg, point: SweepPoint, prompt_len: int, new_tokens: int) -> dict:
  """Bytes a point needs where: the weights as FlexGen places them, its KV cache, and an estimate of the largest
  activations (the prompt pass of one GPU batch) plus the streamed weights of two layers in flight."""
  weights_gpu = weights_cpu = pinned = streamed = 0
  for shapes in weight_shapes(cfg):
    layer_cpu = 0
    for shape, gpu in zip(shapes, on_gpu(shapes, point.weights_gpu_percent)):
      nbytes = FP16_BYTES * math.prod(shape)
      if point.compress_weight and len(shape) >= 2:  # FlexGen compresses matrices only
        nbytes = int(nbytes * COMPRESSED_RATIO)
      if gpu:
        weights_gpu += nbytes
      else:
        weights_cpu, layer_cpu, pinned = weights_cpu + nbytes, layer_cpu + nbytes, pinned + pinned_size(nbytes)
    streamed = max(streamed, layer_cpu)
  heads, rows = cfg.num_heads, point.gpu_batch_size
  heads_on_gpu = int(rows * heads * point.cache_gpu_percent / 100) // heads * heads  # FlexGen rounds to whole rows
  slot = cfg.num_layers * point.num_gpu_batches * 2 * (prompt_len + new_tokens - 1) * cfg.head_dim * FP16_BYTES
  slot = int(slot * COMPRESSED_RATIO) if point.compress_cache else slot
  hidden = rows * prompt_len * cfg.hidden_size * FP16_BYTES
  scores = rows * heads * prompt_len * prompt_len * FP16_BYTES
  attention = 8 * hidden + 3 * scores  # norm, q, k, v, the new cache entries, output, residual; scores thrice
  mlp = 2 * hidden + 4 * hidden  # norm and output; the 4x-wide inner activation
  logits = hidden + rows * prompt_len * cfg.vocab_size * FP16_BYTES  # the prompt pass scores every position
  activations = max(attention, mlp, logits) + (point.num_gpu_batches + 1) * hidden + 2 * streamed
  workspace = 2 * (prompt_len + new_tokens - 1) * rows * cfg.hidden_size * 4 if point.cpu_attention else 0
  kv_gpu, kv_cpu = slot * heads_on_gpu, slot * (rows * heads - heads_on_gpu)
  return {"weights_gpu_bytes": weights_gpu, "weights_cpu_bytes": weights_cpu, "weights_pinned_bytes": pinned,
          "kv_cache_gpu_bytes": kv_gpu, "kv_cache_cpu_bytes": kv_cpu, "activation_bytes": activations,
          "device_bytes": weights_gpu + kv_gpu + activations,
          "host_bytes": pinned + COPY_THREADS * RELAY_BYTES + kv_cpu + workspace}


def over_budget(needed: dict, device_bytes: int, host_bytes: int) -> str:
  """Why a point cannot run within the budgets ("" if it can)."""
  reasons = [f"{what} needs {needed[key] / GIB:.1f} GiB > {budget / GIB:.1f} GiB"
             for what, key, budget in (("GPU", "device_bytes", device_bytes), ("host", "host_bytes", host_bytes))
             if needed[key] > budget]
  return "; ".join(reasons)


def failure(returncode: int, output: str) -> dict:
  """The status of a point's subprocess that wrote no result."""
  lines = [line for line in output.strip().splitlines() if line.strip()]
  if "out of memory" in output.lower() or "cannot allocate memory" in output.lower():
    status = "out_of_memory"
  elif returncode in (-9, 137):
    status = "killed"  # SIGKILL from outside: the kernel's OOM killer, when host memory runs out
  else:
    status = "failed"
  return {"status": status, "returncode": returncode, "error": lines[-1][:300] if lines else "",
          "output_tail": lines[-30:]}


def model_config(name: str, smoke: bool):
  overrides = dict(dtype="float16", param_dtype="float16")
  if smoke:
    smoke_shapes = GENERATION_SMOKE["opt"]
    overrides.update(smoke_shapes, intermediate_size=4 * smoke_shapes["hidden_size"])  # FlexGen's MLP is 4x wide
  cfg = get_config(name, overrides)
  check_supported(cfg)
  return cfg


# ----------------------------------------------------------------------------------------------- one point, in process
def patch_flexgen(flex_opt, pytorch_backend, draw_device: str):
  """Patch 1 of the docstring: weights drawn at random in place."""
  import torch

  marker = "_random_weights_"
  init_weight_list = flex_opt.init_weight_list
  load_from_np_file = pytorch_backend.TorchTensor.load_from_np_file

  def init_marked(weight_specs, policy, env):
    return init_weight_list([(shape, dtype, filename.replace(flex_opt.DUMMY_WEIGHT, marker))
                             for shape, dtype, filename in weight_specs], policy, env)

  def load_or_draw(tensor, filename):
    if marker not in filename:
      return load_from_np_file(tensor, filename)
    if isinstance(tensor.data, tuple):  # compressed (codes, per-group minimum and scale): random codes, small scales
      codes, ranges = tensor.data[0].data, tensor.data[1].data
      codes.copy_(torch.randint(0, 256, codes.shape, dtype=codes.dtype, device=draw_device))
      ranges.fill_(0.01)
      return None
    if not isinstance(tensor.data, torch.Tensor):
      raise NotImplementedError(f"random weights on FlexGen's {tensor.device.name} device")
    name = os.path.basename(filename)  # decoder.layers.3.fc1.weight, decoder.layer_norm.bias, ...
    if "norm" in name and name.endswith("weight"):
      tensor.data.fill_(1)
    elif name.endswith("bias"):
      tensor.data.zero_()
    elif tensor.data.device.type == draw_device:
      tensor.data.normal_(0, 0.02)
    else:  # pinned host memory: drawn on the GPU, then copied
      tensor.data.copy_(torch.empty_like(tensor.data, device=draw_device).normal_(0, 0.02))

  flex_opt.init_weight_list = init_marked
  pytorch_backend.TorchTensor.load_from_np_file = load_or_draw


def stand_in_for_cuda(pytorch_backend):
  """Patch 3 of the docstring, for a machine without a GPU."""
  import torch

  torch.cuda.Stream = lambda *args, **kwargs: None  # torch.cuda.stream(None) is a no-op context
  torch.cuda.synchronize = lambda *args, **kwargs: None
  torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
  allocate = pytorch_backend.TorchDevice.allocate
  pytorch_backend.TorchDevice.allocate = (
      lambda device, shape, dtype, pin_memory=None, name=None: allocate(device, shape, dtype, False, name))


def placed_bytes(model, env) -> dict:
  """Bytes of weights FlexGen put on its GPU and its CPU device, counted from the model."""
  placed = {"gpu": 0, "cpu": 0}
  for home in model.weight_home:
    for weight in home.val:
      placed["gpu" if weight.device is env.gpu else "cpu"] += int(weight.bytes)
  return placed


def run_point(cfg, point: SweepPoint, prompt_len: int, new_tokens: int, smoke: bool) -> dict:
  """Builds FlexGen's OPT with this point's policy, warms up and times one generation; the figures."""
  import torch
  from flexgen import flex_opt, pytorch_backend
  from flexgen.compression import CompressionConfig
  from flexgen.opt_config import get_opt_config
  from flexgen.timer import timers

  cuda = torch.cuda.is_available()
  if smoke:
    opt_config = dataclasses.replace(get_opt_config("opt-125m"), name=f"{FLAGS.model}-smoke", **flexgen_fields(cfg))
  else:
    opt_config = get_opt_config(FLAGS.model)
    differ = {k: (getattr(opt_config, k), v) for k, v in flexgen_fields(cfg).items() if getattr(opt_config, k) != v}
    if differ:
      raise SystemExit(f"FlexGen's {FLAGS.model} differs from sljax's (FlexGen, sljax): {differ}")
  if not cuda:
    if not smoke:
      raise SystemExit("FlexGen needs a CUDA GPU (--smoke runs on the CPU)")
    stand_in_for_cuda(pytorch_backend)
  patch_flexgen(flex_opt, pytorch_backend, draw_device="cuda" if cuda else "cpu")
  torch.manual_seed(0)

  policy = flex_opt.Policy(
      gpu_batch_size=point.gpu_batch_size, num_gpu_batches=point.num_gpu_batches,
      w_gpu_percent=point.weights_gpu_percent, w_cpu_percent=100 - point.weights_gpu_percent,
      cache_gpu_percent=point.cache_gpu_percent, cache_cpu_percent=100 - point.cache_gpu_percent,
      act_gpu_percent=100, act_cpu_percent=0, overlap=True, sep_layer=True, pin_weight=True,
      cpu_cache_compute=point.cpu_attention, attn_sparsity=1.0,
      compress_weight=point.compress_weight, comp_weight_config=CompressionConfig(num_bits=4, group_size=64, group_dim=0,
                                                                  symmetric=False),
      compress_cache=point.compress_cache, comp_cache_config=CompressionConfig(num_bits=4, group_size=64, group_dim=2,
                                                                symmetric=False))
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (point.batch, prompt_len))
  prompts[prompts == opt_config.pad_token_id] += 1  # FlexGen masks its pad id as padding: these prompts have none
  figures = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA: FlexGen's CUDA calls stood in for)",
             "policy": dataclasses.asdict(policy),
             "flexgen_config": {k: getattr(v, "__name__", v) for k, v in dataclasses.asdict(opt_config).items()}}
  phase = "init"
  with tempfile.TemporaryDirectory() as offload_dir:
    gpu, cpu = pytorch_backend.TorchDevice("cuda:0" if cuda else "cpu"), pytorch_backend.TorchDevice("cpu")
    disk = pytorch_backend.TorchDisk(offload_dir, num_copy_threads=COPY_THREADS if cuda else 0)
    env = flex_opt.ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=pytorch_backend.TorchMixedDevice([gpu, cpu, disk]))
    try:
      start = time.perf_counter()
      model = flex_opt.OptLM(opt_config, env, os.path.join(offload_dir, flex_opt.DUMMY_WEIGHT), policy)
      env.gpu.synchronize()
      figures.update(init_seconds=time.perf_counter() - start, weights_placed_bytes=placed_bytes(model, env))
      phase = "warmup"
      start = time.perf_counter()
      model.generate(prompts, max_new_tokens=min(2, new_tokens))
      figures["warmup_seconds"] = time.perf_counter() - start
      phase = "timed"
      timers("generate").reset()
      start = time.perf_counter()
      out = model.generate(prompts, max_new_tokens=new_tokens)
      wall = time.perf_counter() - start
    except torch.cuda.OutOfMemoryError as error:
      return {**figures, "status": "out_of_memory", "phase": phase, "error": str(error).splitlines()[0][:300]}
    finally:
      env.close_copy_threads()  # FlexGen's copy threads are not daemons: the process would not exit
  costs = timers("generate").costs
  prefill, decode = costs[0], sum(costs[1:])
  batch = point.batch
  figures.update(
      status="ok", batch=batch, prefill_seconds=prefill, decode_seconds=decode, total_seconds=prefill + decode,
      wall_seconds=wall, prefill_tokens_per_s=batch * prompt_len / prefill,
      decode_tokens_per_s=batch * (new_tokens - 1) / decode if new_tokens > 1 else None,
      generation_tokens_per_s=batch * new_tokens / (prefill + decode),
      decode_step_seconds=costs[1:], first_tokens=out[:2, prompt_len:].tolist(),
      peak_host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
  if cuda:
    figures.update(peak_device_allocated_bytes=torch.cuda.max_memory_allocated(),
                   peak_device_reserved_bytes=torch.cuda.max_memory_reserved(),
                   device_total_bytes=torch.cuda.mem_get_info()[1])
  print(f"{point.name}: prefill {figures['prefill_tokens_per_s']:.0f} tok/s, decode "
        f"{figures['decode_tokens_per_s'] or 0:.1f} tok/s, overall {figures['generation_tokens_per_s']:.1f} tok/s",
        flush=True)
  return figures


# --------------------------------------------------------------------------------------------------------- the sweep
def run_in_subprocess(point: SweepPoint, prompt_len: int, new_tokens: int) -> dict:
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "point.json")
    command = [sys.executable, "-m", "benchmarks.baselines.flexgen_generate", f"--model={FLAGS.model}",
               f"--prompt_len={prompt_len}", f"--new_tokens={new_tokens}", f"--run_config={point.name}",
               f"--out={path}"] + (["--smoke"] if FLAGS.smoke else [])
    start = time.perf_counter()
    try:
      done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=FLAGS.config_timeout_s)
    except subprocess.TimeoutExpired as timeout:  # its output so far comes as bytes, text=True or not
      output = b"".join(part or b"" for part in (timeout.stdout, timeout.stderr)).decode(errors="replace")
      return {"status": "timed_out", "error": f"killed after {FLAGS.config_timeout_s} s",
              "subprocess_seconds": time.perf_counter() - start, "output_tail": output.strip().splitlines()[-30:]}
    seconds = time.perf_counter() - start
    if os.path.exists(path):
      with open(path) as f:
        return {**json.load(f), "subprocess_seconds": seconds}
    return {**failure(done.returncode, done.stdout + done.stderr), "subprocess_seconds": seconds}


def sweep(cfg, names: list[str], prompt_len: int, new_tokens: int) -> dict:
  out = {
      **provenance(None, "torch", "transformers", "numpy", "flexgen"),
      "smoke": FLAGS.smoke, "model": FLAGS.model, "model_config": cfg.__dict__,
      "prompt_len": prompt_len, "new_tokens": new_tokens, "weights": WEIGHTS_NOTE,
      "torch_env": {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
      "device_budget_bytes": int(FLAGS.device_gib * GIB), "host_budget_bytes": int(FLAGS.host_gib * GIB),
      "status": "running", "best": None, "result": None, "sweep": []}
  for name in names:
    point = SweepPoint.parse(name)
    needed = memory(cfg, point, prompt_len, new_tokens)
    entry = {"config": point.name, "batch": point.batch, "estimated": needed}
    reason = over_budget(needed, out["device_budget_bytes"], out["host_budget_bytes"])
    print(f"{point.name}: batch {point.batch}, estimated GPU {needed['device_bytes'] / GIB:.1f} GiB, host "
          f"{needed['host_bytes'] / GIB:.1f} GiB{' -- over budget, not run' if reason else ''}", flush=True)
    entry.update({"status": "over_budget", "error": reason} if reason else
                 run_in_subprocess(point, prompt_len, new_tokens))
    if entry["status"] == "ok":
      print(f"{point.name}: prefill {entry['prefill_tokens_per_s']:.0f} tok/s, decode "
            f"{entry['decode_tokens_per_s'] or 0:.1f} tok/s, overall {entry['generation_tokens_per_s']:.1f} tok/s "
            f"({entry['subprocess_seconds']:.0f} s in all)", flush=True)
    else:
      print(f"{point.name}: {entry['status']} {entry.get('error', '')}", flush=True)
    out["sweep"].append(entry)
    if out["device"] is None and entry.get("device"):
      out["device"] = entry["device"]
    ran = [e for e in out["sweep"] if e["status"] == "ok"]
    best = max(ran, key=lambda e: e["generation_tokens_per_s"], default=None)
    for e in out["sweep"]:
      e["best"] = e is best
    out.update(best=best and best["config"], result=best)
    write_results(FLAGS.out, out)
  out["status"] = "ok" if out["best"] else "no point ran"
  write_results(FLAGS.out, out)
  if out["best"]:
    print(f"best: {out['best']}, {out['result']['generation_tokens_per_s']:.1f} tok/s", flush=True)
  return out


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments {' '.join(argv[1:])}")
  try:
    cfg = model_config(FLAGS.model, FLAGS.smoke)
    names = FLAGS.configs or (SMOKE_SWEEP if FLAGS.smoke else DEFAULT_SWEEPS.get(FLAGS.model))
    if not names:
      raise ValueError(f"no default sweep for {FLAGS.model}: give --configs")
    points = [SweepPoint.parse(name) for name in ([FLAGS.run_config] if FLAGS.run_config else names)]
  except ValueError as error:
    raise SystemExit(f"flexgen_generate: {error}")
  prompt_len, new_tokens = (16, 4) if FLAGS.smoke else (FLAGS.prompt_len, FLAGS.new_tokens)
  if FLAGS.run_config:
    write_results(FLAGS.out, run_point(cfg, points[0], prompt_len, new_tokens, FLAGS.smoke))
  else:
    sweep(cfg, [point.name for point in points], prompt_len, new_tokens)


if __name__ == "__main__":
  define_script_flags()
  app.run(main)
