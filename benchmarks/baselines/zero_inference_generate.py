"""Peer baseline for benchmarks.generate_throughput (issue 18): DeepSpeed ZeRO-Inference, i.e. transformers'
`generate` on a model under ZeRO stage 3 with every parameter offloaded to pinned CPU memory, at its best setting: a
batch sweep with and without its int4 weights and with and without the KV cache offloaded to CPU memory.

  python -m benchmarks.baselines.zero_inference_generate --out=$OUT/generate_zero_inference_h200.json
  python -m benchmarks.baselines.zero_inference_generate --plan_only --out=/tmp/zero_inference_plan.json
  python -m benchmarks.baselines.zero_inference_generate --smoke --out=/tmp/zero_inference_smoke.json   # tiny, CPU

Not part of sljax: DeepSpeed comes from .dsdeps/ through benchmarks/baselines/install_deepspeed.sh and never enters
requirements.txt. The workload is generate_throughput's, timed and reported as benchmarks.baselines.
hf_accelerate_generate does it (the same JSON keys): random weights, --prompt_len random token ids per row, greedy,
exactly --new_tokens tokens per row, one small warm-up generation first.

The sweep, per model: each weight format of --quant (16: the model's own half-precision weights, the exact peer; 4 or
8: ZeRO-Inference's group-wise weight quantization), each batch of --batches with the KV cache on the GPU and of
--kv_offload_batches with it offloaded. The arithmetic comes first: ZeRO-3's param offload keeps every parameter in
pinned host memory, each tensor rounded up to a power of two by torch's pinned allocator, and so is the offloaded KV
cache; a configuration that cannot fit --host_memory_gib is recorded as infeasible, with its numbers, and never
started. Then one process per weight format builds the model and runs its configurations in turn (--process_per=config:
one process each): pinned memory does not come back to the system within a process, and a process killed for memory
or time takes only its own configurations with it. A configuration that runs out of GPU memory is recorded, larger
batches of its kind are skipped, and the process's other configurations go to a fresh process. The JSON is rewritten
after every process and marks each model's best exact and best compressed configuration.

How DeepSpeed 0.19.8 does it (its source; ZeRO-Inference's recipe is DeepSpeedExamples' inference/huggingface/
zero_inference):
- The model is built inside `deepspeed.zero.Init(config_dict_or_path=ds_config)`, which reads
  zero_optimization.offload_param {device: cpu, pin_memory} (runtime/zero/partition_parameters.py, Init.__init__):
  each module's parameters are made on the GPU by the module's own init, then moved into their pinned CPU partition
  (Init._post_init_method -> _zero_init_param -> partition). `deepspeed.initialize(model=..., config=ds_config)[0]`
  without an optimizer makes the ZeRO-3 inference engine (runtime/engine.py _configure_zero_optimizer: DummyOptim ->
  DeepSpeedZeRoOffload, which reads stage3_prefetch_bucket_size, stage3_param_persistence_threshold,
  stage3_max_live_parameters, stage3_max_reuse_distance) and its `.module.generate` fetches each layer's
  parameters to the GPU as the forward pass reaches them.
- weight_quantization.quantized_initialization {num_bits 4|8, group_size, group_dim, symmetric: false}
  (runtime/config.py -> WeightQuantConfig in inference/config.py) makes zero.Init quantize the weight of every
  exact nn.Linear and nn.Embedding on the GPU before it is partitioned (partition_parameters.py _post_init_method ->
  inference/quantization/utils.py _quantize_param) and wraps F.linear / F.embedding to dequantize after each fetch
  (wrap_quantized_functional): with a CUDA kernel (DeepSpeed's quantizer op, built with nvcc on first use) in
  float16, with torch ops otherwise. --dtype auto takes float16 when that op builds, else bfloat16. The other mode,
  weight_quantization.post_init_quant (inference/quantization/quantization.py), converts a model already built in
  float16: it would need the whole 16-bit model in host memory first, so it is not used.
- KV offload: DeepSpeed 0.19.8 has none for Hugging Face models (ZeRO-Inference's lived in patched transformers 4
  models, with decode attention on the CPU). Used instead: transformers' own offloaded cache
  (generate(cache_implementation="offloaded"), a DynamicCache(offloading=True)): each layer's keys and values go to
  CPU memory after the layer's update and come back on a side stream one layer ahead; attention runs on the GPU.
  torch makes the destination of a non-blocking device-to-CPU copy pinned, so it too is rounded up and cached.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # models/ imports jax: keep it off the GPU that torch uses

import collections
import dataclasses
import importlib
import importlib.util
import json
import math
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import jax
from absl import app, flags
from flax import traverse_util

from benchmarks.common import GENERATION_SMOKE, REPO, define_flags, provenance, write_results
from models.hf import config_to_hf
from models.presets import build, get_config
from sljax.machines import GIB, H200, meminfo

MODULE = "benchmarks.baselines.zero_inference_generate"
# Rows per generation when not given: a sweep meant to fit one 10-minute call on the H200 machine, install included.
# llama70b (grouped-query attention) keeps even 256 rows' KV cache (42.5 GiB) on the GPU; opt-66b's takes 2.25 MiB per
# token, 115 GiB at 96 rows. Offloaded, a cache is pinned in power-of-two blocks (kv_offload_pinned_bytes): 30 GiB for
# llama70b's 64 rows, 32 GiB for opt-66b's 24.
BATCHES = {"llama70b": (128, 256), "opt-66b": (64, 96)}
KV_OFFLOAD_BATCHES = {"llama70b": (64,), "opt-66b": (24,)}
SMOKE_BATCHES, SMOKE_KV_OFFLOAD_BATCHES = (2, 4), (2,)
# Host memory a worker takes besides its pinned buffers: the CUDA context, torch, transformers, DeepSpeed, the
# Python heap and the pageable copy of one tensor while it is pinned.
HOST_OVERHEAD_BYTES = 8 * GIB
PUBLISHED = {  # DeepSpeedExamples' zero_inference README: one A6000 (48 GB), 252 GB of host memory, prompt 512, 32 new
    "llama70b": "ZeRO-Inference on LLaMA-2-70B: 23.44 tok/s, int4 weights, batch 96, weights in CPU memory",
    "opt-66b": "ZeRO-Inference on OPT-66B: 8.02 tok/s, int4 weights + KV offload, batch 64, weights in CPU memory",
}
KV_OFFLOAD = ("transformers' own offloaded cache: generate(cache_implementation='offloaded'), a "
              "DynamicCache(offloading=True), each layer's keys and values moved to CPU memory after its update and "
              "prefetched back on a side stream one layer ahead, attention on the GPU (DeepSpeed 0.19.8 has no KV "
              "offload for Hugging Face models)")
WEIGHTS = ("random: each module's own torch init (Linear uniform +-1/sqrt(fan_in), Embedding N(0, 1), norms 1) run on "
           "the GPU inside deepspeed.zero.Init, quantized there when the format is int4/int8, then copied into its "
           "pinned CPU partition (transformers' init pass skipped): the 16-bit model never exists in host memory")
# Where DeepSpeed 0.19.8 reads each key of ds_config() (paths under its deepspeed/ package).
DS_CONFIG_KEYS = {
    "zero_optimization.stage": "runtime/zero/config.py DeepSpeedZeroConfig.stage; runtime/engine.py "
                               "_configure_zero_optimizer: stage 3 without an optimizer makes DeepSpeedZeRoOffload",
    "zero_optimization.offload_param.{device,pin_memory}": "runtime/zero/offload_config.py "
        "DeepSpeedZeroOffloadParamConfig; runtime/zero/partition_parameters.py Init.__init__ (remote_device, "
        "pin_memory of every partition) and runtime/engine.py -> DeepSpeedZeRoOffload(offload_param_config)",
    "zero_optimization.{stage3_prefetch_bucket_size,stage3_param_persistence_threshold,stage3_max_live_parameters}":
        "runtime/zero/config.py (aliases of prefetch_bucket_size, param_persistence_threshold, max_live_parameters); "
        "runtime/engine.py passes them to DeepSpeedZeRoOffload (runtime/zero/parameter_offload.py)",
    "weight_quantization.quantized_initialization.{num_bits,group_size,group_dim,symmetric}": "runtime/config.py -> "
        "WeightQuantConfig (inference/config.py); runtime/zero/partition_parameters.py "
        "InsertPostInitMethodToModuleSubClasses (__init__, patch_init_and_builtins, _post_init_method); "
        "inference/quantization/utils.py (Quantizer, DeQuantizer, _quantize_param, wrap_quantized_functional)",
    "{fp16,bf16}.enabled": "runtime/config.py; the dtype given to zero.Init is the one the parameters are made in",
    "train_batch_size": "runtime/config.py's batch checks want one; nothing trains",
}

flags.DEFINE_list("models", ["llama70b", "opt-66b"], "sljax presets, built as their transformers models.")
flags.DEFINE_list("quant", ["16", "4"], "Weight formats: 16 (the model's half-precision weights), 4 or 8 (ZeRO-"
                  "Inference's group-wise quantization).")
flags.DEFINE_list("kv_offload", ["off", "on"], "KV cache placements: off (on the GPU), on (offloaded to CPU memory).")
flags.DEFINE_list("batches", [], f"Rows per generation with the KV cache on the GPU (default, per model: {BATCHES}).")
flags.DEFINE_list("kv_offload_batches", [], "Rows per generation with the KV cache offloaded (default, per model: "
                  f"{KV_OFFLOAD_BATCHES}).")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 32, "Generated tokens per row.")
flags.DEFINE_integer("group_size", 64, "Weights per quantization scale (ZeRO-Inference's default).")
flags.DEFINE_enum("dtype", "auto", ["auto", "float16", "bfloat16"], "Weights and compute: auto is float16 (ZeRO-"
                  "Inference's, with DeepSpeed's dequantize kernel) when that kernel builds, else bfloat16.")
flags.DEFINE_float("host_memory_gib", H200.ram_bytes / GIB, "Host RAM the arithmetic plans for (default: the "
                   "nvidia-h200 machine's; its MemTotal reads lower early on). --smoke: MemTotal.")
flags.DEFINE_enum("process_per", "weights", ["weights", "config"], "One worker process per model and weight format "
                  "(it builds the model once), or per configuration.")
flags.DEFINE_integer("build_timeout_s", 300, "Seconds a worker may take to start and build its model.")
flags.DEFINE_integer("config_timeout_s", 180, "Seconds a worker may take per configuration, on top of the build.")
flags.DEFINE_integer("kernel_timeout_s", 240, "Seconds DeepSpeed's quantizer op may take to build (--dtype auto).")
flags.DEFINE_integer("deadline_s", 0, "Start no worker after this many seconds, and stop the one running then (0: no "
                     "deadline).")
flags.DEFINE_string("attn_implementation", "sdpa", "transformers attention implementation.")
flags.DEFINE_bool("plan_only", False, "Only the arithmetic: every configuration's memory and whether it fits.")
flags.DEFINE_string("worker", "", "Internal: run the Job in this JSON file.")
flags.DEFINE_string("quantizer_op", "", "Internal: build DeepSpeed's quantizer op, report to this JSON file.")
define_flags("Tiny shapes (batches 2 and 4, prompt 16, 4 new tokens), planned for this machine's MemTotal: checks "
             "every code path; without DeepSpeed, the arithmetic and the JSON only.",
             out="Write the results JSON here (rewritten after every worker).")
FLAGS = flags.FLAGS


# ---------------------------------------------------------------------------------------------- the arithmetic
def model_config(name: str, dtype: str = "bfloat16", smoke: bool = False):
  overrides = dict(dtype=dtype, param_dtype=dtype)
  if smoke:
    overrides.update(GENERATION_SMOKE[get_config(name).family])
  return get_config(name, overrides)


def tensors(cfg) -> list[tuple[str, int, int | None]]:
  """The transformers model's parameters (the sljax model's leaves, one per layer) as (module, elements, length of
  the axis DeepSpeed quantizes along, None for those it keeps in 16 bits: all but the weights of exact nn.Linear and
  nn.Embedding modules; OPT's learned positions are a subclass of nn.Embedding, which its type check skips)."""
  shapes = traverse_util.flatten_dict(jax.eval_shape(build(cfg).init, jax.random.key(0)))
  found = []
  for (part, module, leaf), value in shapes.items():
    count, shape = (value.shape[0], value.shape[1:]) if part == "layers" else (1, value.shape)
    if leaf == "kernel":
      axis = shape[0]  # our kernel is torch's Linear weight transposed: groups run along its input features
    elif leaf == "embedding" and module == "embed_tokens":
      axis = shape[1]
    else:
      axis = None
    found += [(module, math.prod(shape), axis)] * count
  return found


def partition_bytes(elements: int, axis: int | None, bits: int, group_size: int) -> int:
  """Bytes of one tensor's host partition: 2 per element in 16 bits; quantized, its packed values plus a 16-bit
  scale and minimum per group (the bfloat16/float16 tensor _quantize_param makes of them)."""
  if bits == 16 or axis is None:
    return 2 * elements
  return elements * bits // 8 + 4 * elements // group_size


def pinned(nbytes: int) -> int:
  """What torch's pinned (CachingHostAllocator) block for `nbytes` takes: the next power of two."""
  return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def weights_plan(cfg, bits: int, group_size: int, host_bytes: int) -> dict:
  """Host memory of one weight format under ZeRO-3 param offload (every parameter partition pinned), and whether it
  fits."""
  parts = tensors(cfg)
  sizes = [partition_bytes(elements, axis, bits, group_size) for _, elements, axis in parts]
  held = [pinned(size) for size in sizes]
  if config_to_hf(cfg).get("tie_word_embeddings"):
    # The head the model's init makes before transformers ties it to the embeddings: partitioned like the rest, then
    # freed, its pinned block kept in torch's cache.
    held.append(next(pinned(size) for (module, _, _), size in zip(parts, sizes) if module == "embed_tokens"))
  needed = sum(held) + HOST_OVERHEAD_BYTES
  plan = {"weight_bits": bits, "exact": bits == 16, "tensors": len(parts),
          "quantized_tensors": sum(axis is not None for _, _, axis in parts) if bits < 16 else 0,
          "host_partition_bytes": sum(sizes), "host_pinned_bytes": sum(held),
          "host_overhead_bytes": HOST_OVERHEAD_BYTES, "host_needed_bytes": needed, "host_memory_bytes": host_bytes}
  uneven = sorted({axis for _, _, axis in parts if bits < 16 and axis is not None and axis % group_size})
  if uneven:
    plan.update(feasible=False, reason=f"--group_size {group_size} does not divide the quantized axes {uneven}")
  elif needed > host_bytes:
    plan.update(feasible=False, reason=(
        f"ZeRO-3 param offload keeps every parameter in pinned host memory: {sum(sizes) / GIB:.1f} GiB of "
        f"partitions, {sum(held) / GIB:.1f} GiB as torch pins them, + {HOST_OVERHEAD_BYTES / GIB:.0f} GiB for the "
        f"process = {needed / GIB:.1f} GiB > {host_bytes / GIB:.0f} GiB of RAM"))
  else:
    plan.update(feasible=True, reason=f"{needed / GIB:.1f} GiB of {host_bytes / GIB:.0f} GiB of RAM")
  if bits == 16:  # ZeRO's other param offload, to NVMe, needs the same bytes on disk
    free = shutil.disk_usage(tempfile.gettempdir()).free
    plan["nvme"] = {"needed_bytes": sum(sizes), "disk_free_bytes": free, "feasible": sum(sizes) <= free,
                    "note": "offload_param.device nvme: not run by this sweep"}
  return plan


def kv_cache_bytes(cfg, batch: int, length: int) -> int:
  return cfg.num_layers * 2 * batch * length * cfg.kv_heads * cfg.head_dim * 2


def kv_offload_pinned_bytes(cfg, batch: int, prompt_len: int, new_tokens: int) -> int:
  """Pinned host memory the offloaded cache takes: per layer, its keys and values at every length the generation
  stores (the prompt, then one more per decode step) in power-of-two blocks, one block of each size kept: torch
  caches a freed pinned block for the next request of its size."""
  per_position = batch * cfg.kv_heads * cfg.head_dim * 2
  sizes = {pinned(per_position * length) for length in range(prompt_len, prompt_len + new_tokens)}
  return cfg.num_layers * 2 * sum(sizes)


# ---------------------------------------------------------------------------------------------- DeepSpeed's side
def ds_config(cfg, bits: int, group_size: int, dtype: str) -> dict:
  """ZeRO-Inference's configuration: stage 3 with every parameter in pinned CPU memory, prefetch and live-parameter
  limits of two hidden x hidden matrices, parameters of at most a hidden vector kept on the GPU; bits < 16 adds its
  group-wise weight quantization, asymmetric along each weight's input features."""
  h = cfg.hidden_size
  conf = {
      "fp16": {"enabled": dtype == "float16"}, "bf16": {"enabled": dtype == "bfloat16"},
      "zero_optimization": {
          "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
          "stage3_prefetch_bucket_size": 2 * h * h, "stage3_param_persistence_threshold": h,
          "stage3_max_live_parameters": 2 * h * h},
      "train_batch_size": 1,  # DeepSpeed's config checks want one; nothing trains
      "steps_per_print": 10**9, "wall_clock_breakdown": False}
  if bits < 16:
    conf["weight_quantization"] = {"quantized_initialization": {
        "num_bits": bits, "group_size": group_size, "group_dim": 1, "symmetric": False}}
  return conf


@dataclasses.dataclass(frozen=True)
class Job:
  """What one worker process does: build `model` in `weight_bits` and run `configs` in turn."""

  model: str
  weight_bits: int
  dtype: str  # torch's name for the weights' and the compute's dtype
  configs: tuple  # ((kv_offload, batch), ...), in the order run
  prompt_len: int
  new_tokens: int
  group_size: int
  attn_implementation: str
  smoke: bool
  report: str  # the worker's JSON report, rewritten as it goes


class Report:
  """A worker's JSON report, rewritten after every phase and configuration so that a killed worker still says how
  far it got."""

  def __init__(self, path: str, **fields):
    self.path, self.data = path, {"status": "running", "phase": "start", "phases_s": {}, **fields}
    self.started = time.perf_counter()

  def phase(self, name: str):
    now = time.perf_counter()
    self.data["phases_s"][self.data["phase"]] = round(now - self.started, 2)
    self.started, self.data["phase"] = now, name
    print(f"{MODULE}: {name}", flush=True)
    self.write()

  def write(self):
    write_results(self.path, self.data)


def generate(model, device: str, vocab: int, batch: int, prompt_len: int, new_tokens: int, kv_offload: bool) -> dict:
  """One timed greedy generation of exactly `new_tokens` per row, reported with hf_accelerate_generate's keys."""
  from benchmarks.baselines.hf_generate import timed_generate
  cache = {"cache_implementation": "offloaded"} if kv_offload else {}
  return timed_generate(model, device, vocab, batch, prompt_len, new_tokens, no_grad=True, **cache)


def host_pinned_stats(torch) -> dict:
  """torch's pinned allocator: bytes it holds (rounded blocks, cached ones included) and seconds spent allocating."""
  stats = getattr(torch.cuda, "host_memory_stats", None)
  if not torch.cuda.is_available() or stats is None:
    return {}
  stats = stats()
  return {"host_pinned_bytes": stats.get("allocated_bytes.current"), "host_pinned_peak_bytes":
          stats.get("allocated_bytes.peak"), "host_alloc_seconds": stats.get("host_alloc_time.total", 0) / 1e6}


def used_host_bytes() -> int:
  info = meminfo()
  return info["MemTotal"] - info["MemAvailable"]


def run_worker(job: Job):
  """Builds the model under ZeRO-3 param offload and runs the job's configurations; stops at the first that runs
  out of GPU memory (the parent gives the rest to a fresh process)."""
  report = Report(job.report, model=job.model, weight_bits=job.weight_bits, dtype=job.dtype, configs=[])
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
  os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # a growing KV cache fragments less
  try:
    report.phase("import")
    import torch
    if not torch.cuda.is_available():
      os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import transformers
    # The single-process distributed environment, ninja on PATH, and transformers' init pass skipped.
    from benchmarks.baselines import deepspeed_zero3
    import deepspeed
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    report.data.update(versions={"torch": torch.__version__, "cuda": torch.version.cuda,
                                 "transformers": transformers.__version__, "deepspeed": deepspeed.__version__},
                       device=torch.cuda.get_device_name(0) if cuda else "cpu",
                       gpu_total_bytes=torch.cuda.mem_get_info()[1] if cuda else None,
                       pytorch_cuda_alloc_conf=os.environ["PYTORCH_CUDA_ALLOC_CONF"],
                       dequantize=("none" if job.weight_bits == 16 else "DeepSpeed's CUDA kernel (float16)"
                                   if cuda and job.dtype == "float16" else "torch ops"))
    if cuda:
      torch.cuda.set_device(0)
    report.phase("init_distributed")
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    cfg = model_config(job.model, job.dtype, job.smoke)
    conf = ds_config(cfg, job.weight_bits, job.group_size, job.dtype)
    report.data["ds_config"] = conf

    report.phase("build under deepspeed.zero.Init")
    torch.manual_seed(0)  # the same random weights in every worker, before quantization
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    hf_config._attn_implementation = job.attn_implementation
    dtype = getattr(torch, job.dtype)
    # torch._dynamo (which transformers pulls in) refuses to load under zero.Init's patched tensor creation.
    importlib.import_module("torch._dynamo")
    with deepspeed_zero3.skip_hf_init_weights(), deepspeed.zero.Init(config_dict_or_path=conf, dtype=dtype):
      model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    params = list(model.parameters())
    report.data["build"] = {
        "host_partition_bytes": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params),
        "tensors": len(params), "quantized_tensors": sum(bool(getattr(p, "weight_quantized", False)) for p in params),
        **host_pinned_stats(torch), "host_used_bytes": used_host_bytes()}
    report.phase("deepspeed.initialize")
    engine = deepspeed.initialize(model=model, config=conf)[0]
    model = engine.module.eval()
    report.phase("warm-up")
    generate(model, device, cfg.vocab_size, 1, 8, 2, kv_offload=False)  # CUDA context, kernels, ZeRO-3's trace

    report.phase("configurations")
    for kv_offload, batch in job.configs:
      entry = {"kv_offload": kv_offload, "batch": batch, "status": "running"}
      report.data["configs"].append(entry)
      report.write()
      length = job.prompt_len + job.new_tokens
      if kv_offload and not cuda:
        entry["status"] = "not run: transformers' offloaded cache needs CUDA streams"
        continue
      if cuda:
        torch.cuda.empty_cache()  # what the last configuration left in torch's cache is free for this one
      if cuda and not kv_offload and kv_cache_bytes(cfg, batch, length) > torch.cuda.mem_get_info()[0]:
        entry["status"] = (f"infeasible: device memory (the KV cache, {kv_cache_bytes(cfg, batch, length) / GIB:.1f} "
                           f"GiB, exceeds the GPU's {torch.cuda.mem_get_info()[0] / GIB:.1f} GiB free)")
        continue
      if cuda:
        torch.cuda.reset_peak_memory_stats()
      try:
        entry.update(generate(model, device, cfg.vocab_size, batch, job.prompt_len, job.new_tokens, kv_offload),
                     status="ok")
      except torch.cuda.OutOfMemoryError as error:
        entry.update(status="out of GPU memory", error=str(error).splitlines()[0][:300])
      if cuda:
        entry.update(peak_gpu_allocated_bytes=torch.cuda.max_memory_allocated(),
                     peak_gpu_reserved_bytes=torch.cuda.max_memory_reserved())
      entry.update(host_pinned_stats(torch), host_used_bytes=used_host_bytes())
      if entry["status"] == "ok":
        print(f"{job.model} int{job.weight_bits} kv_offload={kv_offload} batch {batch}: prefill "
              f"{entry['prefill_tokens_per_s']:.0f} tok/s, decode {entry['decode_tokens_per_s'] or 0:.1f} tok/s, "
              f"overall {entry['generation_tokens_per_s']:.1f} tok/s", flush=True)
      else:
        break
    report.data["status"] = "done"
  except BaseException as error:  # noqa: BLE001 -- recorded for the parent, SystemExit from SIGTERM included
    report.data.update(status="failed", failed_in_phase=report.data["phase"], error=f"{type(error).__name__}: {error}",
                       traceback=traceback.format_exc()[-4000:])
    traceback.print_exc()
  report.data["peak_host_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  report.phase("end")


def build_quantizer_op(path: str):
  """Builds (or loads from torch's extension cache) the quantizer op whose kernel dequantizes float16 weights."""
  report = Report(path)
  try:
    import torch
    import torch.utils.cpp_extension
    report.data["cuda_home"] = torch.utils.cpp_extension.CUDA_HOME
    if not torch.cuda.is_available():
      report.data.update(status="unavailable", reason="no GPU: the kernel is CUDA")
    else:
      from benchmarks.baselines import deepspeed_zero3  # noqa: F401 -- ninja on PATH
      from deepspeed.inference.quantization.utils import get_quantizer_module
      report.phase("build DeepSpeed's quantizer op")
      get_quantizer_module()
      report.data["status"] = "ok"
  except BaseException as error:  # noqa: BLE001
    report.data.update(status="unavailable", reason=f"{type(error).__name__}: {str(error)[:1000]}")
  report.phase("end")


# ---------------------------------------------------------------------------------------------- the sweep
def run_process(argument: str, timeout: float, port: int, report_path: str) -> tuple[dict, str | None]:
  """Runs this module with `argument` in a process of its own; (its report, why it was stopped or died, or None)."""
  env = dict(os.environ, MASTER_PORT=str(port))
  process = subprocess.Popen([sys.executable, "-m", MODULE, argument], cwd=REPO, env=env)
  ended = None
  try:
    process.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    ended = f"timed out: stopped after {timeout:.0f} s"
    process.terminate()
    try:
      process.wait(timeout=30)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
  if ended is None and process.returncode < 0:
    ended = f"failed: killed by signal {-process.returncode} (the kernel's out-of-memory killer, if SIGKILL)"
  try:
    with open(report_path) as f:
      return json.load(f), ended
  except (OSError, ValueError):
    return {}, ended or f"failed: the process exited with status {process.returncode} and no report"


def choose_dtype(needs_kernel: bool, workdir: str, port: int) -> dict:
  """--dtype, auto resolved: float16 when DeepSpeed's dequantize kernel builds (only quantized weights need it)."""
  if FLAGS.dtype != "auto":
    return {"dtype": FLAGS.dtype, "reason": "--dtype"}
  if not needs_kernel:
    return {"dtype": "float16", "reason": "no quantized weights to dequantize: ZeRO-Inference's float16"}
  path = os.path.join(workdir, "quantizer_op.json")
  start = time.perf_counter()
  report, ended = run_process(f"--quantizer_op={path}", FLAGS.kernel_timeout_s, port, path)
  built = report.get("status") == "ok" and ended is None
  return {"dtype": "float16" if built else "bfloat16", "quantizer_op": {**report, "ended": ended},
          "quantizer_op_seconds": time.perf_counter() - start,
          "reason": ("DeepSpeed's float16 dequantize kernel built" if built else
                     "DeepSpeed's float16 dequantize kernel is unavailable: bfloat16, dequantized by torch ops")}


def plan_sweep(host_bytes: int, prompt_len: int, new_tokens: int) -> list[dict]:
  """Per model: its weight formats and every configuration, each planned or infeasible."""
  results = []
  for name in FLAGS.models:
    cfg = model_config(name, smoke=FLAGS.smoke)
    batches = {False: [int(b) for b in FLAGS.batches] or (SMOKE_BATCHES if FLAGS.smoke else BATCHES.get(name)),
               True: [int(b) for b in FLAGS.kv_offload_batches] or (
                   SMOKE_KV_OFFLOAD_BATCHES if FLAGS.smoke else KV_OFFLOAD_BATCHES.get(name))}
    if None in batches.values():
      raise SystemExit(f"{name} has no default batches: give --batches and --kv_offload_batches")
    result = {"model": name, "model_config": cfg.__dict__, "published": PUBLISHED.get(name), "weight_formats": [],
              "sweep": [], "processes": []}
    for bits in sorted({int(q) for q in FLAGS.quant}, reverse=True):
      weights = weights_plan(cfg, bits, FLAGS.group_size, host_bytes)
      result["weight_formats"].append(weights)
      # The offloaded-cache ones first: they need the least GPU memory, so that one running out is the last.
      for kv_offload in (True, False):
        if ("on" if kv_offload else "off") not in FLAGS.kv_offload:
          continue
        for batch in sorted(batches[kv_offload]):
          entry = {"model": name, "weight_bits": bits, "kv_offload": kv_offload, "batch": batch,
                   "kv_cache_bytes": kv_cache_bytes(cfg, batch, prompt_len + new_tokens)}
          if kv_offload:
            entry["host_kv_pinned_bytes"] = kv_offload_pinned_bytes(cfg, batch, prompt_len, new_tokens)
          entry["host_needed_bytes"] = weights["host_needed_bytes"] + entry.get("host_kv_pinned_bytes", 0)
          if not weights["feasible"]:
            entry["status"] = f"infeasible: {weights['reason']}"
          elif entry["host_needed_bytes"] > host_bytes:
            entry["status"] = (f"infeasible: host memory (weights {weights['host_pinned_bytes'] / GIB:.1f} GiB + "
                               f"offloaded KV cache {entry['host_kv_pinned_bytes'] / GIB:.1f} GiB pinned + "
                               f"{HOST_OVERHEAD_BYTES / GIB:.0f} GiB > {host_bytes / GIB:.0f} GiB)")
          else:
            entry["status"] = "planned"
          result["sweep"].append(entry)
    results.append(result)
  return results


def worker_groups(entries: list[dict], host_bytes: int, weights_bytes: int) -> list[list[dict]]:
  """The planned entries of one weight format, split into worker processes: one each (--process_per=config), or as
  few as keep the offloaded caches' pinned memory, which a process keeps, within RAM."""
  if FLAGS.process_per == "config":
    return [[entry] for entry in entries]
  groups, held = [], 0
  for entry in entries:
    extra = entry.get("host_kv_pinned_bytes", 0)
    if not groups or held + extra > host_bytes:
      groups.append([])
      held = weights_bytes
    groups[-1].append(entry)
    held += extra
  return groups


def settle(group: list[dict], report: dict, ended: str | None, index: int) -> list[dict]:
  """Copies a worker's outcome into its entries; returns those to give to a fresh worker (it ran out of GPU memory
  before reaching them)."""
  done = {(c["kv_offload"], c["batch"]): c for c in report.get("configs", [])}
  out_of_memory = None
  for entry in group:
    outcome = done.get((entry["kv_offload"], entry["batch"]))
    if outcome is None:
      continue
    entry.update(outcome, process=index)
    if entry["status"] == "running":
      entry["status"] = ended or f"failed: {report.get('error', 'the process ended')}"
    if entry["status"] == "out of GPU memory":
      out_of_memory = entry
  rest = [entry for entry in group if (entry["kv_offload"], entry["batch"]) not in done]
  for entry in rest:
    if not done:
      kind = "timed out" if ended and ended.startswith("timed out") else "failed"
      reason = report.get("error") or (ended or "").removeprefix("failed: ")
      phase = report.get("failed_in_phase", report.get("phase", "start"))
      entry["status"] = f"{kind}: the worker ended in its {phase} phase ({reason})"
    elif out_of_memory and entry["kv_offload"] == out_of_memory["kv_offload"] and (
        entry["batch"] >= out_of_memory["batch"]):
      entry["status"] = f"skipped: batch {out_of_memory['batch']} ran out of GPU memory"
    elif not out_of_memory:
      entry["status"] = f"not run: its worker ended first ({ended or report.get('error')})"
  return [entry for entry in rest if entry["status"] == "planned"]


def mark_best(result: dict):
  """Marks the fastest finished configuration of exact (16-bit) and of compressed weights."""
  for key, exact in (("best_exact", True), ("best_compressed", False)):
    finished = [e for e in result["sweep"] if e["status"] == "ok" and (e["weight_bits"] == 16) == exact]
    best = max(finished, key=lambda e: e["generation_tokens_per_s"], default=None)
    for entry in finished:
      entry[key] = entry is best
    result[key] = {k: best[k] for k in ("weight_bits", "kv_offload", "batch", "generation_tokens_per_s",
                                         "prefill_tokens_per_s", "decode_tokens_per_s")} if best else None


def run_sweep(out: dict, host_bytes: int, started: float):
  """Runs the planned configurations of out["results"] in worker processes, one after the other, rewriting the JSON
  after each."""
  workdir = tempfile.mkdtemp(prefix="zero_inference_")
  port = 29600
  results = out["results"]
  planned = [e for r in results for e in r["sweep"] if e["status"] == "planned"]
  out["dtype"] = choose_dtype(any(e["weight_bits"] < 16 for e in planned), workdir, port)
  write_results(FLAGS.out, out)
  pending = collections.deque()
  for result in results:
    for weights in result["weight_formats"]:
      entries = [e for e in result["sweep"] if e["weight_bits"] == weights["weight_bits"] and e["status"] == "planned"]
      for group in worker_groups(entries, host_bytes, weights["host_needed_bytes"]) if entries else []:
        pending.append((result, weights["weight_bits"], group))
  while pending:
    result, bits, group = pending.popleft()
    left = FLAGS.deadline_s - (time.perf_counter() - started) if FLAGS.deadline_s else math.inf
    if left <= 0:
      for entry in group:
        entry["status"] = "not run: --deadline_s passed"
      continue
    port += 1
    index = len(result["processes"])
    path = os.path.join(workdir, f"{result['model']}_int{bits}_{index}.json")
    job = Job(model=result["model"], weight_bits=bits, dtype=out["dtype"]["dtype"],
              configs=tuple((e["kv_offload"], e["batch"]) for e in group), prompt_len=out["prompt_len"],
              new_tokens=out["new_tokens"], group_size=FLAGS.group_size,
              attn_implementation=FLAGS.attn_implementation, smoke=FLAGS.smoke, report=path)
    with open(path + ".job", "w") as f:
      json.dump(dataclasses.asdict(job), f)
    timeout = min(FLAGS.build_timeout_s + FLAGS.config_timeout_s * len(group), left)
    print(f"{MODULE}: {result['model']} int{bits}: configurations {job.configs} in a worker (timeout {timeout:.0f} s)",
          flush=True)
    report, ended = run_process(f"--worker={path}.job", timeout, port, path)
    out["device"] = report.get("device", out["device"])
    result["processes"].append({k: v for k, v in report.items() if k != "configs"} | {"ended": ended})
    rest = settle(group, report, ended, index)
    if rest:
      pending.appendleft((result, bits, rest))
    mark_best(result)
    write_results(FLAGS.out, {**out, "elapsed_seconds": time.perf_counter() - started})
  shutil.rmtree(workdir, ignore_errors=True)


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments {' '.join(argv[1:])}")
  if FLAGS.worker:
    with open(FLAGS.worker) as f:
      run_worker(Job(**json.load(f)))
    return
  if FLAGS.quantizer_op:
    build_quantizer_op(FLAGS.quantizer_op)
    return
  unknown = sorted(set(FLAGS.quant) - {"4", "8", "16"}) + sorted(set(FLAGS.kv_offload) - {"off", "on"})
  if unknown:
    raise SystemExit(f"unknown --quant or --kv_offload values {unknown}: --quant takes 4, 8, 16; --kv_offload off, on")
  try:
    [int(b) for b in FLAGS.batches + FLAGS.kv_offload_batches]
  except ValueError:
    raise SystemExit("--batches and --kv_offload_batches take row counts, e.g. --batches=128,256") from None
  started = time.perf_counter()
  prompt_len, new_tokens = (16, 4) if FLAGS.smoke else (FLAGS.prompt_len, FLAGS.new_tokens)
  host_bytes = meminfo()["MemTotal"] if FLAGS.smoke else int(FLAGS.host_memory_gib * GIB)
  results = plan_sweep(host_bytes, prompt_len, new_tokens)
  has_deepspeed = importlib.util.find_spec("deepspeed") is not None
  out = {
      "benchmark": "peer baseline: DeepSpeed ZeRO-Inference (ZeRO-3 param offload to pinned CPU memory, int4 "
                   "weights, KV offload) under transformers generate (issue 18)",
      **provenance(None, "torch", "transformers", "accelerate", "deepspeed"),
      "status": "running", "smoke": FLAGS.smoke, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "host_memory_bytes": host_bytes, "meminfo_at_start": {k: v for k, v in meminfo().items()
                                                            if k in ("MemTotal", "MemAvailable")},
      "weights": WEIGHTS, "kv_offload": KV_OFFLOAD, "deepspeed_config_keys": DS_CONFIG_KEYS,
      "process_per": FLAGS.process_per, "results": results}
  if FLAGS.plan_only or not has_deepspeed:
    status = "plan only" if FLAGS.plan_only else (
        "not run: deepspeed is not importable (benchmarks/baselines/install_deepspeed.sh installs it)")
    for entry in (e for r in results for e in r["sweep"] if e["status"] == "planned"):
      entry["status"] = status
    write_results(FLAGS.out, {**out, "status": status})
    print(json.dumps({r["model"]: [w["reason"] for w in r["weight_formats"]] for r in results}, indent=1))
    if not (FLAGS.plan_only or FLAGS.smoke):
      raise SystemExit(status)
    return

  run_sweep(out, host_bytes, started)
  for result in results:
    mark_best(result)
  statuses = [e["status"] for r in results for e in r["sweep"]]
  ran = [s for s in statuses if not s.startswith("infeasible")]
  out["status"] = "ok" if ran and all(s == "ok" for s in ran) else "partial" if "ok" in ran else "failed"
  write_results(FLAGS.out, {**out, "elapsed_seconds": time.perf_counter() - started})
  for result in results:
    print(f"{result['model']}: best exact {result['best_exact']}, best compressed {result['best_compressed']}",
          flush=True)
  if out["status"] == "failed":
    raise SystemExit(f"no configuration ran: see {FLAGS.out or 'the output above'}")


if __name__ == "__main__":
  app.run(main)
