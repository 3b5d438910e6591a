"""From a training request to a running loop: the model and its recipe, the step (the all-on-device one or the
offload engine) and its plan, the budgets and XLA's pinned pools. train.py is these functions behind flags; called
from Python with the same configs they make the same decisions and print the same lines (generate.py's room is
sljax.generate_launch).

  request = launch.Request(launch.LaunchConfig(model="llama13b"), RunConfig(steps=40), optim={"grad_clip_norm": 0})
  launch.start(request.launch)  # before anything touches a device
  history = launch.train(launch.prepare(request))
  # LoRA: adapters of rank 16 on a frozen base (the Hugging Face weights of --hf_dir), through sljax.lora's engine
  request = launch.Request(launch.LaunchConfig(hf_dir="Llama-2-7b-hf"), RunConfig(steps=1000), lora=LoraConfig())

Messages call the fields of LaunchConfig and of the configs by their train.py flags (--engine, --sub_batches): the
flags are those fields.
"""

import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import logging

from models.common import params_reader
from models.config import ModelConfig
from models.hf import HFWeights
from models.presets import build, get_config, parse_overrides
from sljax import metrics, schedule, trainer
from sljax.checkpoint import newest_checkpoint, saved_groups
from sljax.data import DataConfig, Source, make_source
from sljax.lora import (FINE_TUNING_LEARNING_RATE, LoraConfig, LoraEngine, LoraEngineConfig, LoraModel,
                        describe_base, lora_flops_per_token, plan_lora, random_base_key, run_meta, split_adapters)
from sljax.machines import (GIB, MACHINES, PINNED_POOL_ENV, Budget, Machine, available_ram_bytes, cap_pinned_pools,
                            default_budget, reserve_gpu_memory, target_budget)
from sljax.memory import Placement
from sljax.mesh import PER_DEVICE, check_batch, initialize_distributed, make_mesh, parse_mesh
from sljax.optim import RECIPES, OptimConfig, learning_rate_schedule, make_optimizer, recipe_for
from sljax.plan import make_plan, optimizer_bytes_per_param, plan_batch
from sljax.schedule import EngineConfig
from sljax.sizes import model_sizes
from sljax.trainer import RunConfig

DEFAULT_MODEL = "llama-tiny"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """What to train and how, beyond the data, optimizer and run configs: the model, the step, what its plan may use."""

  model: str | None = None  # model preset (models.presets.PRESETS); None: DEFAULT_MODEL, unless hf_dir names one
  overrides: tuple[str, ...] = ()  # model config override field=value, repeatable (e.g. --set num_layers=8)
  # start from these Hugging Face LLaMA/OPT weights (config.json + *.safetensors) instead of a random init; the model
  # is the one its config.json describes (--set still applies)
  hf_dir: str = ""
  # training step: the plain all-on-device step, the SpeedLoader offload engine, or auto (device when the training
  # state fits on the device, else offload)
  engine: typing.Literal["auto", "device", "offload"] = "auto"
  sub_batches: int = 0  # offload engine: sub-batches per step (0: the plan chooses)
  live_layers: int = 0  # offload engine: layers per group fetched to the device at once (0: plan)
  # offload engine: layers in the last group, which keep their residuals instead of being recomputed (0: the plan
  # chooses; equal to --live_layers: no longer tail than the other groups)
  tail_layers: int = 0
  int8_exchange: bool = False  # offload engine: stash hidden states in host memory as int8 rows (inexact)
  # devices as data:D,fsdp:F, D x F dividing the device count (default: fsdp over each host's devices, data parallel
  # across hosts)
  mesh: str = ""
  plan: bool = False  # print the offload engine's plan (placement, bytes per tier, step-time bound), exit
  # with --plan: plan for one GPU of this kind (its allocator limit, pinned budget, peak and copy rate from
  # sljax.machines) instead of this machine's device
  target: typing.Literal[("", *MACHINES)] = ""
  device_memory_gib: float = 0  # device memory the plan may use (0: the allocator's limit)
  # pinned host memory this process may use, split evenly among its devices (0: the default host budget,
  # sljax.machines.default_budget)
  host_memory_gib: float = 0

  def __post_init__(self):
    if self.hf_dir and self.model is not None:
      raise ValueError("give --model or --hf_dir (whose config.json names the model), not both")
    for name in ("engine", "target"):  # the flags check these; a library caller's typo must not pick a step
      choices = typing.get_args(typing.get_type_hints(LaunchConfig)[name])
      if getattr(self, name) not in choices:
        raise ValueError(f"--{name} must be one of {', '.join(map(repr, choices))}, got {getattr(self, name)!r}")
    if self.target and not self.plan:
      raise ValueError(f"--target={self.target} plans for a machine this is not: use it with --plan")
    for name in ("sub_batches", "live_layers", "tail_layers"):
      if getattr(self, name) < 0:
        raise ValueError(f"--{name} must be >= 0 (0: the plan chooses), got {getattr(self, name)}")
    for name in ("device_memory_gib", "host_memory_gib"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"--{name} must be a number of GiB > 0 (0: the default), got {value}")

  @property
  def preset(self) -> str:
    return self.model or DEFAULT_MODEL


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """Several hosts, one process on each, all running the same command (sljax.mesh.initialize_distributed)."""

  # several hosts: process 0's host:port, the same on every host (default: $JAX_COORDINATOR_ADDRESS; under SLURM,
  # srun's)
  coordinator_address: str = ""
  num_processes: int = 0  # several hosts: processes in the run, one per host (default: $JAX_NUM_PROCESSES or SLURM's)
  # several hosts: this process's index, 0 on the coordinator (default: $JAX_PROCESS_ID or SLURM's)
  process_id: int = -1
  # several hosts: give up when the coordinator or a process has not joined after this many seconds
  distributed_timeout_s: int = 300


@dataclasses.dataclass(frozen=True)
class Request:
  """A training run as asked for. `data` and `optim` hold the DataConfig and OptimConfig fields the request sets; the
  others are the recipe's (seq_len, the batch where it has one, every OptimConfig field, decay_steps: run.steps) or
  DataConfig's."""

  launch: LaunchConfig = LaunchConfig()
  run: RunConfig = RunConfig()
  data: Mapping[str, typing.Any] = dataclasses.field(default_factory=dict)
  optim: Mapping[str, typing.Any] = dataclasses.field(default_factory=dict)
  # fine-tune these LoRA adapters on the frozen weights (--hf_dir's, else a random base) instead of every weight; the
  # learning rate, unless `optim` sets it, is then sljax.lora.FINE_TUNING_LEARNING_RATE
  lora: LoraConfig | None = None


class Configs(NamedTuple):
  model: ModelConfig
  data: DataConfig
  optim: OptimConfig
  run: RunConfig
  weights: HFWeights | None  # the initial weights (LoRA: the frozen base); None: a random init


class Job(NamedTuple):
  """A checked request, ready to train: its configs (the plan's choices applied), its step's config and devices."""

  request: Request
  configs: Configs
  engine: EngineConfig | LoraEngineConfig | None  # None: the all-on-device step
  mesh: jax.sharding.Mesh
  source: Source


# ---- before the backend starts -----------------------------------------------------------------------------------

def start(launch: LaunchConfig, cluster: ClusterConfig = ClusterConfig()):
  """Sets XLA's memory limits and joins the other processes of a multi-host run: call it before anything touches a
  device, in every process. ValueError or TimeoutError when that cannot be done."""
  # The plan packs optimizer state into the device memory it is given: give XLA nearly all of each GPU (the benchmarks
  # run at this value).
  reserve_gpu_memory()
  set_pinned_pool(launch)
  initialize_distributed(cluster.coordinator_address, cluster.num_processes, cluster.process_id,
                         cluster.distributed_timeout_s)


def set_pinned_pool(launch: LaunchConfig):
  """Caps each GPU's pinned pool at its share of --host_memory_gib plus 10% (or of the default host budget), so that
  host-resident state fits but the pools' growth cannot take the whole machine."""
  if PINNED_POOL_ENV in os.environ:
    return
  cap_pinned_pools(launch.host_memory_gib * GIB * 1.1 if launch.host_memory_gib else None)


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
  # Warmup takes at most half of a run: Adam's first updates move every weight by about the rate, all in the
  # gradient's sign, so a short run that reaches the peak within a few steps diverges at full width.
  if "warmup_steps" not in optim and "decay_steps" not in optim and steps < 2 * warmup:
    warmup = steps // 2
    print(f"note: --steps={steps} is shorter than twice the recipe's {recipe.optim.warmup_steps} warmup steps: "
          f"warming up over {warmup} (half the run) and decaying over the {steps} (--warmup_steps, "
          f"--decay_steps set them)")
  lora_rate = request.lora is not None and "learning_rate" not in optim
  if lora_rate:
    print(f"note: LoRA fine-tunes at a peak learning rate of {FINE_TUNING_LEARNING_RATE:g}, not the recipe's "
          f"{recipe.optim.learning_rate:g}, which trains every weight from scratch (--learning_rate sets it)")
  optim_cfg = dataclasses.replace(recipe.optim, **{**optim, "warmup_steps": warmup,
                                                   "decay_steps": optim.get("decay_steps", steps)},
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

def training_state_bytes(model_cfg: ModelConfig, optim_cfg: OptimConfig) -> int:
  """Master weights, gradients and the optimizer's state; activations come on top."""
  param_bytes = jnp.dtype(model_cfg.param_dtype).itemsize
  per_param = 2 * param_bytes + optimizer_bytes_per_param(make_optimizer(optim_cfg), model_cfg.param_dtype)
  return int(model_cfg.param_count() * per_param)


def memory_available(device: jax.Device) -> int | None:
  """Bytes a training state may use: the accelerator's allocator limit, or the host's available RAM on CPU; None
  when the platform does not say."""
  if device.platform == "cpu":
    return available_ram_bytes()
  return (device.memory_stats() or {}).get("bytes_limit")


def check_fits(model_name: str, model_cfg: ModelConfig, optim_cfg: OptimConfig, device: jax.Device):
  """Raises ValueError before anything is allocated when the all-on-device training state cannot fit."""
  needed, available = training_state_bytes(model_cfg, optim_cfg), memory_available(device)
  if available is not None and needed > available:
    raise ValueError(
        f"{model_name} ({model_cfg.param_count() / 1e9:.2f} B params) needs {needed / GIB:.1f} GiB for weights, "
        f"gradients and Adam moments, but {device.device_kind} {device.id} has {available / GIB:.1f} GiB; "
        f"train it with the offload engine (--engine=offload)")


def fits_on_device(launch: LaunchConfig, model_cfg: ModelConfig, optim_cfg: OptimConfig, device: jax.Device) -> bool:
  """Whether the all-on-device training state fits (on one GPU of --target when given)."""
  if launch.target:
    return training_state_bytes(model_cfg, optim_cfg) <= MACHINES[launch.target].allocator_bytes
  try:
    check_fits(model_name(launch), model_cfg, optim_cfg, device)
    return True
  except ValueError:
    return False


def plan_budget(launch: LaunchConfig, device: jax.Device, target: Machine | None, local: int = 1) -> Budget:
  """One device's budget for its plan: a GPU of --target's or this device, --device_memory_gib and this process's
  --host_memory_gib (an equal share for each of its `local` devices) replacing what they give."""
  budget = target_budget(target, sharing=local) if target else default_budget(device, sharing=local)
  return Budget(int(launch.device_memory_gib * GIB) or budget.device_bytes,
                int(launch.host_memory_gib * GIB) // local or budget.host_bytes)


def choose_engine(request: Request, configs: Configs, mesh: jax.sharding.Mesh) -> tuple:
  """(model config, data config, optim config, EngineConfig or None for the all-on-device step; LoraEngineConfig
  for a LoRA request). On the offload engine the plan settles what the request and the recipe leave open: the
  batch, and a bf16 first moment where fp32 moments do not fit. Prints the plan (and a line for each choice) when
  offloading or fine-tuning adapters."""
  if request.lora is not None:
    return choose_lora_engine(request, configs)
  launch, model_cfg, data_cfg, optim_cfg = request.launch, configs.model, configs.data, configs.optim
  device = jax.devices()[0]
  target = MACHINES[launch.target] if launch.target else None
  resumed = resumed_engine_state(request, configs.run.workdir, model_cfg)
  mode = launch.engine
  if mode == "auto":
    mode = "offload" if resumed or not fits_on_device(launch, model_cfg, optim_cfg, device) else "device"
  offload_only = [f"--{name}" for name in ("sub_batches", "live_layers", "tail_layers") if getattr(launch, name)]
  if mode == "device" and offload_only and not launch.plan:
    chosen = "the auto engine chose the on-device step (the training state fits)" if launch.engine == "auto" else (
        "--engine=device runs the on-device step")
    raise ValueError(f"{' and '.join(offload_only)} shape the offload engine's step, but {chosen}: add "
                     f"--engine=offload to use them")
  if mode == "device" and not launch.plan:
    check_fits(model_name(launch), model_cfg, optim_cfg, device)
    return model_cfg, data_cfg, optim_cfg, None
  if mode == "device":
    print(f"note: training would run the on-device step (batch {data_cfg.batch_size}: the training state fits); "
          f"the plan below is the offload engine's (--engine=offload)")
  # The engine runs its model without per-layer remat (each group's backward recomputes the group's forward); the
  # config says so too, so that the run's saved model config and its plan describe the model the step runs.
  model_cfg = dataclasses.replace(model_cfg, remat=False)
  # The host budget is this process's: each of its devices keeps its own share of the host-resident state in pinned
  # memory (a whole copy under pure data parallel), so each device plans with an equal part of it.
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  budget = plan_budget(launch, device, target, local)
  model = build(model_cfg)
  planned = batch_planned(request, model_cfg)
  live_layers, tail_layers = launch.live_layers, launch.tail_layers
  if resumed:
    live_layers, tail_layers = resumed.live_layers, resumed.tail_layers
    optim_cfg = dataclasses.replace(optim_cfg, moments_dtype=resumed.moments_dtype or optim_cfg.moments_dtype)

  def plan_with(optim_cfg):  # the plan sizes one device's work: its rows, its 1/fsdp share of the layer state
    args = dict(sub_batches=launch.sub_batches, live_layers=live_layers, tail_layers=tail_layers,
                fsdp=mesh.shape["fsdp"], target=target, optimizer=make_optimizer(optim_cfg, clip=False),
                grad_clip_norm=optim_cfg.grad_clip_norm,
                device_state_groups=resumed.device_state_groups if resumed else None)
    if planned:
      return plan_batch(model, data_cfg.seq_len, budget, devices=mesh.size, **args)
    return make_plan(model, data_cfg.seq_len, data_cfg.batch_size // mesh.size, budget, **args), None

  try:
    (plan, why), error = plan_with(optim_cfg), None
  except ValueError as fp32_error:
    (plan, why), error = (None, None), fp32_error
  if "moments_dtype" not in request.optim and not resumed and optim_cfg.moments_dtype == "float32" and (
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
  return model_cfg, data_cfg, optim_cfg, dataclasses.replace(plan.engine, int8_exchange=launch.int8_exchange)


def check_lora_request(launch: LaunchConfig):
  """ValueError when a flag of LaunchConfig asks for what the LoRA engine does not do."""
  asked = [f"--{name}" for name in ("tail_layers", "int8_exchange") if getattr(launch, name)]
  asked += [f"--engine={launch.engine}"] * (launch.engine != "auto")
  asked += [f"--mesh={launch.mesh}"] * (math.prod(parse_mesh(launch.mesh).values()) > 1 if launch.mesh else False)
  if asked:
    raise ValueError(f"{' and '.join(asked)} shape full training; --lora_rank fine-tunes on one device through the "
                     f"LoRA engine, whose plan places the frozen base (--sub_batches, --live_layers and the memory "
                     f"budgets apply)")


class Resumed(NamedTuple):
  """What the offload engine's checkpoint a run resumes from fixes, being its state's structure, whatever the plan
  would choose now (another budget, a newer planner): the engine, its layer groups, its first moment's dtype, and
  (for a model whose host groups keep a compute copy of their weights, which device groups do not) which groups keep
  their state on the device."""

  live_layers: int
  tail_layers: int
  moments_dtype: str | None
  device_state_groups: int | None  # None: the structure does not fix it


def resumed_engine_state(request: Request, workdir: str, model_cfg) -> Resumed | None:
  """The offload engine's checkpoint in `workdir` that this run resumes from, None where there is none (or another
  model's: the trainer says so). ValueError when the flags ask for another engine, other layer groups or another
  first moment than the checkpoint holds."""
  launch, saved, num_layers = request.launch, saved_groups(workdir), model_cfg.num_layers
  if saved is None or sum(saved.layers) != num_layers:
    return None
  step_dir, group_layers = saved.step_dir, saved.layers
  try:
    live, tail = schedule.layout_of(group_layers)
  except ValueError:
    return None
  device_groups = None
  if model_sizes(build(model_cfg)).separate_weights:
    device_groups = saved.host.count(False)
    if schedule.state_on_device(len(saved.host), device_groups) != [not host for host in saved.host]:
      return None
  moments = newest_checkpoint(workdir)[1].get("optim", {}).get("moments_dtype")
  asked = []
  if launch.engine == "device":
    asked.append("--engine=device")
  if schedule.group_bounds(num_layers, launch.live_layers or live, launch.tail_layers or tail) != (
      schedule.group_bounds(num_layers, live, tail)):
    asked += [f"--{name}={getattr(launch, name)}" for name in ("live_layers", "tail_layers") if getattr(launch, name)]
  if moments and request.optim.get("moments_dtype", moments) != moments:
    asked.append(f"--moments_dtype={request.optim['moments_dtype']}")
  held = (f"the offload engine's state, in layer groups of {live} layer(s) and a last group of {tail}, with a "
          f"{moments or 'float32'} first moment"
          + ("" if device_groups is None else f", {device_groups} of {len(group_layers)} groups' state on the device"))
  if asked:
    raise ValueError(f"checkpoint {step_dir} holds {held}; {' '.join(asked)} asks for another: drop "
                     f"{'them' if len(asked) > 1 else 'it'} to resume, or use another --workdir")
  print(f"note: resuming from {step_dir}, which holds {held}: kept")
  return Resumed(live, tail, moments, device_groups)


def choose_lora_engine(request: Request, configs: Configs) -> tuple:
  """choose_engine for a LoRA request: sljax.lora.plan_lora on this device settles the layout (how much of the base
  stays on the device) and, where the request and the recipe leave it open, the batch. Prints the plan."""
  launch, model_cfg, data_cfg = request.launch, configs.model, configs.data
  # The engine runs without per-layer remat (each group's backward recomputes it); the saved config says so.
  model_cfg = dataclasses.replace(model_cfg, remat=False)
  planned = batch_planned(request, model_cfg)
  target = MACHINES[launch.target] if launch.target else None
  plan = plan_lora(LoraModel(build(model_cfg), request.lora), data_cfg.seq_len,
                   plan_budget(launch, jax.devices()[0], target), batch=0 if planned else data_cfg.batch_size,
                   sub_batches=launch.sub_batches, live_layers=launch.live_layers or 1,
                   optimizer=make_optimizer(configs.optim), target=target)
  if planned:
    data_cfg = dataclasses.replace(data_cfg, batch_size=plan.batch)
    why = "the fewest rows whose passes are compute-bound" if plan.compute_bound else "the most rows that fit"
    print(f"note: batch {plan.batch}, the LoRA plan's: {why}")
  print(f"plan for {model_name(launch)}, batch {data_cfg.batch_size} x {data_cfg.seq_len}:\n{plan.describe()}")
  return model_cfg, data_cfg, configs.optim, plan.engine


def lora_meta(request: Request, configs: Configs) -> dict | None:
  """What the run's checkpoints record of its adapters and base (sljax.lora.run_meta); None when not fine-tuning."""
  return None if request.lora is None else run_meta(request.lora, request.launch.hf_dir, configs.data.seed)


def check_lora_resume(workdir: str, lora: dict):
  """ValueError when the newest checkpoint in `workdir` does not hold adapters of this LoRA config on this base:
  resumed, they would train on with another base or config. A workdir without a readable checkpoint passes (the
  trainer starts afresh, or says why it cannot read it)."""
  try:
    step_dir, meta = newest_checkpoint(workdir)
  except ValueError:
    return
  saved = meta.get("lora")
  if saved is None:
    raise ValueError(f"checkpoint {step_dir} holds a full training run's state, not LoRA adapters: use another "
                     f"--workdir")
  describe = {"base": describe_base, "rank": str, "alpha": lambda alpha: f"{alpha:g}",
              "targets": lambda names: ",".join(names) or "every projection"}
  changed = [f"{name} {show(saved.get(name))} saved, {show(lora[name])} asked" for name, show in describe.items()
             if saved.get(name) != lora[name]]
  if changed:
    raise ValueError(f"checkpoint {step_dir} holds LoRA adapters of another base or config than this run's "
                     f"({'; '.join(changed)}): resume with the saved ones, or use another --workdir")


class StepFunctions(NamedTuple):
  """A training step (sljax.trainer.Step) as functions: how all_on_device and offloaded hand one to the loop."""

  init: typing.Callable  # key -> state
  load: typing.Callable  # full-model params ({"outer", "layers"}) or a reader of them (models.hf.HFWeights) -> state
  step: typing.Callable  # (state, batch) -> (state, loss); may donate state
  abstract: typing.Callable  # key -> state of jax.ShapeDtypeStruct with shardings
  skips_bad_steps: bool
  settle: typing.Callable = lambda state: state  # state -> the state with its deferred updates applied


def all_on_device(model, optimizer: optax.GradientTransformation, device: jax.Device | None = None,
                  mesh: jax.sharding.Mesh | None = None) -> StepFunctions:
  """The whole model, its gradients and optimizer state on one device; one jitted call per step. With `mesh`: on
  every device of it, each taking its rows of the batch (data parallel; XLA all-reduces the gradient)."""
  sharding = (Placement(mesh).device() if mesh is not None
              else jax.sharding.SingleDeviceSharding(device or jax.devices()[0]))

  def init(key):
    params = model.init(key)
    return {"params": params, "opt_state": optimizer.init(params)}

  def load(params):
    reader = params_reader(params)  # the whole model fits on the device here, so it fits in host RAM too
    params = jax.device_put({"outer": reader.outer(), "layers": reader.layers(0, model.cfg.num_layers)}, sharding)
    return jax.jit(lambda p: {"params": p, "opt_state": optimizer.init(p)}, out_shardings=sharding)(params)

  def step(state, batch):
    loss, grads = jax.value_and_grad(model.loss)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    keep_old = lambda new, old: jnp.where(finite, new, old)
    return jax.tree.map(keep_old, new_state, state), jnp.where(finite, loss, jnp.nan)

  init = jax.jit(init, out_shardings=sharding)
  step = jax.jit(step, donate_argnums=0)
  if mesh is not None:  # each device takes its rows of the batch
    place, sharded_step = Placement(mesh), step
    step = lambda state, batch: sharded_step(state, place.to_device(batch, PER_DEVICE))
  return StepFunctions(init, load, step, lambda key: jax.eval_shape(init, key), skips_bad_steps=True)


def offload_engine(model, optim_cfg: OptimConfig, engine_cfg: EngineConfig,
                   mesh: jax.sharding.Mesh | None = None) -> schedule.Engine:
  """The engine train.py runs for `optim_cfg`: its AdamW without clipping, which the engine does itself (exactly,
  over all groups) at optim_cfg.grad_clip_norm."""
  return schedule.Engine(model, make_optimizer(optim_cfg, clip=False),
                         dataclasses.replace(engine_cfg, grad_clip_norm=optim_cfg.grad_clip_norm),
                         None if mesh is None else Placement(mesh))


def offloaded(model, optim_cfg: OptimConfig, engine_cfg: EngineConfig,
              mesh: jax.sharding.Mesh | None = None) -> StepFunctions:
  """The SpeedLoader engine (sljax.schedule): layer-major, sub-batched, with host-resident state; over `mesh`, data
  parallel + FSDP."""
  engine = offload_engine(model, optim_cfg, engine_cfg, mesh)
  # A non-finite loss leaves its state unchanged; a non-finite gradient too when clipping (the updates then wait for
  # the global norm). Without clipping, updates stream out before the whole gradient is known: rewind instead.
  return StepFunctions(engine.init, engine.from_params, engine.step, engine.abstract_state,
                       skips_bad_steps=optim_cfg.grad_clip_norm > 0, settle=engine.settle)


def lora_engine(model_cfg: ModelConfig, optim_cfg: OptimConfig, lora: LoraConfig, engine_cfg: LoraEngineConfig,
                base, seed: int) -> LoraEngine:
  """The LoRA engine train.py runs (sljax.lora): its AdamW and clipping over all adapters at once, on the frozen
  base `base` (full base-model params or a reader, models.hf.HFWeights, read one group at a time), or with None the
  random base of `seed`."""
  engine = LoraEngine(LoraModel(build(model_cfg), lora), make_optimizer(optim_cfg), engine_cfg)
  if base is None:
    engine.init_base(random_base_key(seed))
  else:
    engine.load_base(base)
  return engine


def fine_tuned(engine: LoraEngine) -> StepFunctions:
  """The LoRA engine as a training step: its state is the adapters, their optimizer state and the step; `load`
  takes LoraModel params (the base in them is not read: the engine holds its own)."""
  load = lambda params: engine.from_adapters(split_adapters(params["layers"])[1])
  return StepFunctions(engine.init, load, engine.step, engine.abstract, engine.skips_bad_steps, engine.settle)


# ---- the run -----------------------------------------------------------------------------------------------------

def prepare(request: Request) -> Job:
  """Checks the request and settles what it leaves open (the recipe's values, the engine, the plan), printing the
  plan when it offloads and the recipe line. Everything that can be wrong with the request raises ValueError here,
  before the workdir or any array exists."""
  launch = request.launch
  if request.lora is not None:
    check_lora_request(launch)
  configs = resolve(request)
  if not launch.plan:
    trainer.check_workdir(configs.run.workdir)
    metrics.check_writable_file(configs.run.loss_log, what="loss_log", workdir=configs.run.workdir)
    metrics.check_logger()
    if request.lora is not None:
      check_lora_resume(configs.run.workdir, lora_meta(request, configs))
  source = make_source(configs.data, configs.model.max_positions, configs.model.vocab_size)
  mesh = make_mesh("data:1,fsdp:1" if request.lora is not None else launch.mesh)  # LoRA: one device
  model_cfg, data_cfg, optim_cfg, engine_cfg = choose_engine(request, configs, mesh)
  check_batch(data_cfg.batch_size, engine_cfg.sub_batches if engine_cfg else 1, mesh)
  if data_cfg != configs.data:  # the plan chose the batch: the corpus read stays, the windows per step change
    source = Source(source.tokens, source.vocab_size, data_cfg)
  configs = configs._replace(model=model_cfg, data=data_cfg, optim=optim_cfg)
  print(recipe_line(request, configs, batch_planned(request, model_cfg) and engine_cfg is not None))
  if request.lora is not None:
    lora = request.lora
    print(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, adapters on {', '.join(lora.targets) or 'every projection'} "
          f"of each layer; the frozen base: {describe_base(lora_meta(request, configs)['base'])}")
  return Job(request, configs, engine_cfg, mesh, source)


def make_step(model_cfg: ModelConfig, optim_cfg: OptimConfig, engine_cfg: EngineConfig | None,
              mesh: jax.sharding.Mesh | None = None) -> StepFunctions:
  """The offload engine's step with `engine_cfg`, else the plain all-on-device step; over `mesh` when given."""
  if engine_cfg is None:
    return all_on_device(build(model_cfg), make_optimizer(optim_cfg), jax.devices()[0], mesh)
  return offloaded(build(model_cfg), optim_cfg, engine_cfg, mesh)


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
  if request.lora is not None:  # the weights are the frozen base, held by the engine; the state starts fresh
    engine = lora_engine(model_cfg, optim_cfg, request.lora, job.engine, weights, data_cfg.seed)
    recomputed = model_cfg.num_layers - (engine.groups[-1][1] - engine.groups[-1][0])  # all but the last group's
    return trainer.train(fine_tuned(engine), job.source, run_cfg, {**meta, "lora": lora_meta(request, job.configs)},
                         learning_rate, lora_flops_per_token(engine.model, data_cfg.seq_len, recomputed))
  mesh = job.mesh if job.mesh.size > 1 else None
  return trainer.train(make_step(model_cfg, optim_cfg, job.engine, mesh), job.source, run_cfg, meta, learning_rate,
                       model_cfg.flops_per_token(data_cfg.seq_len), devices=job.mesh.size, init_params=weights)

