"""Baseline for benchmarks.generate_throughput: the same workload through transformers' `generate`, with
accelerate's `device_map` offload (decoder layers that do not fit on the GPU wait in CPU memory and are copied to
the GPU for every forward pass; the KV cache stays on the GPU).

  python -m benchmarks.baselines.hf_accelerate_generate --model=llama70b --batch=<the sljax result's batch> \\
      --out=benchmarks/results/generate_llama70b_hf_accelerate_h200.json
  python -m benchmarks.baselines.hf_accelerate_generate --smoke --out=/tmp/hf_smoke.json   # tiny, on CPU

Random bf16 weights made in place (no checkpoint to read: the GPU machine has none and no network): the model is
built on the meta device, accelerate's `infer_auto_device_map` places whole decoder layers under --gpu_memory_gib
(default: the GPU's memory less the batch's KV cache and prompt-pass activations) and --cpu_memory_gib, each tensor
is then drawn on its device, and `dispatch_model` attaches the offload hooks. Greedy, exactly --new_tokens tokens
per row. If generate runs out of GPU memory, the batch is halved and retried; the JSON records every attempt.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # models/ imports jax: keep it off the GPU that torch measures

import tempfile
import time

import torch
import transformers
from absl import app, flags
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from accelerate.utils import set_module_tensor_to_device

from benchmarks.baselines.hf_generate import timed_generate
from benchmarks.common import GENERATION_SMOKE, define_flags, provenance, write_results
from models.hf import config_to_hf
from models.presets import get_config
from sljax.machines import GIB

flags.DEFINE_string("model", "llama70b", "sljax preset, built as its transformers model.")
flags.DEFINE_integer("batch", 0, "Rows: use the batch of the sljax result being compared (required unless --smoke).")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 32, "Generated tokens per row.")
flags.DEFINE_float("gpu_memory_gib", 0, "GPU memory for weights (0: --gpu_total_gib less the KV cache and "
                   "activations).")
flags.DEFINE_float("gpu_total_gib", 0, "Act as if the GPU had this much memory, enforced by torch's per-process "
                   "fraction (0: all of it). Matches sljax runs given --device_memory_gib.")
flags.DEFINE_float("cpu_memory_gib", 100, "CPU memory for offloaded weights.")
flags.DEFINE_string("attn_implementation", "sdpa", "transformers attention implementation.")
define_flags("Tiny shapes on CPU, half the layers offloaded to disk (the GPU's CPU offload path needs a GPU): "
             "checks the script's code path.")
FLAGS = flags.FLAGS


def activation_bytes(cfg, batch: int, prompt_len: int) -> int:
  """The prompt pass's largest live activations (the MLP's, the projections'), plus 2 GiB for the allocator."""
  return batch * prompt_len * (3 * cfg.intermediate_size + 6 * cfg.hidden_size) * 2 + 2 * GIB


def build_model(cfg, gpu_bytes: int, cpu_bytes: int, offload_dir: str):
  """The transformers model with random weights, dispatched by accelerate; (model, device_map, execution device)."""
  hf_config = transformers.AutoConfig.for_model(**config_to_hf(cfg))
  hf_config._attn_implementation = FLAGS.attn_implementation
  with init_empty_weights():
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
  if FLAGS.smoke:  # no GPU: half the decoder layers to disk, so that the hooks still load weights per forward pass
    names = [name for name, _ in model.named_modules() if name.count(".") and name.rsplit(".", 1)[-1].isdigit()]
    device_map = {"": "cpu", **{name: "disk" for name in names[len(names) // 2:]}}
  else:
    device_map = infer_auto_device_map(model, max_memory={0: gpu_bytes, "cpu": cpu_bytes},
                                       no_split_module_classes=model._no_split_modules, dtype=torch.bfloat16)
  torch.manual_seed(0)
  draw_on = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU draws CPU-bound tensors too: much faster
  for name, param in list(model.named_parameters()):
    where = max((p for p in device_map if not p or name == p or name.startswith(p + ".")), key=len)
    device = "cpu" if device_map[where] in ("cpu", "disk") else device_map[where]
    if "norm" in name and name.endswith("weight"):
      value = torch.ones(param.shape, dtype=torch.bfloat16, device=draw_on)
    elif name.endswith("bias"):
      value = torch.zeros(param.shape, dtype=torch.bfloat16, device=draw_on)
    else:
      value = torch.empty(param.shape, dtype=torch.bfloat16, device=draw_on).normal_(0, 0.02)
    set_module_tensor_to_device(model, name, device, value=value)
    del value
  model.tie_weights()
  model = dispatch_model(model, device_map=device_map, offload_dir=offload_dir)
  return model.eval(), device_map, "cpu" if FLAGS.smoke else "cuda:0"


def generate(model, device, cfg, batch: int, prompt_len: int, new_tokens: int) -> dict:
  return timed_generate(model, device, cfg.vocab_size, batch, prompt_len, new_tokens)


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments {' '.join(argv[1:])}")
  if not FLAGS.batch and not FLAGS.smoke:
    raise SystemExit("give --batch: the batch of the sljax result this baseline is compared with")
  cfg = get_config(FLAGS.model, dict(dtype="bfloat16", param_dtype="bfloat16"))
  if FLAGS.smoke:
    cfg = get_config(FLAGS.model, dict(dtype="bfloat16", param_dtype="bfloat16", **GENERATION_SMOKE[cfg.family]))
  batch = FLAGS.batch or 4
  prompt_len, new_tokens = (16, 4) if FLAGS.smoke else (FLAGS.prompt_len, FLAGS.new_tokens)
  kv_bytes = cfg.num_layers * batch * (prompt_len + new_tokens) * 2 * cfg.kv_heads * cfg.head_dim * 2
  gpu_total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
  if FLAGS.gpu_total_gib and gpu_total:
    torch.cuda.set_per_process_memory_fraction(min(FLAGS.gpu_total_gib * GIB / gpu_total, 1.0))
    gpu_total = int(FLAGS.gpu_total_gib * GIB)
  gpu_bytes = int(FLAGS.gpu_memory_gib * GIB) or max(gpu_total - kv_bytes - activation_bytes(cfg, batch, prompt_len), 0)

  with tempfile.TemporaryDirectory() as offload_dir:
    start = time.perf_counter()
    model, device_map, device = build_model(cfg, gpu_bytes, int(FLAGS.cpu_memory_gib * GIB), offload_dir)
    build_seconds = time.perf_counter() - start
    placed = {}
    for target in device_map.values():
      placed[str(target)] = placed.get(str(target), 0) + 1
    print(f"{FLAGS.model}: device map {placed} (modules per device), built in {build_seconds:.0f} s", flush=True)
    generate(model, device, cfg, 1, 8, 2)  # warm-up: CUDA context, kernels, hooks
    attempts, result = [], None
    while batch >= 1 and result is None:
      try:
        result = generate(model, device, cfg, batch, prompt_len, new_tokens)
      except torch.cuda.OutOfMemoryError as error:
        attempts.append({"batch": batch, "error": str(error).splitlines()[0][:300]})
        print(f"out of GPU memory at batch {batch}; halving", flush=True)
        batch //= 2
        torch.cuda.empty_cache()
  if result:
    print(f"prefill {result['prefill_tokens_per_s']:.0f} tok/s, decode {result['decode_tokens_per_s'] or 0:.1f} tok/s, "
          f"overall {result['generation_tokens_per_s']:.1f} tok/s", flush=True)
  out = {
      **provenance(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch", "transformers",
                   "accelerate"),
      "smoke": FLAGS.smoke, "model": FLAGS.model, "model_config": cfg.__dict__,
      "prompt_len": prompt_len, "new_tokens": new_tokens, "requested_batch": FLAGS.batch or 4,
      "gpu_total_bytes": gpu_total, "gpu_weight_budget_bytes": gpu_bytes, "kv_cache_bytes": kv_bytes,
      "modules_per_device": placed,
      "weights": "random bf16 (norms 1, biases 0, the rest N(0, 0.02)), every tensor distinct",
      "build_seconds": build_seconds, "oom_attempts": attempts, "result": result}
  write_results(FLAGS.out, out)


if __name__ == "__main__":
  app.run(main)
