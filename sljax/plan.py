"""The one-shot tuner: from the model, the batch and the memory budgets, choose how the engine runs, and say why.

It picks the sub-batch size (enough tokens per call to keep the GPU busy), the number of sub-batches, the layers per
group, whether group-boundary activations wait on the device or in pinned host memory, and how many groups keep
their fp32 master weights + optimizer state on the device (the rest stream through PCIe once per step). Activation
memory comes from XLA's compiled memory analysis of the group steps, not from a formula.
"""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import optax

from models.config import ModelConfig
from sljax.schedule import Engine, EngineConfig

GIB = 2**30
# Measured on one H200 (shared/DESIGN.md): pinned host<->device copies, and a LLaMA-2-13B layer's fraction of the
# 989 TFLOP/s bf16 peak with cuDNN flash attention. Used only for the predicted step-time bound.
PCIE_BYTES_PER_S = 53e9
LAYER_EFFICIENCY = 0.70
PEAK_FLOPS = 989e12


@dataclasses.dataclass(frozen=True)
class Budget:
  device_bytes: int
  host_bytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
  engine: EngineConfig
  sub_batch_size: int
  device_bytes: dict  # what sits on the device, by kind
  host_bytes: dict  # what sits in pinned host memory, by kind
  host_to_device_bytes: int  # per step
  device_to_host_bytes: int
  compute_seconds: float  # predicted, at LAYER_EFFICIENCY of the peak
  budget: Budget
  fsdp: int = 1  # devices each group's state is split over

  @property
  def transfer_seconds(self) -> float:
    return max(self.host_to_device_bytes, self.device_to_host_bytes) / PCIE_BYTES_PER_S

  def describe(self) -> str:
    e = self.engine
    rows = [
        f"sub-batches {e.sub_batches} x {self.sub_batch_size} rows, {e.live_layers} layer(s) per group, "
        f"activations {'in pinned host memory' if e.activations_on_host else 'on the device'}, "
        f"{e.device_state_groups} group(s) keep master weights + optimizer state on the device"
        + (f" (split over {self.fsdp} fsdp devices)" if self.fsdp > 1 else ""),
        _tier("device", self.device_bytes, self.budget.device_bytes),
        _tier("host", self.host_bytes, self.budget.host_bytes),
        f"per step: {self.host_to_device_bytes / GIB:.1f} GiB host->device, "
        f"{self.device_to_host_bytes / GIB:.1f} GiB device->host",
        f"step time bound: compute {self.compute_seconds:.2f} s, transfer {self.transfer_seconds:.2f} s "
        f"-> {'compute' if self.compute_seconds >= self.transfer_seconds else 'transfer'}-bound",
    ]
    return "\n".join(rows)


def _tier(name, parts, budget):
  items = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if v)
  return f"{name}: {sum(parts.values()) / GIB:.1f} of {budget / GIB:.1f} GiB ({items})"


def default_budget(device: jax.Device | None = None, sharing: int = 1) -> Budget:
  """One device's budget: the allocator's limit on the accelerator; for pinned host memory 90% of RAM over the
  `sharing` devices of this process that keep host state side by side, capped on GPU by XLA's pinned pool, which
  each device has for itself (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB GiB, 64 unless set)."""
  device = device or jax.devices()[0]
  with open("/proc/meminfo") as f:
    host = int(int(dict(line.split(":", 1) for line in f)["MemTotal"].split()[0]) * 1024 * 0.9) // sharing
  if device.platform == "cpu":
    return Budget(device_bytes=host // 2, host_bytes=host // 2)
  pinned_pool = int(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")) * GIB
  return Budget(device_bytes=int(device.memory_stats()["bytes_limit"]), host_bytes=min(host, pinned_pool))


def _peak_step_bytes(model, cfg: EngineConfig, sub_batch: int, seq_len: int) -> int:
  """XLA's temp + output bytes for the largest per-sub-batch call (the last group: forward, head, backward)."""
  engine = Engine(model, optax.sgd(0.0), cfg)
  m = model.cfg
  shape = lambda *s, dtype=m.dtype: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
  weights = jax.eval_shape(lambda: engine._cast_fn(model.init_layers(jax.random.split(jax.random.key(0), cfg.live_layers))))
  outer = jax.eval_shape(lambda: model.init_outer(jax.random.key(0)))
  x = shape(sub_batch, seq_len, m.hidden_size)
  tokens = shape(sub_batch, seq_len, dtype=jnp.int32)
  grads = jax.eval_shape(engine._zeros, weights)
  outer_grads = jax.eval_shape(engine._zeros, outer)
  peaks = []
  for fn, args in [(engine._last_group, (weights, outer, x, tokens, shape(sub_batch, seq_len, dtype=jnp.float32),
                                         shape(dtype=jnp.float32), grads, outer_grads)),
                   (engine._backward, (weights, x, x, grads))]:
    analysis = fn.lower(*args).compile().memory_analysis()
    peaks.append(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)
  return max(peaks)


def optimizer_bytes_per_param(optimizer: optax.GradientTransformation, dtype=jnp.float32) -> float:
  """Bytes of optimizer state per parameter of `dtype`, from optimizer.init's shapes (nothing is allocated). AdamW:
  8, or 6 with a bf16 first moment (optax keeps the second in the params' dtype)."""
  size = lambda n: sum(x.size * x.dtype.itemsize
                       for x in jax.tree.leaves(jax.eval_shape(optimizer.init, jax.ShapeDtypeStruct((n,), dtype))))
  return (size(2048) - size(1024)) / 1024  # per-parameter leaves only: scalars such as the step count cancel


def make_plan(model, seq_len: int, batch_size: int, budget: Budget, sub_batches: int = 0, live_layers: int = 0,
              optimizer: optax.GradientTransformation | None = None, grad_clip_norm: float = 0.0,
              sub_batch_tokens: int = 16384, fsdp: int = 1) -> Plan:
  """Chooses the engine's settings for one device; 0 for sub_batches / live_layers means "choose". ValueError when it
  cannot fit.

  batch_size is this device's rows (the mesh splits every sub-batch over all devices) and the budgets are one
  device's. fsdp: devices the layer state is split over; each holds 1/fsdp of every group's master weights,
  optimizer state and host weight copy, and gathers a group's whole weights only while it runs. optimizer: the one the
  engine will run, whose state is sized per parameter (default: AdamW with fp32 moments, 8 bytes)."""
  m: ModelConfig = model.cfg
  if sub_batches:
    if batch_size % sub_batches:
      raise ValueError(f"batch_size {batch_size} is not divisible by {sub_batches} sub-batches")
    sub_batch = batch_size // sub_batches
  else:  # the largest divisor of the batch that stays within sub_batch_tokens (at least one row)
    sub_batch = max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and (d * seq_len <= sub_batch_tokens
                                                                                 or d == 1))
  live = live_layers or 1
  groups = math.ceil(m.num_layers / live)
  compute_bytes = jnp.dtype(m.dtype).itemsize
  master_bytes = jnp.dtype(m.param_dtype).itemsize
  layer = m.layer_param_count()
  opt_bytes = 8 if optimizer is None else optimizer_bytes_per_param(optimizer, m.param_dtype)
  state_per_group = int(live * layer * (master_bytes + opt_bytes)) // fsdp  # master weights + optimizer state
  weights_per_group = live * layer * compute_bytes  # gathered whole on every device while the group runs
  act = sub_batch * seq_len * m.hidden_size * compute_bytes
  stash = (groups - 1) * (batch_size // sub_batch) * act  # every group's input but the last group's

  cfg = EngineConfig(sub_batches=batch_size // sub_batch, live_layers=live, grad_clip_norm=grad_clip_norm)
  peak = _peak_step_bytes(model, cfg, sub_batch, seq_len)
  fixed_device = {
      # Master weights, moments and the reduced gradient split over fsdp; under fsdp also the whole weights (gathered
      # per step) and the per-device gradient accumulator.
      "embeddings+head (params, moments, grads)": int(m.outer_param_count() * (
          (master_bytes + opt_bytes + 4) / fsdp + (master_bytes + 4 if fsdp > 1 else 0))),
      "group weights (2 in flight)": 2 * weights_per_group + (weights_per_group // fsdp if fsdp > 1 else 0),
      # In backward one group's gradients accumulate (whole, on every device) while the next group's wait, reduced to
      # this device's shard, for its deferred update.
      "group grads (2)": live * layer * 4 + live * layer * 4 // fsdp,
      # That deferred update holds the group's state and writes the new state while the next group's state arrives.
      "group state in update (3)": 3 * state_per_group,
      "activations in flight": 3 * (batch_size // sub_batch) * act,  # a group's inputs, outputs, gradients
      "compiled step peak": peak,
  }
  # Clipping by the exact global norm holds every group's reduced gradient until the last one is known: a group whose
  # state lives on the device parks it there, a host group in pinned host memory (a crossing each way).
  parked = live * layer * 4 // fsdp if grad_clip_norm > 0 else 0
  free = budget.device_bytes - sum(fixed_device.values())
  if free < 0:
    raise ValueError(f"{sum(fixed_device.values()) / GIB:.1f} GiB of device memory is needed for one group's step "
                     f"(sub-batch {sub_batch} x {seq_len}), but the device has {budget.device_bytes / GIB:.1f} GiB; "
                     f"lower the sub-batch size or the sequence length")

  per_device_group = state_per_group + parked
  if free >= groups * per_device_group + stash:  # everything fits: keep it all on the device, no PCIe traffic
    on_host, device_groups = False, groups
  else:
    on_host, device_groups = True, min(groups, max(0, free // per_device_group))
  host_groups = groups - device_groups
  device_bytes = dict(fixed_device, **{"resident group state": device_groups * state_per_group,
                                       "activation stash": 0 if on_host else stash})
  host_weights = host_groups * weights_per_group // fsdp if compute_bytes != master_bytes else 0
  host_bytes = {"group weights": host_weights, "group state": host_groups * state_per_group,
                "activation stash": stash if on_host else 0}
  if parked:
    device_bytes["parked grads (clipping)"] = device_groups * parked
    host_bytes["parked grads (clipping)"] = host_groups * parked
  if sum(host_bytes.values()) > budget.host_bytes:
    needed = sum(host_bytes.values()) + sum(device_bytes.values())
    raise ValueError(
        f"training state and activations need {needed / GIB:.1f} GiB; the device has {budget.device_bytes / GIB:.1f} "
        f"GiB and pinned host memory {budget.host_bytes / GIB:.1f} GiB (host part needs "
        f"{sum(host_bytes.values()) / GIB:.1f}); lower batch_size, or use bf16 moments (--moments_dtype=bfloat16)"
        + ("; or turn off clipping (--grad_clip_norm=0), which holds every gradient until the global norm is known"
           if parked else ""))

  shard = weights_per_group // fsdp  # one host group's weight copy on this device
  # A host group's weights cross twice (forward, backward) but the last group's once (it runs both in one pass);
  # the updated copy goes back once. Each group's input but the last's is stashed and fetched back once per step
  # (one hidden state per row: a level). The token batch (a few bytes per token) is left out.
  level = batch_size * seq_len * m.hidden_size * compute_bytes if on_host else 0
  crossings = 2 * host_groups - (1 if host_groups == groups else 0)
  h2d = crossings * shard + host_groups * (state_per_group + parked) + (groups - 1) * level
  d2h = host_groups * (shard + state_per_group + parked) + (groups - 1) * level
  tokens = batch_size * seq_len
  flops = tokens * m.flops_per_token(seq_len) * 4 / 3  # backward recomputes each group's forward
  return Plan(
      engine=dataclasses.replace(cfg, activations_on_host=on_host, device_state_groups=device_groups), fsdp=fsdp,
      sub_batch_size=sub_batch, device_bytes=device_bytes, host_bytes=host_bytes, host_to_device_bytes=h2d,
      device_to_host_bytes=d2h, compute_seconds=flops / (PEAK_FLOPS * LAYER_EFFICIENCY), budget=budget)
