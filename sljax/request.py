"""What a training run asks for (LaunchConfig, ClusterConfig and the other configs, as a Request) and what
sljax.launch.prepare makes of it (a Job). train.py's flags are these configs' fields: messages call the fields by
their flags (--engine, --sub_batches).
"""

import dataclasses
import typing
from collections.abc import Mapping
from typing import NamedTuple

import jax

from models.config import ModelConfig
from models.hf import HFWeights
from sljax.data import DataConfig, Source
from sljax.lora.engine import LoraEngineConfig
from sljax.lora.model import LoraConfig
from sljax.machines import MACHINES, check_budget_gib
from sljax.optim import OptimConfig
from sljax.schedule import EngineConfig
from sljax.trainer import RunConfig

DEFAULT_MODEL = "llama-tiny"
# The peak learning rate a LoRA request fine-tunes adapters at unless its optim sets learning_rate. The presets'
# recipes train every weight from scratch (llama-tiny's quick CPU run at 3e-3, LLaMA-2's 3e-4); adapters start as the
# identity on a trained base, and LoRA runs at about ten times full fine-tuning's rates: 2e-4 is the LoRA paper's for
# GPT-2 (Hu et al. 2021) and QLoRA's for 7B and 13B LLaMA (Dettmers et al. 2023).
FINE_TUNING_LEARNING_RATE = 2e-4


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """What to train and how, beyond the data, optimizer and run configs: the model, the step, what its plan may use."""

  model: str | None = None  # model preset (models.presets.PRESETS); None: DEFAULT_MODEL, unless hf_dir names one
  overrides: tuple[str, ...] = ()  # model config override field=value, repeatable (e.g. --set num_layers=8)
  # start from these Hugging Face LLaMA/OPT weights (config.json + *.safetensors) instead of a random init; the model
  # is the one its config.json describes (--set still applies)
  hf_dir: str = ""
  # training step: the plain all-on-device step, the SpeedLoader offload engine, or auto (on a CPU the on-device step
  # when the training state fits; on an accelerator, or with --target, the offload engine)
  engine: typing.Literal["auto", "device", "offload"] = "auto"
  sub_batches: int = 0  # offload engine: sub-batches per step (0: the plan chooses)
  live_layers: int = 0  # offload engine: layers per group fetched to the device at once (0: plan)
  # offload and LoRA engines: layers in the last group, which keep their residuals instead of being recomputed (0:
  # the plan chooses; equal to --live_layers: no longer tail than the other groups; LoRA: the whole base resident)
  tail_layers: int = 0
  # offload engine, where the plan chooses the tail: move groups' state to host memory for a longer tail while the
  # step stays compute-bound and gets faster (by the plan's model; the default spends the device on state first)
  trade_state_for_tail: bool = False
  int8_exchange: bool = False  # offload engine: stash hidden states in host memory as int8 rows (inexact)
  # offload engine, with clipping: the dtype gradients wait in for the global norm (bfloat16: half the memory,
  # inexact: each rounded once; the norm is the fp32 gradients')
  parked_grads_dtype: typing.Literal["float32", "bfloat16"] = "float32"
  # devices as data:D,fsdp:F, D x F dividing the device count (default: fsdp over each host's devices, data parallel
  # across hosts; LoRA: data:D only, the whole base on every device, and one device by default)
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
    for name in ("engine", "target", "parked_grads_dtype"):  # the flags check these; a library caller's typo must not pick a step
      choices = typing.get_args(typing.get_type_hints(LaunchConfig)[name])
      if getattr(self, name) not in choices:
        raise ValueError(f"--{name} must be one of {', '.join(map(repr, choices))}, got {getattr(self, name)!r}")
    if self.target and not self.plan:
      raise ValueError(f"--target={self.target} plans for a machine this is not: use it with --plan")
    for name in ("sub_batches", "live_layers", "tail_layers"):
      if getattr(self, name) < 0:
        raise ValueError(f"--{name} must be >= 0 (0: the plan chooses), got {getattr(self, name)}")
    check_budget_gib(device_memory_gib=self.device_memory_gib, host_memory_gib=self.host_memory_gib)

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
  # learning rate, unless `optim` sets it, is then FINE_TUNING_LEARNING_RATE
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
  pinned_bytes: int = 0  # the pinned host memory the plan counts for each device (0: the on-device step)
