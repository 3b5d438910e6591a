"""From a training request to a running loop: the model and its recipe, the step (the all-on-device one or the
offload engine) and its plan, the budgets and XLA's pinned pools. train.py is these functions behind flags; called
from Python with the same configs they make the same decisions and print the same lines (generate.py's room is
sljax.generate_launch). The request's types are sljax.request's, what a resumed checkpoint asks sljax.resume's, the
steps sljax.steps'.

  request = Request(LaunchConfig(model="llama13b"), RunConfig(steps=40), optim={"grad_clip_norm": 0})
  launch.start(request.launch)  # before anything touches a device
  history = launch.train(launch.prepare(request))
  # LoRA: adapters of rank 16 on a frozen base (the Hugging Face weights of --hf_dir), through sljax.lora.engine
  request = Request(LaunchConfig(hf_dir="Llama-2-7b-hf"), RunConfig(steps=1000), lora=LoraConfig())

Messages call the fields of LaunchConfig and of the configs by their train.py flags (--engine, --sub_batches): the
flags are those fields.
"""

import dataclasses
import os
import time

import jax
from absl import logging

from models.config import ModelConfig
from models.hf import HFWeights
from models.presets import build, get_config, parse_overrides
from sljax import memory, metrics, trainer
from sljax.data import DataConfig, make_source
from sljax.lora.engine import lora_flops_per_token
from sljax.lora.checkpoint import describe_base
from sljax.lora.model import LoraModel
from sljax.lora.plan import plan_lora
from sljax.machines import (GIB, MACHINES, PINNED_POOL_HEADROOM, Budget, Machine, configure_process, default_budget,
                             pinned_pool_bytes, target_budget)
from sljax.mesh import check_batch, initialize_distributed, make_mesh, parse_mesh
from sljax.optim import RECIPES, OptimConfig, learning_rate_schedule, make_optimizer, recipe_for, run_decay_steps
from sljax.plan import make_plan, plan_batch
from sljax.request import FINE_TUNING_LEARNING_RATE, ClusterConfig, Configs, Job, LaunchConfig, Request
from sljax.resume import check_lora_resume, check_resumable, lora_meta, resumed_moments
from sljax.steps import check_fits, fine_tuned, lora_engine, make_step, training_state_bytes


# ---- before the backend starts -----------------------------------------------------------------------------------

def start(launch: LaunchConfig, cluster: ClusterConfig = ClusterConfig()):
  """Sets XLA's memory limits and joins the other processes of a multi-host run: call it before anything touches a
  device, in every process. ValueError or TimeoutError when that cannot be done."""
  configure_process(launch.host_memory_gib)  # as the CLIs and benchmarks: one rule (sljax.machines)
  initialize_distributed(cluster.coordinator_address, cluster.num_processes, cluster.process_id,
                         cluster.distributed_timeout_s)


# ---- the model and its recipe ------------------------------------------------------------------------------------

def model_name(launch: LaunchConfig) -> str:
  return os.path.basename(os.path.normpath(launch.hf_dir)) if launch.hf_dir else launch.preset


def recipe_name(launch: LaunchConfig, model_cfg: ModelConfig) -> str:
  """The preset whose recipe the run takes: --model's, or for --hf_dir its family's nearest in parameters."""
  return recipe_for(model_cfg) if launch.hf_dir else launch.preset


def batch_planned(request: Request, model_cfg: ModelConfig) -> bool:
  """Whether the offload engine's plan chooses the batch: neither the request nor the recipe sets it (the on-device
  step then takes DataConfig's)."""
  return "batch_size" not in request.data and RECIPES[recipe_name(request.launch, model_cfg)].batch_size is None


def resolve(request: Request) -> Configs:
  """The run's configs: the request over its preset's recipe; ValueError on a bad value. Prints a line for each
  default it adapts."""
  launch, data, optim, steps = request.launch, request.data, request.optim, request.run.steps
  weights = HFWeights(launch.hf_dir, **parse_overrides(launch.overrides)) if launch.hf_dir else None  # no tensor yet
  model_cfg = weights.cfg if weights else get_config(launch.preset, launch.overrides)
  name = recipe_name(launch, model_cfg)
  recipe = RECIPES[name]
  if launch.hf_dir:
    print(f"note: {model_name(launch)} ({model_cfg.param_count() / 1e9:.2f} B params) has no preset: it trains with "
          f"{name}'s recipe, the nearest {model_cfg.family} preset in size")
  if request.lora and not launch.hf_dir:
    print("note: --lora_rank without --hf_dir fine-tunes adapters on a random base: for benchmarks only")
  batch_size = DataConfig.batch_size if batch_planned(request, model_cfg) else data.get("batch_size", recipe.batch_size)
  data_cfg = DataConfig(**{**data, "seq_len": data.get("seq_len", recipe.seq_len), "batch_size": batch_size})
  warmup = optim.get("warmup_steps", recipe.optim.warmup_steps)
  lora_rate = request.lora is not None and "learning_rate" not in optim
  peak = FINE_TUNING_LEARNING_RATE if lora_rate else optim.get("learning_rate", recipe.optim.learning_rate)
  decay, note = run_decay_steps(steps, warmup, peak)  # a short run never reaches the peak (sljax.optim)
  if note and "decay_steps" not in optim:
    print(note)
  if lora_rate:
    print(f"note: LoRA fine-tunes at a peak learning rate of {FINE_TUNING_LEARNING_RATE:g}, not the recipe's "
          f"{recipe.optim.learning_rate:g}, which trains every weight from scratch (--learning_rate sets it)")
  optim_cfg = dataclasses.replace(recipe.optim, **{**optim, "warmup_steps": warmup,
                                                   "decay_steps": optim.get("decay_steps", decay)},
                                  **({"learning_rate": FINE_TUNING_LEARNING_RATE} if lora_rate else {}))
  run_cfg = dataclasses.replace(request.run, workdir=request.run.workdir or os.path.join("runs", model_name(launch)))
  return Configs(model_cfg, data_cfg, optim_cfg, run_cfg, weights)


def recipe_line(request: Request, configs: Configs, planned: bool) -> str:
  """The recipe in force, the request applied, in one line."""
  batch = f"batch {configs.data.batch_size}" + (" (the plan's)" if planned else "")
  name = recipe_name(request.launch, configs.model)
  return (f"recipe of {name} ({RECIPES[name].source}, flags applied): {configs.optim.describe()}; "
          f"seq_len {configs.data.seq_len}, {batch}")


# ---- the step: on the device, or the offload engine and its plan -------------------------------------------------

def fits_on_device(launch: LaunchConfig, model_cfg: ModelConfig, optim_cfg: OptimConfig, device: jax.Device) -> bool:
  """Whether the all-on-device training state fits (on one GPU of --target when given)."""
  if launch.target:
    return training_state_bytes(model_cfg, optim_cfg) <= MACHINES[launch.target].allocator_bytes
  try:
    check_fits(model_name(launch), model_cfg, optim_cfg, device)
    return True
  except ValueError:
    return False


def auto_runs_on_device(launch: LaunchConfig, model_cfg: ModelConfig, optim_cfg: OptimConfig,
                        device: jax.Device) -> bool:
  """--engine=auto's choice: the on-device step on a CPU whose memory holds the training state; on an accelerator
  (this one or --target's) always the offload engine. Its plan keeps every group's state on the device where it fits
  and recomputes only the layers outside its residual-keeping tail, where the on-device step recomputes every layer
  and counts no activations or update temporaries when it checks the fit. On the H200 the on-device step ran llama7b
  at 45.4% MFU against the offload engine's 47.3%, and llama13b with 8-bit moments (state 122 of 132 GiB) out of
  memory in its first step."""
  return device.platform == "cpu" and not launch.target and fits_on_device(launch, model_cfg, optim_cfg, device)


def local_devices(mesh: jax.sharding.Mesh) -> int:
  """The mesh's devices in this process. The host budget is this process's: each of them keeps its own share of the
  host-resident state in pinned memory (a whole copy under pure data parallel), so each plans with an equal part."""
  return sum(d.process_index == jax.process_index() for d in mesh.devices.flat)


def plan_budget(launch: LaunchConfig, device: jax.Device, target: Machine | None, local: int = 1) -> Budget:
  """One device's budget for its plan: a GPU of --target's or this device, --device_memory_gib and this process's
  --host_memory_gib (an equal share for each of its `local` devices) replacing what they give."""
  budget = target_budget(target, sharing=local) if target else default_budget(device, sharing=local)
  return Budget(int(launch.device_memory_gib * GIB) or budget.device_bytes,
                int(launch.host_memory_gib * GIB) // local or budget.host_bytes)


def choose_engine(request: Request, configs: Configs, mesh: jax.sharding.Mesh) -> tuple:
  """(model config, data config, optim config, EngineConfig or None for the all-on-device step (LoraEngineConfig
  for a LoRA request), the pinned host bytes its plan counts for each device). On the offload engine the plan
  settles what the request and the recipe leave open: the batch, and a bf16 first moment where fp32 moments do not
  fit. Prints the plan (and a line for each choice) when offloading or fine-tuning adapters."""
  if request.lora is not None:
    return choose_lora_engine(request, configs, mesh)
  launch, model_cfg, data_cfg, optim_cfg = request.launch, configs.model, configs.data, configs.optim
  device = jax.devices()[0]
  target = MACHINES[launch.target] if launch.target else None
  check_resumable(configs.run.workdir)  # a checkpoint fixes no placement: this run's own plan chooses it
  moments = resumed_moments(request, configs.run.workdir)
  if moments:
    optim_cfg = dataclasses.replace(optim_cfg, moments_dtype=moments)
  mode = launch.engine
  if mode == "auto":
    mode = "device" if auto_runs_on_device(launch, model_cfg, optim_cfg, device) else "offload"
  offload_only = [f"--{name}" for name in ("sub_batches", "live_layers", "tail_layers", "trade_state_for_tail")
                  if getattr(launch, name)]
  offload_only += [f"--parked_grads_dtype={launch.parked_grads_dtype}"] * (launch.parked_grads_dtype != "float32")
  if launch.parked_grads_dtype != "float32" and not optim_cfg.grad_clip_norm:
    raise ValueError(f"--parked_grads_dtype={launch.parked_grads_dtype} narrows the gradients that wait for clipping's "
                     f"global norm, but --grad_clip_norm=0 parks none")
  if mode == "device" and offload_only and not launch.plan:
    chosen = "the auto engine chose the on-device step (a CPU; the training state fits)" if launch.engine == "auto" else (
        "--engine=device runs the on-device step")
    raise ValueError(f"{' and '.join(offload_only)} shape the offload engine's step, but {chosen}: add "
                     f"--engine=offload to use them")
  if mode == "device" and not launch.plan:
    check_fits(model_name(launch), model_cfg, optim_cfg, device)
    return model_cfg, data_cfg, optim_cfg, None, 0
  if mode == "device":
    print(f"note: training would run the on-device step (batch {data_cfg.batch_size}: the training state fits); "
          f"the plan below is the offload engine's (--engine=offload)")
  # The engine runs its model without per-layer remat (each group's backward recomputes the group's forward); the
  # config says so too, so that the run's saved model config and its plan describe the model the step runs.
  model_cfg = dataclasses.replace(model_cfg, remat=False)
  local = local_devices(mesh)
  budget = plan_budget(launch, device, target, local)
  model = build(model_cfg)
  planned = batch_planned(request, model_cfg)
  live_layers, tail_layers = launch.live_layers, launch.tail_layers

  def plan_with(optim_cfg):  # the plan sizes one device's work: its rows, its 1/fsdp share of the layer state
    args = dict(sub_batches=launch.sub_batches, live_layers=live_layers, tail_layers=tail_layers,
                fsdp=mesh.shape["fsdp"], target=target, optimizer=make_optimizer(optim_cfg, clip=False),
                grad_clip_norm=optim_cfg.grad_clip_norm, parked_grads_dtype=launch.parked_grads_dtype,
                trade_state_for_tail=launch.trade_state_for_tail)
    if planned:
      return plan_batch(model, data_cfg.seq_len, budget, devices=mesh.size, **args)
    return make_plan(model, data_cfg.seq_len, data_cfg.batch_size // mesh.size, budget, **args), None

  try:
    (plan, why), error = plan_with(optim_cfg), None
  except ValueError as fp32_error:
    (plan, why), error = (None, None), fp32_error
  if "moments_dtype" not in request.optim and optim_cfg.moments_dtype == "float32" and (
      plan is None or (planned and not plan.compute_bound)):
    bf16 = dataclasses.replace(optim_cfg, moments_dtype="bfloat16")
    try:
      plan16, why16 = plan_with(bf16)
    except ValueError as bf16_error:
      if plan is None:
        error = ValueError(f"{bf16_error} (with a bf16 first moment, which needs less than fp32 moments)")
    else:
      if plan is None or plan16.compute_bound:
        print(f"note: fp32 Adam moments do not fit {'a compute-bound batch' if plan else 'at all'}; training with a "
              f"bf16 first moment (optax keeps the second in fp32): --moments_dtype=float32 insists")
        plan, why, optim_cfg = plan16, why16, bf16
  if plan is None:
    elsewhere = launch.plan and not target and device.platform == "cpu"
    raise ValueError(f"{error}" + ("; to plan for a GPU from this machine: --target=h200 (or h100-80gb, a100-80gb)"
                                   if elsewhere else ""))
  if planned:
    data_cfg = dataclasses.replace(data_cfg, batch_size=plan.rows * mesh.size)
    print(f"note: {why}")
  per_device = f" (per device, {local} on this host)" if local > 1 else ""
  on = f" on one {target.name} (--target)" if target else ""
  print(f"plan for {model_name(launch)}{on}, batch {data_cfg.batch_size} x {data_cfg.seq_len}{per_device}:\n"
        f"{plan.describe()}")
  if target and device.platform == "cpu":
    print("compiled step peak: this CPU's compile of each call, scaled by the GPU/CPU ratio measured for that call "
          "on llama13b at 8 x 2048 (sljax.plan.gpu_peak_from_cpu): an estimate for other shapes")
  return (model_cfg, data_cfg, optim_cfg, dataclasses.replace(plan.engine, int8_exchange=launch.int8_exchange),
          plan.footprint.host_bytes)


def check_lora_request(launch: LaunchConfig):
  """ValueError when a flag of LaunchConfig asks for what the LoRA engine does not do."""
  asked = [f"--{name}" for name in ("int8_exchange", "trade_state_for_tail") if getattr(launch, name)]
  asked += [f"--parked_grads_dtype={launch.parked_grads_dtype}"] * (launch.parked_grads_dtype != "float32")
  asked += [f"--engine={launch.engine}"] * (launch.engine != "auto")
  asked += [f"--mesh={launch.mesh}"] * (parse_mesh(launch.mesh)["fsdp"] > 1 if launch.mesh else False)
  if asked:
    raise ValueError(f"{' and '.join(asked)} shape full training; --lora_rank fine-tunes through the LoRA engine, on "
                     f"one device or data parallel (--mesh=data:N, the whole frozen base on every device), whose plan "
                     f"places the frozen base (--sub_batches, --live_layers, --tail_layers and the memory budgets "
                     f"apply)")


def choose_lora_engine(request: Request, configs: Configs, mesh: jax.sharding.Mesh) -> tuple:
  """choose_engine for a LoRA request: sljax.lora.plan.plan_lora for each device of the (data-parallel) mesh settles
  the layout (how much of the base stays on the device) and, where the request and the recipe leave it open, the
  batch. Prints the plan."""
  launch, model_cfg, data_cfg = request.launch, configs.model, configs.data
  # The engine runs without per-layer remat (each group's backward recomputes it); the saved config says so.
  model_cfg = dataclasses.replace(model_cfg, remat=False)
  planned = batch_planned(request, model_cfg)
  target = MACHINES[launch.target] if launch.target else None
  local = local_devices(mesh)
  plan = plan_lora(LoraModel(build(model_cfg), request.lora), data_cfg.seq_len,
                   plan_budget(launch, jax.devices()[0], target, local), batch=0 if planned else data_cfg.batch_size,
                   sub_batches=launch.sub_batches, live_layers=launch.live_layers or 1,
                   optimizer=make_optimizer(configs.optim), target=target, tail_layers=launch.tail_layers or None,
                   devices=mesh.size)
  if planned:
    data_cfg = dataclasses.replace(data_cfg, batch_size=plan.batch)
    why = plan.batch_why or ("the fewest rows whose passes are compute-bound" if plan.compute_bound
                             else "the most rows that fit")
    print(f"note: batch {plan.batch}, the LoRA plan's: {why}")
  per_device = f" (per device, {local} on this host)" if mesh.size > 1 else ""
  print(f"plan for {model_name(launch)}, batch {data_cfg.batch_size} x {data_cfg.seq_len}{per_device}:\n"
        f"{plan.describe()}")
  return model_cfg, data_cfg, configs.optim, plan.engine, plan.footprint.host_bytes


def has_pinned_pool(device: jax.Device) -> bool:
  """Whether XLA keeps a pinned host pool for this device (a GPU's; on a CPU pinned host memory is plain RAM)."""
  return device.platform == "gpu"


def grow_pinned_pools(mesh: jax.sharding.Mesh, pinned_bytes: int):
  """On GPUs, grows each local device's pinned host pool to what its plan counts there (PINNED_POOL_HEADROOM above
  it, within the pool's cap) before the first step, so that no step waits while the pool pins more memory
  (sljax.memory.grow_pinned_pools); logs what it held and how long that took. Elsewhere there is no such pool."""
  devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index() and has_pinned_pool(d)]
  if not (devices and pinned_bytes):
    return
  start = time.perf_counter()
  held = memory.grow_pinned_pools(devices, min(int(pinned_bytes * PINNED_POOL_HEADROOM),
                                               pinned_pool_bytes() - 2 * memory.POOL_CHUNK_BYTES))
  logging.info("pinned host pool: grew to hold %.1f GiB a device (the plan counts %.1f) in %.1f s", held / GIB,
               pinned_bytes / GIB, time.perf_counter() - start)


# ---- the run -----------------------------------------------------------------------------------------------------

def prepare(request: Request) -> Job:
  """Checks the request and settles what it leaves open (the recipe's values, the engine, the plan), printing the
  plan when it offloads and the recipe line. Everything that can be wrong with the request raises ValueError here,
  before the workdir or any array exists."""
  launch = request.launch
  if request.lora is not None:
    check_lora_request(launch)
  configs = resolve(request)
  layers = configs.model.num_layers
  too_many = [f"--{name}={getattr(launch, name)}" for name in ("live_layers", "tail_layers")
              if getattr(launch, name) > layers]
  if too_many:
    raise ValueError(f"{' and '.join(too_many)}: more than the model's {layers} layers")
  if not launch.plan:
    trainer.check_workdir(configs.run.workdir)
    metrics.check_writable_file(configs.run.loss_log, what="loss_log", workdir=configs.run.workdir)
    metrics.check_logger()
    if request.lora is not None:
      check_lora_resume(configs.run.workdir, lora_meta(request, configs))
  source = make_source(configs.data, configs.model.max_positions, configs.model.vocab_size,
                       configs.run.eval_every > 0)  # held-out text too, for --eval_every
  # LoRA: one device unless --mesh asks for data parallel (check_lora_request refuses fsdp)
  mesh = make_mesh((launch.mesh or "data:1,fsdp:1") if request.lora is not None else launch.mesh)
  model_cfg, data_cfg, optim_cfg, engine_cfg, pinned_bytes = choose_engine(request, configs, mesh)
  check_batch(data_cfg.batch_size, engine_cfg.sub_batches if engine_cfg else 1, mesh)
  if data_cfg != configs.data:  # the plan chose the batch: the corpus read stays, the windows per step change
    source = source.with_config(data_cfg)
  configs = configs._replace(model=model_cfg, data=data_cfg, optim=optim_cfg)
  if configs.run.eval_every:
    source.eval_batches(configs.run.eval_batches)  # enough held-out text for them, at the batch the run trains at
  print(recipe_line(request, configs, batch_planned(request, model_cfg) and engine_cfg is not None))
  if request.lora is not None:
    lora = request.lora
    print(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, adapters on {', '.join(lora.targets) or 'every projection'} "
          f"of each layer; the frozen base: {describe_base(lora_meta(request, configs)['base'])}"
          + (f", its kernels as int{lora.base_bits} codes with scales" if lora.base_bits else ""))
  return Job(request, configs, engine_cfg, mesh, source, pinned_bytes)


def train(job: Job) -> dict[int, float]:
  """Trains a prepared job (sljax.trainer.train: resumes, logs, checkpoints); returns {step: loss} of the steps run."""
  request, (model_cfg, data_cfg, optim_cfg, run_cfg, weights) = job.request, job.configs
  launch = request.launch
  logging.info("%s: %.1f M params, %s compute on %s; workdir %s", model_name(launch), model_cfg.param_count() / 1e6,
               model_cfg.dtype, jax.devices()[0].device_kind, run_cfg.workdir)
  meta = {"model": model_name(launch), "hf_dir": launch.hf_dir, "overrides": list(launch.overrides),
          "model_config": dataclasses.asdict(model_cfg), "data": dataclasses.asdict(data_cfg),
          "optim": dataclasses.asdict(optim_cfg)}
  learning_rate = learning_rate_schedule(optim_cfg)
  grow_pinned_pools(job.mesh, job.pinned_bytes)
  if request.lora is not None:  # the weights are the frozen base, held by the engine; the state starts fresh
    engine = lora_engine(model_cfg, optim_cfg, request.lora, job.engine, weights, data_cfg.seed, job.mesh)
    recomputed = model_cfg.num_layers - (engine.groups[-1][1] - engine.groups[-1][0])  # all but the last group's
    return trainer.train(fine_tuned(engine, run_cfg.workdir), job.source, run_cfg,
                         {**meta, "lora": lora_meta(request, job.configs)}, learning_rate,
                         lora_flops_per_token(engine.model, data_cfg.seq_len, recomputed), devices=job.mesh.size)
  mesh = job.mesh if job.mesh.size > 1 else None
  # The offload engine recomputes every group's layers but the last group's; the on-device step with remat, each layer.
  recomputed = (job.engine.bounds(model_cfg.num_layers)[-1][0] if job.engine is not None
                else model_cfg.num_layers if model_cfg.remat else 0)
  return trainer.train(make_step(model_cfg, optim_cfg, job.engine, mesh), job.source, run_cfg, meta, learning_rate,
                       metrics.training_flops(model_cfg, data_cfg.seq_len, recomputed), devices=job.mesh.size,
                       init_params=weights)
