"""Peer baseline (issue 7): Hugging Face LLaMA/OPT in PyTorch under DeepSpeed ZeRO-3 with parameters and optimizer
offloaded to pinned CPU memory, on one GPU, measured with sljax's own MFU formula.

Not part of sljax: DeepSpeed comes from .dsdeps/ through benchmarks/baselines/install_deepspeed.sh and never enters
requirements.txt. One process, no launcher: the script sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT itself.

  python3 -m benchmarks.baselines.deepspeed_zero3 --model llama13b --seq 2048 --batch 32 --micro_batch 16 \\
      --offload_ratio auto --host_mem_gib 256 --warmup 1 --steps 2 --out $OUT/ds_llama13b.json
  python3 -m benchmarks.baselines.deepspeed_zero3 --model llama13b --micro_batch 16 --accumulation 1,4,16 \\
      --steps 2,2,1 --host_mem_gib 500 --zero_set stage3_prefetch_bucket_size=640000000 --out $OUT/ds_ga.json
  python3 -m benchmarks.baselines.deepspeed_zero3 --smoke --out /tmp/smoke.json          # tiny model, CPU is fine
  python3 -m benchmarks.baselines.deepspeed_zero3 --backend fsdp_cpu_offload ...          # PyTorch FSDP2 fallback

Steps: --warmup optimizer steps of one micro-batch, then each gradient accumulation of --accumulation (default
--batch / --micro_batch) in turn on the same engine, its timed optimizer steps of that many micro-batches each; the
JSON's "points" hold each one's step and micro-batch seconds, tokens/s and MFU (the top-level ones are the last
point's). Optimizer (ADAMW, CLIP_NORM below, recorded as "optimizer_settings"): AdamW with fp32 master weights and
moments, gradients accumulated in fp32 and clipped by their global norm.

Figures: tokens/s = batch * seq / mean timed step; MFU = tokens/s * get_config(model).flops_per_token(seq) / peak
(6 x matmul params + causal attention, no recompute counted; the GPU's dense bf16 peak from sljax.machines, the
H200's on a CPU): the formula sljax's own benchmarks use. Weights are random and their values do not matter for
throughput (see the JSON's "weights").

Host memory: DeepSpeed 0.19.8's ZeRO-3 full CPU offload keeps ~22 bytes per parameter in host RAM (bf16 params 2, a
flat fp32 gradient buffer 4, and per optimizer sub-group fp32 master 4 + Adam m, v 8 + fp32 .grad 4): llama13b needs
~286 GB, more than the 256 GiB of nvidia-h200-x2. `--offload_ratio auto --host_mem_gib N` keeps the largest share of
optimizer state on the CPU that fits N and updates the rest on the GPU (DeepSpeed's partial offload, labelled in the
JSON). A run that cannot fit is recorded as failed before it starts. The JSON is rewritten after every phase
(status "running", "phase"), so a run the kernel kills for memory still leaves where it got to.
"""

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import platform
import resource
import signal
import sys
import threading
import time
import traceback

# models.presets imports JAX (for dtype checks only): keep it off the GPU, which torch owns here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Single process, no launcher.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
# NVLink multicast stays off: the GPU machines this baseline ran on do not allow it.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
# ninja (the pip package) lives next to the interpreter; torch's JIT build (CPU Adam) calls it by name.
_bindir = os.path.dirname(sys.executable)
if _bindir not in os.environ.get("PATH", "").split(os.pathsep):
  os.environ["PATH"] = _bindir + os.pathsep + os.environ.get("PATH", "")

import warnings  # noqa: E402

import torch  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

from benchmarks import common  # noqa: E402
from models.presets import get_config  # noqa: E402
from sljax.machines import GIB, meminfo, rates_of  # noqa: E402
from sljax.memory import resident_bytes  # noqa: E402
from sljax.metrics import training_flops  # noqa: E402


# ----------------------------------------------------------------------------------------------------------- report
class Report:
  """The result JSON, rewritten after every phase so that a killed run still says how far it got."""

  def __init__(self, path):
    self.path = path
    self.data = {
        "benchmark": "peer baseline: HF transformers under DeepSpeed ZeRO-3 CPU offload (issue 7)",
        "status": "running",
        "phase": "start",
        **common.provenance(None),
        "host": platform.node(),
        "phases_s": {},
        "notes": [],
    }
    self._t0 = time.perf_counter()
    self._tphase = self._t0

  def phase(self, name):
    now = time.perf_counter()
    self.data["phases_s"][self.data["phase"]] = round(now - self._tphase, 3)
    self._tphase = now
    self.data["phase"] = name
    print(f"[{now - self._t0:8.1f} s] phase: {name}  (host RSS {rss_gib():.1f} GiB)", flush=True)
    self.write()

  def note(self, text):
    print("note:", text, flush=True)
    self.data["notes"].append(text)

  def write(self):
    common.write_results(self.path, self.data)


def rss_gib():
  return resident_bytes() / GIB


def meminfo_gib():
  return {key: value / GIB for key, value in meminfo().items() if key in ("MemTotal", "MemAvailable")}


class HostMemorySampler:
  """Peak RSS of this process and peak system memory in use (MemTotal - MemAvailable), sampled every 0.2 s."""

  def __init__(self):
    self.peak_rss = 0.0
    self.peak_used = 0.0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak_rss = max(self.peak_rss, rss_gib())
      m = meminfo_gib()
      if "MemTotal" in m and "MemAvailable" in m:
        self.peak_used = max(self.peak_used, m["MemTotal"] - m["MemAvailable"])
      self._stop.wait(0.2)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


# ----------------------------------------------------------------------------------------------------------- models
def hf_config(cfg):
  """Our preset -> the same shapes as a transformers config (untied embeddings, as in our LLaMA)."""
  if cfg.family == "llama":
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, use_cache=False, attention_bias=False, mlp_bias=False)
  from transformers import OPTConfig
  return OPTConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, ffn_dim=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, max_position_embeddings=cfg.max_positions,
      word_embed_proj_dim=cfg.embed_dim, do_layer_norm_before=cfg.layer_norm_before, tie_word_embeddings=True,
      use_cache=False, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def hf_model_class(cfg):
  if cfg.family == "llama":
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM
  from transformers import OPTForCausalLM
  return OPTForCausalLM


@contextlib.contextmanager
def skip_hf_init_weights():
  """Skip transformers' own weight init pass (post_init -> init_weights).

  torch's per-module init (nn.Linear's kaiming-uniform, nn.Embedding's normal) still runs inside each module's
  __init__, which under zero.Init happens on the local accelerator before the partition moves to pinned CPU memory,
  so values are sane and creation is fast. The HF pass would come after partitioning and only slow things down.
  """
  from transformers import PreTrainedModel
  original = PreTrainedModel.init_weights

  def init_weights(self):
    if hasattr(self, "tie_weights"):
      try:
        self.tie_weights()
      except TypeError:
        pass

  PreTrainedModel.init_weights = init_weights
  try:
    yield
  finally:
    PreTrainedModel.init_weights = original


def enable_checkpointing(rep, args, model):
  """Activation checkpointing per decoder layer, the way HF Trainer does it (torch.utils.checkpoint)."""
  model.config.use_cache = False
  if args.grad_ckpt:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", FutureWarning)  # transformers >= 5.2x renames it activation_checkpointing_enable
      model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": args.ckpt_reentrant})
      enabled = bool(getattr(model, "is_gradient_checkpointing", False))
    if args.ckpt_reentrant and hasattr(model, "enable_input_require_grads"):
      model.enable_input_require_grads()
  else:
    enabled = False
  rep.data["gradient_checkpointing"] = {"enabled": enabled, "use_reentrant": args.ckpt_reentrant}


def count_params(model):
  n = 0
  for p in model.parameters():
    n += getattr(p, "ds_numel", None) or p.numel()
  return n


# ----------------------------------------------------------------------------------------------------------- configs
# The optimizer: AdamW (decoupled weight decay) at --lr, clipped by the global gradient norm.
# benchmarks.train_throughput's big_like_deepspeed case runs the same numbers; benchmarks.vs_deepspeed checks that
# both records agree.
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CLIP_NORM = 1.0


def optimizer_settings(args):
  """What the optimizer computes, in the keys benchmarks.train_throughput records for sljax."""
  # ZeRO keeps fp32 partitions (and fp32 moments and accumulated gradients, ds_config) beside bf16 params; FSDP's
  # parameters, moments and gradients are in its master dtype.
  master = "float32" if args.backend == "deepspeed" else args.fsdp_master_dtype
  return {"lr": args.lr, "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"],
          "decoupled_weight_decay": True, "grad_clip_norm": CLIP_NORM, "master_dtype": master,
          "moments_dtype": master, "grad_accum_dtype": master, "compute_dtype": args.dtype}


def setting_value(text):
  """A --zero_set value: JSON (true, 5e8, "cpu"), a whole float as an int (DeepSpeed's sizes are ints), else text."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return text
  return int(value) if isinstance(value, float) and value.is_integer() else value


def apply_zero_settings(zero, settings):
  """--zero_set KEY=VALUE (KEY dotted into nested sections, e.g. offload_param.pin_memory=false) onto zero."""
  for item in settings:
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"--zero_set {item!r}: expected KEY=VALUE")
    *sections, name = key.split(".")
    target = zero
    for section in sections:
      target = target.setdefault(section, {})
    target[name] = setting_value(value)
  return zero


def ds_config(args, cfg, ga):
  h = cfg.hidden_size
  largest = max(cfg.vocab_size * cfg.embed_dim, cfg.hidden_size * cfg.intermediate_size)
  zero = {
      "stage": 3,
      "overlap_comm": True,
      "contiguous_gradients": True,
      "reduce_bucket_size": h * h,
      "stage3_prefetch_bucket_size": int(0.9 * h * h),
      "stage3_param_persistence_threshold": 10 * h,
      "stage3_max_live_parameters": int(1e9),
      "stage3_max_reuse_distance": int(1e9),
      # Partial offload (ratio < 1) assigns whole sub-groups to the CPU or GPU: smaller groups, finer split.
      "sub_group_size": int(1e9) if args.offload_ratio >= 1 else int(1e8),
      "stage3_gather_16bit_weights_on_model_save": False,
  }
  if args.offload in ("all", "param"):
    zero["offload_param"] = {"device": "cpu", "pin_memory": True, "buffer_size": max(int(1e8), largest)}
  if args.offload in ("all", "optimizer"):
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": args.offload_ratio}
  return {
      "train_batch_size": args.micro_batch * ga,
      "train_micro_batch_size_per_gpu": args.micro_batch,
      "gradient_accumulation_steps": ga,
      "gradient_clipping": CLIP_NORM,
      "bf16": {"enabled": args.dtype == "bfloat16"},
      "fp16": {"enabled": False},
      # Without it ZeRO accumulates gradients across micro-batches in the model's dtype (bf16), not as sljax does.
      "data_types": {"grad_accum_dtype": "fp32"},
      "zero_optimization": apply_zero_settings(zero, args.zero_set),
      "zero_allow_untested_optimizer": True,
      "zero_force_ds_cpu_optimizer": args.optimizer == "cpu_adam",
      "steps_per_print": 10**9,
      "wall_clock_breakdown": False,
  }


OVERHEAD_HOST_GB = 8.0  # CUDA context, torch, transformers, DeepSpeed, the Python heap: not modelled below


def host_estimate_gb(n_params, args, ratio=None):
  """Host bytes DeepSpeed ZeRO-3 keeps, read off deepspeed/runtime/zero/stage3.py (0.19.8), per parameter:
  offload_param: bf16 partitions 2 (pinned). offload_optimizer: a flat fp32 gradient-accumulation buffer 4 (pinned,
  whatever the ratio), plus ratio x (fp32 master 4 + Adam m and v 8 + the sub-group's own fp32 .grad 4, which
  offload keeps allocated between steps). Full offload: 22 B/param, llama13b 286 GB. Lower bound: excludes
  OVERHEAD_HOST_GB and transient copies."""
  ratio = args.offload_ratio if ratio is None else ratio
  per = 0.0
  if args.offload in ("all", "param"):
    per += 2
  if args.offload in ("all", "optimizer"):
    per += 4 + ratio * 16
  return n_params * per / 1e9


def gpu_estimate_gb(n_params, args, cfg, ratio=None):
  """Device bytes: model state left on the GPU plus a rough working set (checkpoints, logits, one layer, buffers)."""
  ratio = args.offload_ratio if ratio is None else ratio
  per = 0.0 if args.offload in ("all", "param") else 2
  per += (1 - ratio) * 16 if args.offload in ("all", "optimizer") else 16
  tokens = args.micro_batch * args.seq
  work = (cfg.num_layers * tokens * cfg.hidden_size * 2                        # checkpointed layer inputs, bf16
          + tokens * cfg.vocab_size * 10                                       # logits bf16 + fp32 loss + grad
          + tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4     # one recomputed layer, fwd + bwd
          + 4e9)                                                               # fetch buffers, context, slack
  return (n_params * per + work) / 1e9


def auto_offload_ratio(n_params, args):
  """Largest share of optimizer state on the CPU whose host estimate stays within 85% of --host_mem_gib."""
  if not args.host_mem_gib:
    raise ValueError("--offload_ratio auto needs --host_mem_gib")
  budget = 0.85 * args.host_mem_gib * GIB / 1e9 - OVERHEAD_HOST_GB
  fixed = host_estimate_gb(n_params, args, ratio=0.0)
  r = (budget - fixed) * 1e9 / (n_params * 16)
  return max(0.0, min(1.0, int(r * 100) / 100))


def preflight_memory(rep, args, host_gb, gpu_gb=None):
  """Refuse a run whose state cannot fit, instead of being killed for memory halfway through init."""
  rep.data["host_estimate_gb"] = round(host_gb, 1)
  rep.data["host_estimate_overhead_gb"] = OVERHEAD_HOST_GB
  if gpu_gb is not None:
    rep.data["gpu_estimate_gb"] = round(gpu_gb, 1)
  print(f"estimates: host state ~{host_gb:.0f} GB (+{OVERHEAD_HOST_GB:.0f} overhead), GPU ~{gpu_gb or 0:.0f} GB; "
        f"--host_mem_gib {args.host_mem_gib or 'unset'}", flush=True)
  need = (host_gb + OVERHEAD_HOST_GB) * 1e9 / GIB
  if args.host_mem_gib and need > 0.95 * args.host_mem_gib:
    raise MemoryError(f"host state needs ~{need:.0f} GiB (lower bound) but the machine has {args.host_mem_gib:g} "
                      f"GiB: {args.backend} with offload={args.offload}, ratio={args.offload_ratio} cannot train "
                      f"{args.model} here")
  if gpu_gb is not None and torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    if gpu_gb > 0.97 * total:
      raise MemoryError(f"GPU needs ~{gpu_gb:.0f} GB (estimate) of {total:.0f} GB with offload={args.offload}, "
                        f"ratio={args.offload_ratio}, micro_batch={args.micro_batch}: lower --micro_batch or raise "
                        f"--offload_ratio")


# ----------------------------------------------------------------------------------------------------------- runs
def versions():
  out = {**common.versions("torch", "transformers", "deepspeed", "pydantic", "accelerate"), "cuda": torch.version.cuda}
  try:
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
  except Exception:  # noqa: BLE001
    pass
  return out


def device_info(dev):
  info = {"torch_device": str(dev), "cpu_count": os.cpu_count(), "meminfo_gib_at_start": meminfo_gib()}
  if dev.type == "cuda":
    p = torch.cuda.get_device_properties(dev)
    info.update(name=p.name, total_memory_gib=round(p.total_memory / GIB, 2), sm_count=p.multi_processor_count)
  else:
    info["name"] = platform.processor() or "cpu"
  return info


def sync(dev):
  if dev.type == "cuda":
    torch.cuda.synchronize(dev)


def mark(dev):
  """A point in the device's work, read after the step's sync: nothing waits for it."""
  if dev.type != "cuda":
    return time.perf_counter()
  event = torch.cuda.Event(enable_timing=True)
  event.record()
  return event


def seconds_between(marks, dev):
  if dev.type != "cuda":
    return [b - a for a, b in zip(marks, marks[1:])]
  return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


def rates(rep, tokens, seconds):
  """tokens/s, MFU and HFU of optimizer steps of `tokens` taking `seconds` each."""
  flops, hw_flops, peak = (rep.data[k] for k in ("flops_per_token", "hardware_flops_per_token", "peak_flops"))
  tps = tokens / seconds
  return {"step_s_mean": round(seconds, 4), "tokens_per_s": round(tps, 1), "mfu": round(tps * flops / peak, 5),
          "hfu": round(tps * hw_flops / peak, 5)}


def time_points(rep, dev, args, micro_step, step_done, set_accumulation):
  """--warmup optimizer steps of one micro-batch, then each accumulation `ga` of --accumulation in turn on the same
  engine: its --steps timed optimizer steps of `ga` micro-batches of micro_batch x seq tokens. A new accumulation
  compiles and traces nothing new (every micro-batch runs the same forward and backward), so the warm-up is not
  repeated; each micro-batch's seconds (its forward, backward and engine step, the optimizer's in the last one's) are
  kept, which shows a first-time cost where there is one. Returns the points, also in rep.data["points"]."""
  g = torch.Generator(device="cpu").manual_seed(0)
  vocab = rep.data["model"]["vocab_size"]
  batches = [torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g).to(dev) for _ in range(2)]

  def optimizer_step(ga):
    sync(dev)
    start = time.perf_counter()
    marks = [mark(dev)]
    for m in range(ga):
      loss = micro_step(batches[m % len(batches)], ga)
      marks.append(mark(dev))
    step_done()
    sync(dev)
    seconds = time.perf_counter() - start
    return seconds, seconds_between(marks, dev), float(loss.detach().float().cpu())

  set_accumulation(1)
  for step in range(args.warmup):
    seconds, _, loss = optimizer_step(1)
    rep.data.setdefault("warmup_step_s", []).append(round(seconds, 4))
    print(f"warm-up step {step}: {seconds:.2f} s  loss {loss:.4f}  host RSS {rss_gib():.1f} GiB", flush=True)
    rep.phase(f"warm-up step {step + 1}/{args.warmup} done")
  points = rep.data["points"] = []
  for ga, steps in zip(args.accumulation, args.steps):
    set_accumulation(ga)
    tokens = ga * args.micro_batch * args.seq
    point = {"grad_accum": ga, "micro_batch": args.micro_batch, "tokens_per_step": tokens, "step_s": [],
             "micro_batch_s": [], "loss": []}
    points.append(point)
    for step in range(steps):
      seconds, micro, loss = optimizer_step(ga)
      point["step_s"].append(round(seconds, 4))
      point["micro_batch_s"].append([round(s, 4) for s in micro])
      point["loss"].append(loss)
      print(f"accumulation {ga}, step {step}: {seconds:.2f} s  loss {loss:.4f}  {tokens / seconds:,.0f} tok/s  "
            f"host RSS {rss_gib():.1f} GiB", flush=True)
      rep.phase(f"accumulation {ga}: step {step + 1}/{steps} done")
    point.update(rates(rep, tokens, sum(point["step_s"]) / steps))
    rep.write()  # a point is finished when it has its tokens_per_s
  return points


def run_deepspeed(rep, args, cfg, dev):
  n = cfg.param_count()
  if args.offload_ratio == "auto":
    args.offload_ratio = auto_offload_ratio(n, args) if args.offload in ("all", "optimizer") else 1.0
    rep.note(f"--offload_ratio auto -> {args.offload_ratio}: the share of optimizer state (fp32 master, Adam m "
             f"and v, fp32 grads) DeepSpeed keeps on the CPU for --host_mem_gib {args.host_mem_gib:g}"
             + ("; the rest is updated on the GPU (DeepSpeed's partial offload)" if args.offload_ratio < 1 else ""))
  args.offload_ratio = float(args.offload_ratio)
  rep.data["config"]["offload_ratio"] = args.offload_ratio
  if args.offload != "all" or args.offload_ratio < 1:
    what = {"all": "params + optimizer", "param": "params only", "optimizer": "optimizer only", "none": "nothing"}
    rep.data["label"] = (f"DeepSpeed ZeRO-3, offload to pinned CPU: {what[args.offload]}"
                         + (f"; PARTIAL optimizer offload, ratio {args.offload_ratio} on the CPU, rest on the GPU"
                            if args.offload in ("all", "optimizer") and args.offload_ratio < 1 else ""))
  preflight_memory(rep, args, host_estimate_gb(n, args), gpu_estimate_gb(n, args, cfg))
  rep.phase("import deepspeed")
  import deepspeed
  rep.data["versions"]["deepspeed"] = deepspeed.__version__
  from deepspeed.accelerator import get_accelerator
  rep.data["deepspeed_accelerator"] = get_accelerator()._name
  rep.phase("init_distributed")
  deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), auto_mpi_discovery=False)

  conf = ds_config(args, cfg, 1)  # time_points sets each point's accumulation
  rep.data["ds_config"] = conf
  dtype = getattr(torch, args.dtype)

  rep.phase("build model under zero.Init")
  remote = "cpu" if args.offload in ("all", "param") else None
  # Import everything before zero.Init patches tensor creation: torch._dynamo (pulled in by transformers'
  # modeling_utils) refuses to load under DeepSpeed's patched torch.Tensor.__new__.
  importlib.import_module("torch._dynamo")
  cls, hc = hf_model_class(cfg), hf_config_obj(rep, cfg, args)
  with skip_hf_init_weights(), deepspeed.zero.Init(config_dict_or_path=conf, remote_device=remote,
                                                   pin_memory=remote is not None, dtype=dtype):
    model = cls(hc)
  rep.data["weights"] = ("random: torch's per-module default init run on the accelerator inside zero.Init "
                         "(HF init_weights pass skipped); values are irrelevant to throughput")
  n = count_params(model)
  rep.data["hf_param_count"] = n
  enable_checkpointing(rep, args, model)
  print(f"params {n / 1e9:.2f} B; host now {meminfo_gib()}", flush=True)

  rep.phase("optimizer (CPU Adam JIT build on first use)")
  params = [p for p in model.parameters() if p.requires_grad]
  opt, opt_name = None, None
  offloaded = args.offload in ("all", "optimizer")
  if args.optimizer == "cpu_adam" and not offloaded:
    raise ValueError("--optimizer cpu_adam needs the optimizer offloaded (--offload all or optimizer)")
  if args.optimizer == "cpu_adam" or (args.optimizer == "auto" and offloaded):
    try:
      from deepspeed.ops.adam import DeepSpeedCPUAdam
      t0 = time.perf_counter()
      opt = DeepSpeedCPUAdam(params, lr=args.lr, **ADAMW, adamw_mode=True)
      rep.data["cpu_adam_build_or_load_s"] = round(time.perf_counter() - t0, 1)
      opt_name = "DeepSpeedCPUAdam (AdamW mode)"
    except Exception as e:  # noqa: BLE001
      err = f"{type(e).__name__}: {e}"
      rep.data["cpu_adam_error"] = err
      rep.data["cpu_adam_traceback"] = traceback.format_exc()
      print("DeepSpeedCPUAdam failed:\n" + traceback.format_exc(), flush=True)
      if args.optimizer == "cpu_adam":
        raise
      if args.offload_ratio < 1:
        raise RuntimeError("DeepSpeed's partial optimizer offload (ratio < 1) needs DeepSpeedCPUAdam, "
                           f"which failed: {err}") from e
      rep.note("DeepSpeedCPUAdam could not be built/loaded; fell back to torch.optim.AdamW on the CPU partitions "
               "(zero_force_ds_cpu_optimizer=false): a weaker DeepSpeed baseline, labelled as such")
      rep.data["label"] += "; FALLBACK optimizer torch AdamW on the CPU (DeepSpeedCPUAdam failed)"
      conf["zero_force_ds_cpu_optimizer"] = False
  if opt is None:
    opt = torch.optim.AdamW(params, lr=args.lr, **ADAMW, fused=True)
    opt_name = f"torch.optim.AdamW (fused, on the {'CPU' if offloaded else 'device'})"
  rep.data["optimizer"] = opt_name

  rep.phase("deepspeed.initialize")
  engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
  engine.train()
  placement = getattr(engine.optimizer, "subgroup_to_device", None)
  if placement:
    sizes = [int(x) for x in getattr(engine.optimizer, "fp16_partitioned_groups_flat_numel", None) or
             [1] * len(placement)]
    on_cpu = sum(sz for i, sz in enumerate(sizes) if placement.get(i) == "cpu")
    rep.data["optimizer_state_on_cpu_fraction"] = round(on_cpu / max(1, sum(sizes)), 4)
    rep.data["optimizer_subgroups"] = {"count": len(placement), "on_cpu": sum(v == "cpu" for v in placement.values())}

  def micro_step(x, ga):
    out = engine(input_ids=x, labels=x, use_cache=False)
    engine.backward(out.loss)  # scaled by 1 / the engine's accumulation
    engine.step()  # DeepSpeed applies the optimizer at the accumulation boundary
    return out.loss

  def set_accumulation(ga):
    engine.set_train_batch_size(ga * args.micro_batch)
    engine.micro_steps = 0  # the boundary is every ga-th micro-step counted from here: each point starts on one

  rep.phase("train steps")
  points = time_points(rep, dev, args, micro_step, lambda: None, set_accumulation)
  # What the engine did, beside what was asked: one update per optimizer step, gradients accumulated in fp32.
  rep.data["optimizer_steps_applied"] = engine.global_steps
  buffer = getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
  rep.data["grad_accum_buffer_dtype"] = str(buffer.dtype).removeprefix("torch.") if buffer is not None else None
  return points


def run_fsdp(rep, args, cfg, dev):
  """Fallback: PyTorch FSDP2 (fully_shard) with CPUOffloadPolicy on one GPU; optimizer torch AdamW on the CPU."""
  import torch.distributed as dist
  from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

  per = {"float32": 4, "bfloat16": 2}[args.fsdp_master_dtype]
  preflight_memory(rep, args, cfg.param_count() * per * 4 / 1e9)  # params, grads, Adam m and v, all on the CPU
  rep.data["fsdp_master_dtype"] = args.fsdp_master_dtype
  rep.phase("init_process_group")
  dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
  if dev.type == "cuda":
    torch.cuda.set_device(dev)
  master = getattr(torch, args.fsdp_master_dtype)
  compute = getattr(torch, args.dtype)

  rep.phase("build model on meta, shard, materialise on CPU")
  hc = hf_config_obj(rep, cfg, args)
  with torch.device("meta"), skip_hf_init_weights():
    model = hf_model_class(cfg)(hc)
  model.to(master)
  enable_checkpointing(rep, args, model)
  mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
  offload = CPUOffloadPolicy(pin_memory=dev.type == "cuda")
  layers = model.model.layers if cfg.family == "llama" else model.model.decoder.layers
  for layer in layers:
    fully_shard(layer, mp_policy=mp, offload_policy=offload)
  fully_shard(model, mp_policy=mp, offload_policy=offload)
  model.to_empty(device="cpu")
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      local = p.to_local() if hasattr(p, "to_local") else p
      if "norm" in name or "layer_norm" in name:
        local.fill_(1.0) if name.endswith("weight") else local.zero_()
      else:
        local.uniform_(-0.02, 0.02, generator=g) if local.dim() > 1 else local.zero_()
  # Buffers (LLaMA's rotary inv_freq) were left uninitialised by to_empty: build those modules afresh, on the GPU,
  # where FSDP2's CPU offload expects buffers to be.
  for name, mod in list(model.named_modules()):
    if type(mod).__name__.endswith("RotaryEmbedding"):
      parent, _, attr = name.rpartition(".")
      with torch.device(dev):
        fresh = type(mod)(config=hc)
      setattr(model.get_submodule(parent) if parent else model, attr, fresh)
  for mod in model.modules():
    for bname, b in list(mod.named_buffers(recurse=False)):
      if b.device != dev:
        mod._buffers[bname] = b.to(dev)
  rep.data["weights"] = "random: uniform(-0.02, 0.02) on the CPU shards, norms 1; values irrelevant to throughput"
  rep.data["hf_param_count"] = sum(p.numel() for p in model.parameters())

  rep.phase("optimizer")
  opt = torch.optim.AdamW(model.parameters(), lr=args.lr, **ADAMW, fused=True)
  rep.data["optimizer"] = "torch.optim.AdamW (fused, CPU)"

  def micro_step(x, ga):
    out = model(input_ids=x, labels=x, use_cache=False)
    (out.loss / ga).backward()
    return out.loss

  def step_done():
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)

  rep.phase("train steps")
  return time_points(rep, dev, args, micro_step, step_done, lambda ga: None)


def hf_config_obj(rep, cfg, args):
  hc = hf_config(cfg)
  hc._attn_implementation = args.attn
  rep.data["hf_config"] = {k: v for k, v in hc.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}
  return hc


# ----------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--backend", choices=["deepspeed", "fsdp_cpu_offload"], default="deepspeed")
  ap.add_argument("--model", default="llama13b", help="an sljax preset (models/presets.py)")
  ap.add_argument("--override", action="append", default=[], help="preset field=value, repeatable")
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=16,
                  help="effective batch per optimizer step, in sequences (without --accumulation)")
  ap.add_argument("--micro_batch", type=int, default=0,
                  help="sequences per forward/backward; 0 = --batch (no accumulation)")
  ap.add_argument("--accumulation", default="",
                  help="comma-separated gradient accumulations to time one after the other on one engine (each "
                       "point's batch: micro_batch x accumulation); default: --batch / --micro_batch")
  ap.add_argument("--warmup", type=int, default=1, help="optimizer steps of one micro-batch before the points")
  ap.add_argument("--steps", default="2",
                  help="timed optimizer steps per point: one number for every point, or comma-separated, one each")
  ap.add_argument("--zero_set", action="append", default=[],
                  help="zero_optimization KEY=VALUE over this script's settings, repeatable; KEY dotted into its "
                       "sections (offload_param.pin_memory=false), VALUE JSON (true, 5e8)")
  ap.add_argument("--lr", type=float, default=1e-5)
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  ap.add_argument("--attn", default="sdpa", help="transformers attn_implementation")
  ap.add_argument("--no_grad_ckpt", dest="grad_ckpt", action="store_false")
  ap.add_argument("--ckpt_reentrant", action="store_true", help="torch.utils.checkpoint use_reentrant=True")
  ap.add_argument("--offload", choices=["all", "param", "optimizer", "none"], default="all",
                  help="what ZeRO-3 puts in pinned CPU memory (all = params and optimizer, the baseline)")
  ap.add_argument("--offload_ratio", default="1.0",
                  help="offload_optimizer.ratio: share of optimizer state on the CPU, the rest updated on the GPU "
                       "(DeepSpeed's partial offload); 'auto': the largest share that fits --host_mem_gib")
  ap.add_argument("--optimizer", choices=["auto", "cpu_adam", "torch_adamw"], default="auto",
                  help="auto: DeepSpeedCPUAdam when the optimizer is offloaded (falling back to torch AdamW, "
                       "labelled, if its JIT build fails), else torch's fused AdamW on the device")
  ap.add_argument("--fsdp_master_dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--host_mem_gib", type=float, default=0,
                  help="the machine's host RAM (128 GiB on one H200 machine, 256 on the two-GPU one); a run whose "
                       "host state cannot fit is recorded as failed up front. 0: no check (MemTotal is unreliable there)")
  ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
  ap.add_argument("--smoke", action="store_true", help="tiny model, short sequence, 2 steps: runs on a CPU")
  ap.add_argument("--out", default="", help="result JSON path")
  args = ap.parse_args(argv)
  if args.smoke:
    args.model, args.seq, args.batch = "llama-tiny", 64, 4
    args.override = args.override or ["num_layers=2", "hidden_size=64", "intermediate_size=128"]
    args.micro_batch = args.micro_batch or 2
    args.warmup = 1
  args.micro_batch = args.micro_batch or args.batch
  if args.offload_ratio != "auto":
    args.offload_ratio = float(args.offload_ratio)
  if args.accumulation:
    args.accumulation = [int(ga) for ga in args.accumulation.split(",")]
  elif args.batch % args.micro_batch:
    ap.error(f"--batch {args.batch} is not a multiple of --micro_batch {args.micro_batch}")
  else:
    args.accumulation = [args.batch // args.micro_batch]
  steps = [int(n) for n in str(args.steps).split(",")]
  args.steps = steps * len(args.accumulation) if len(steps) == 1 else steps
  if len(args.steps) != len(args.accumulation) or min(args.accumulation + args.steps) < 1:
    ap.error(f"--accumulation {args.accumulation} and --steps {args.steps}: one count >= 1 of timed steps for "
             "every point, or one for all")
  return args


def _sigterm(signum, frame):
  raise SystemExit(f"killed by signal {signum} (timeout?)")


def main(argv=None):
  args = parse_args(argv)
  signal.signal(signal.SIGTERM, _sigterm)  # `timeout` sends TERM: still write the JSON, status failed
  rep = Report(args.out)
  status = 1
  with HostMemorySampler() as mem:
    try:
      cfg = get_config(args.model, args.override)
      dev = torch.device(args.device if args.device != "auto" else ("cuda:0" if torch.cuda.is_available() else "cpu"))
      if dev.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
      if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
      # As benchmarks.train_throughput: gradient checkpointing recomputes each layer's forward.
      flops = training_flops(cfg, args.seq, cfg.num_layers if args.grad_ckpt else 0)
      peak = rates_of(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu").peak_flops
      rep.data.update(
          backend=args.backend,
          label=("DeepSpeed ZeRO-3, offload_param + offload_optimizer to pinned CPU" if args.backend == "deepspeed"
                 else "FALLBACK: PyTorch FSDP2 (fully_shard) with CPUOffloadPolicy, one GPU"),
          versions=versions(), device=device_info(dev),
          config=vars(args), optimizer_settings=optimizer_settings(args),
          model={"preset": args.model, **dataclasses.asdict(cfg), "sljax_param_count": cfg.param_count()},
          flops_per_token=flops.model, peak_flops=peak, hardware_flops_per_token=flops.hardware,
          mfu_formula=f"tokens/s * models.presets.get_config(model).flops_per_token(seq) / {peak:g} "
                      "(6 x matmul params + causal attention; recompute not counted)")
      run = run_deepspeed if args.backend == "deepspeed" else run_fsdp
      last = run(rep, args, cfg, dev)[-1]
      rep.data.update({k: last[k] for k in ("step_s", "loss", "step_s_mean", "tokens_per_s", "mfu", "hfu")},
                      status="ok", params_match_sljax=rep.data.get("hf_param_count") == cfg.param_count())
      status = 0
    except BaseException as e:  # noqa: BLE001 -- record everything, KeyboardInterrupt and SystemExit included
      rep.data.update(status="failed", failed_in_phase=rep.data["phase"], error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc())
      print(f"FAILED in phase {rep.data['phase']!r}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
      traceback.print_exc()
  if torch.cuda.is_available() and rep.data.get("device", {}).get("torch_device", "").startswith("cuda"):
    rep.data["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    rep.data["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
  ru_maxrss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux
  rep.data["peak_host_rss_gib"] = round(max(mem.peak_rss, ru_maxrss_gib), 2)
  rep.data["peak_host_used_gib"] = round(mem.peak_used, 2)
  rep.data["meminfo_gib_at_end"] = meminfo_gib()
  rep.phase("done" if status == 0 else "failed")
  summary = {k: rep.data.get(k) for k in ("status", "backend", "optimizer", "tokens_per_s", "mfu", "step_s",
                                          "peak_gpu_reserved_gib", "peak_host_rss_gib", "error")}
  print("RESULT", json.dumps(summary), flush=True)
  try:
    import torch.distributed as dist
    if dist.is_initialized():
      dist.destroy_process_group()
  except Exception:  # noqa: BLE001
    pass
  return status


if __name__ == "__main__":
  code = main()
  sys.stdout.flush()
  sys.stderr.flush()
  # Skip the interpreter's teardown: it frees the pinned host memory tensor by tensor, which for llama13b's
  # ~250 GiB outlasted the time limit of a run whose JSON was already complete.
  os._exit(code)
