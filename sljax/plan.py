"""The one-shot tuner: from the model, the batch and the memory budgets, choose how the engine runs, and say why.

It picks the sub-batch size (enough tokens per call to keep the GPU busy), the number of sub-batches, the layers per
group, whether group-boundary activations wait on the device or in pinned host memory, and how many groups keep
their fp32 master weights + optimizer state on the device (the rest stream through PCIe once per step). Activation
memory comes from XLA's compiled memory analysis of the group steps, not from a formula.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from models.presets import build, get_config
from sljax.footprint import (COMPUTE_MARGIN, MARGIN, SCRATCH, SUB_BATCH_TOKENS, Footprint, Pass, compiled_peak,
                             compiled_sizes, compute_bound, for_gpu, machine_for, margin_bytes, pass_copy_seconds,
                             step_seconds)
from sljax.machines import GIB, REFERENCE, Budget, Machine
from sljax.memory import tree_bytes
from sljax.schedule import (Engine, EngineConfig, in_flight_bytes, retired_host_bytes,
                            state_on_device, step_peak_bytes)
from sljax.sizes import model_sizes, stacked_layer_shapes

MAX_ROWS = 1024  # per device: the largest batch plan_batch tries
# The most of a step's compute that plan_batch lets the once-a-step work take (the update; Machine.
# update_seconds_per_param). On the H200 it is 0.218 s for llama13b: 8.9% of a batch of 8 x 2048 (43.0% MFU), 2.2% of
# 32 x 2048 (47.5%). Its share falls with the step's tokens alone (the update and the compute both grow with the
# params): 3% is about 48K tokens a step there.
ONCE_A_STEP_SHARE = 0.03

# The measurements of compiled peaks on a GPU: llama13b, one layer per group, a sub-batch of 8 x 2048 rows, on the
# H200 (jax 0.11.2, 2026-12-07, benchmarks/results/gpu_peak_calibration_h200.json), as XLA's temp + output bytes of
# the layer as it runs now. The last group's calls, counted as if they ran as one call with its residuals in its
# scratch: 7.74 GiB. Another group's backward: 4.65 GiB. See gpu_peak_from_cpu. (Until 2026-12-07: 8.5 and 4.2 GiB,
# from the plans of train_throughput_h200.json, made with the layer before; the H200's own --plan of the same command,
# train_py_llama13b_plan_h200.json, was made again with the layer of now: tests/test_train.py holds the two together.)
GPU_PEAK_MODEL, GPU_PEAK_ROWS, GPU_PEAK_SEQ, GPU_PEAK_BYTES = "llama13b", 8, 2048, int(7.74 * GIB)
GPU_BACKWARD_PEAK_BYTES = int(4.65 * GIB)
# The last group's residuals for one sub-batch: outputs of its layers' forward calls, each layer's its own buffers.
RESIDUALS = "last group's residuals (one sub-batch)"
# With clipping, what the residuals and the parked gradients count twice: the step never holds both.
RESIDUALS_APART = "residuals and parked grads never together"
# What the calls' scratch counts twice with the residuals or the parked gradients: the last group's calls run beside
# its residuals and no parked gradient, another group's backward beside the parked gradients and no residuals.
NEVER_TOGETHER = "calls' scratch never beside both"
# A pass of a step, for the results files and tests that read plan.phases.
Phase = Pass


@dataclasses.dataclass(frozen=True)
class Plan:
  engine: EngineConfig
  sub_batch_size: int
  device_bytes: dict  # what sits on the device, by kind
  host_bytes: dict  # what sits in pinned host memory, by kind
  # The forward pass and the backward pass (recompute + backward: three times the forward's compute) of a step.
  # Copies overlap the compute of their own pass only: a host group's update traffic runs in the backward, or
  # (clipping: every update waits for the global norm) in the next step's forward, before the group's weights are read.
  phases: dict[str, Pass]
  budget: Budget
  fsdp: int = 1  # devices each group's state is split over
  machine: Machine = REFERENCE  # whose rates the times are predicted at
  layers: int = 0  # the model's
  params: int = 0  # the parameters this device updates each step (its 1/fsdp share of the layers', all the outer)

  @property
  def bounds(self) -> list[tuple[int, int]]:
    """[start, stop) of each layer group, the tail included."""
    return self.engine.bounds(self.layers)

  @property
  def groups(self) -> int:
    return len(self.bounds)

  @property
  def footprint(self) -> Footprint:
    return Footprint(self.device_bytes, self.host_bytes)

  @property
  def compute_seconds(self) -> float:
    return sum(phase.compute_seconds for phase in self.phases.values())

  @property
  def host_to_device_bytes(self) -> int:  # per step
    return sum(phase.host_to_device_bytes for phase in self.phases.values())

  @property
  def device_to_host_bytes(self) -> int:
    return sum(phase.device_to_host_bytes for phase in self.phases.values())

  def copy_seconds(self, phase: Pass) -> float:
    return pass_copy_seconds(self.machine, phase)

  @property
  def transfer_seconds(self) -> float:
    """The copies' time, pass by pass."""
    return sum(self.copy_seconds(phase) for phase in self.phases.values())

  @property
  def step_seconds(self) -> float:
    return step_seconds(self.machine, list(self.phases.values()))

  @property
  def compute_bound(self) -> bool:
    return compute_bound(self.machine, list(self.phases.values()))

  @property
  def once_a_step_seconds(self) -> float:
    """The step's work that does not grow with its rows (Machine.update_seconds_per_param): the update above all."""
    return self.params * self.machine.update_seconds_per_param

  @property
  def rows(self) -> int:
    return self.engine.sub_batches * self.sub_batch_size

  def describe(self) -> str:
    e = self.engine
    rows = [
        f"sub-batches {e.sub_batches} x {self.sub_batch_size} rows, {e.live_layers} layer(s) per group, "
        + (f"the last {e.tail_layers} layers one group that keeps its residuals (not recomputed; "
           f"{self.device_bytes.get(RESIDUALS, 0) / GIB:.1f} GiB for one sub-batch, each layer's in buffers of its "
           f"own, freed as its backward runs), " if e.tail_layers > e.live_layers else "")
        + f"activations {'in pinned host memory' if e.activations_on_host else 'on the device'}, "
        f"{e.device_state_groups} group(s) keep master weights + optimizer state on the device"
        + (f" (split over {self.fsdp} fsdp devices)" if self.fsdp > 1 else ""),
        *self.footprint.describe(self.budget),
        f"per step: {self.host_to_device_bytes / GIB:.1f} GiB host->device, "
        f"{self.device_to_host_bytes / GIB:.1f} GiB device->host",
        "step time bound: " + ", ".join(
            f"{name} compute {phase.compute_seconds:.2f} s vs copies {self.copy_seconds(phase):.2f} s"
            for name, phase in self.phases.items())
        + f" -> {'compute' if self.compute_bound else 'transfer'}-bound",
    ]
    return "\n".join(rows)


def _lowered_calls(model, call: str, layers: int, sub_batch: int, seq_len: int) -> list:
  """The per-sub-batch calls of `call`, lowered for one device at these shapes (nothing is allocated): "last_group"
  (one layer's forward keeping its residuals, the head + loss and its backward, one layer's backward: the calls the
  last group of `layers` layers runs) or "backward" (recompute + backward of a group of `layers` layers)."""
  calls = Engine(model, optax.sgd(0.0), EngineConfig()).calls
  shape = lambda *s, dtype=model.cfg.dtype: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
  weights = jax.eval_shape(calls.cast, stacked_layer_shapes(model, layers))
  x = shape(sub_batch, seq_len, model_sizes(model).hidden)
  grads = jax.eval_shape(calls.zeros, weights)
  if call == "backward":
    return [calls.backward.lower(weights, x, x, grads)]
  outer = model_sizes(model).outer_shapes
  layer, first = shape(dtype=jnp.int32), shape(dtype=jnp.bool_)
  _, residuals = jax.eval_shape(calls.tail_forward, weights, layer, x)
  return [calls.tail_forward.lower(weights, layer, x),
          calls.head.lower(outer, x, shape(sub_batch, seq_len, dtype=jnp.int32),
                           shape(sub_batch, seq_len, dtype=jnp.float32), shape(dtype=jnp.float32),
                           jax.eval_shape(calls.zeros, outer)),
          calls.tail_backward.lower(weights, layer, first, residuals, x, grads)]


def _call_peak(model, call: str, layers: int, sub_batch: int, seq_len: int) -> int:
  """XLA's scratch (temp bytes) of the calls of `call` (_lowered_calls), the most any one of them needs, as this
  process's backend compiles them. The plan counts the calls' outputs (the gradient accumulators, dx, the last
  group's residuals) as parts of its own."""
  return compiled_peak(_peak_key(model, call, layers, sub_batch, seq_len),
                       lambda: _lowered_calls(model, call, layers, sub_batch, seq_len))


def _residual_bytes(model, layers: int, sub_batch: int, seq_len: int) -> int:
  """Bytes of one layer's residuals as its forward call in the last group returns them (its outputs less its output
  activation): what the last group keeps per layer for one sub-batch, each residual its own buffer."""
  key = _peak_key(model, "last_group", layers, sub_batch, seq_len)
  forward_outputs = compiled_sizes(key, lambda: _lowered_calls(model, "last_group", layers, sub_batch, seq_len))[0][1]
  return forward_outputs - model_sizes(model).activation_bytes(sub_batch, seq_len)


def _peak_key(model, call: str, layers: int, sub_batch: int, seq_len: int) -> tuple:
  return type(model), model.cfg, call, layers, sub_batch, seq_len


class StepPeaks(NamedTuple):
  """The device bytes of a step's per-sub-batch calls beyond what the plan counts elsewhere: compiled scratch (XLA's
  temp bytes) and the last group's residuals (outputs of its forward calls, held until its backward calls)."""

  residuals: int  # the last group's, one sub-batch's through all its layers
  last_group_scratch: int  # the most any of the last group's calls needs
  backward_scratch: int  # another group's backward (recompute included); 0 where the last group is the only one

  @property
  def last_group(self) -> int:
    """What the last group holds beyond the plan's other parts while it runs: residuals and its calls' scratch."""
    return self.residuals + self.last_group_scratch

  def on_gpu(self) -> "StepPeaks":
    """These, compiled on a CPU, as a GPU's (gpu_peak_from_cpu)."""
    last = lambda cpu: gpu_peak_from_cpu(cpu, "last_group")
    return StepPeaks(last(self.residuals), last(self.last_group_scratch),
                     gpu_peak_from_cpu(self.backward_scratch, "backward"))


def _step_peaks(model, cfg: EngineConfig, sub_batch: int, seq_len: int) -> StepPeaks:
  """The compiled scratch of the per-sub-batch calls and the residuals the last group keeps for one sub-batch."""
  bounds = cfg.bounds(model.cfg.num_layers)
  last_layers = bounds[-1][1] - bounds[-1][0]
  backward = _call_peak(model, "backward", cfg.live_layers, sub_batch, seq_len) if len(bounds) > 1 else 0
  return StepPeaks(last_layers * _residual_bytes(model, last_layers, sub_batch, seq_len),
                   _call_peak(model, "last_group", last_layers, sub_batch, seq_len), backward)


def peak_calibration(model, rows: int, seq_len: int, calls=("last_group", "backward")) -> dict:
  """What GPU_PEAK_BYTES and GPU_BACKWARD_PEAK_BYTES hold, as this process's backend compiles `model`'s calls (one
  layer a group, a sub-batch of rows x seq_len; nothing allocated), for each of `calls`: "last_group", the (temp,
  output) bytes of its calls, one layer's residuals, the one call's outputs and the calls as that one call would hold
  them (its outputs, the residuals, the most scratch); "backward", another group's backward's (temp, output) bytes
  and their sum (benchmarks/gpu_peak_calibration.py)."""
  sizes = lambda call: compiled_sizes(_peak_key(model, call, 1, rows, seq_len),
                                      lambda: _lowered_calls(model, call, 1, rows, seq_len))
  out = {}
  if "last_group" in calls:
    last, residual = sizes("last_group"), _residual_bytes(model, 1, rows, seq_len)
    # The one call's outputs: the head's (the loss, dh, the embeddings' + head's gradient) and the backward's (dx,
    # the layer's gradient) less dh, which was not one.
    outputs = last[1][1] + last[2][1] - model_sizes(model).activation_bytes(rows, seq_len)
    out.update(last_group_calls_temp_out=last, residual_bytes=residual, last_group_outputs=outputs,
               gpu_peak_bytes_equivalent=outputs + residual + max(temp for temp, _ in last))
  if "backward" in calls:
    backward = sizes("backward")
    out.update(backward_temp_out=backward, gpu_backward_peak_bytes_equivalent=sum(backward[0]))
  return out


def gpu_peak_from_cpu(cpu_peak: int, call: str = "last_group") -> int:
  """A GPU's compiled bytes of a call ("last_group": its residuals and scratch; "backward": its temp bytes) estimated
  from the CPU compiler's, for plans made on a CPU machine (--target).

  XLA on CPU reports a much larger peak for the same calls (35.0 GiB where the H200 reports 7.7 for llama13b's last
  group at 8 x 2048 rows, and 28.0 where it reports 4.7 for a backward, temp + output; jax 0.10.2 on CPU; the
  constants still hold the figures from before, see them): among
  others, its attention materializes the score matrices (a few fp32 copies of rows x heads x seq^2) where cuDNN flash
  attention keeps none. The correction is the ratio measured for the same calls: the GPU's temp bytes (GPU_PEAK_BYTES
  or GPU_BACKWARD_PEAK_BYTES less the call's outputs, whose shapes are the same on both) over this process's CPU
  compile of those calls (compiled here, so it follows this jax's CPU compiler). The last-group figure is the one
  call's those calls replace: their outputs, one layer's residuals and their largest scratch, on both sides. It is
  exact for that shape and model and an estimate elsewhere: it cannot know how the GPU's peak scales with seq_len
  (the CPU's attention part grows as seq^2, the GPU's does not, so at shorter sequences it undershoots), with other
  families (OPT), with several layers per group, or on another GPU or XLA version."""
  reference = build(dataclasses.replace(get_config(GPU_PEAK_MODEL), remat=False))
  here = peak_calibration(reference, GPU_PEAK_ROWS, GPU_PEAK_SEQ, (call,))  # this process's CPU compile of them
  if call == "last_group":
    # Without the one call's outputs, the same on both: the residuals and the calls' most scratch.
    outputs = here["last_group_outputs"]
    measured, cpu = GPU_PEAK_BYTES - outputs, here["gpu_peak_bytes_equivalent"] - outputs
  else:
    (cpu, outputs), = here["backward_temp_out"]
    measured = GPU_BACKWARD_PEAK_BYTES - outputs
  return int(cpu_peak * measured / cpu)


def optimizer_state_bytes(optimizer: optax.GradientTransformation, params) -> int:
  """Bytes of the optimizer's state for `params` (a tree of shapes), from optimizer.init's shapes (nothing is
  allocated): its state for two copies of them stacked less that for one, so that the leaves every parameter shares
  (Adam's step count) cancel. AdamW: 8 bytes per fp32 parameter, 6 with a bf16 first moment, ~2 with 8-bit moments
  (their scales, one per block of a row, counted as the rows have them)."""
  stacked = lambda n: jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), params)
  size = lambda n: tree_bytes(jax.eval_shape(optimizer.init, stacked(n)))
  return size(2) - size(1)


def make_plan(model, seq_len: int, batch_size: int, budget: Budget, sub_batches: int = 0, live_layers: int = 0,
              optimizer: optax.GradientTransformation | None = None, grad_clip_norm: float = 0.0,
              sub_batch_tokens: int = SUB_BATCH_TOKENS, fsdp: int = 1, target: Machine | None = None,
              tail_layers: int = 0, device_state_groups: int | None = None,
              parked_grads_dtype: str = "float32", trade_state_for_tail: bool = False) -> Plan:
  """Chooses the engine's settings for one device; 0 for sub_batches / live_layers / tail_layers means "choose".
  ValueError when it cannot fit.

  batch_size is this device's rows (the mesh splits every sub-batch over all devices) and the budgets are one
  device's. fsdp: devices the layer state is split over; each holds 1/fsdp of every group's master weights,
  optimizer state and host weight copy, and gathers a group's whole weights only while it runs. optimizer: the one the
  engine will run, whose state is sized from its init's shapes (default: AdamW with fp32 moments, 8 bytes per
  parameter). target: plan for
  one GPU of that machine (its rates; made on a CPU, its compiled peak corrected by gpu_peak_from_cpu) instead of for
  this process's device (whose rates are the table's, or the reference machine's when it has none).
  device_state_groups: keep this many groups' state on the device instead of choosing; ValueError when they do
  not fit. parked_grads_dtype: what clipping's gradients wait in (EngineConfig.parked_grads_dtype).

  The tail (EngineConfig.tail_layers): when every group's state stays on the device, the device memory left over
  goes to a longer last group, whose layers keep their residuals instead of being recomputed, as many as fit by the
  compiled peaks (a model that fits with room to spare recomputes nothing). Where state must live in host memory,
  the memory goes to state first, and the last group is the last of the live_layers groups. trade_state_for_tail:
  then, where the step is compute-bound, the tail grows further by moving groups' state to host memory, as long as
  the step stays compute-bound and gets faster (_traded_for_a_tail)."""
  sizes = model_sizes(model)  # checks the model first
  if sub_batches:
    if batch_size % sub_batches:
      raise ValueError(f"batch_size {batch_size} is not divisible by {sub_batches} sub-batches")
    sub_batch = batch_size // sub_batches
  else:  # the largest divisor of the batch that stays within sub_batch_tokens (at least one row)
    sub_batch = max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and (d * seq_len <= sub_batch_tokens
                                                                                 or d == 1))
  live = live_layers or 1
  if not 0 <= tail_layers <= sizes.num_layers:
    raise ValueError(f"tail_layers must be in 0..{sizes.num_layers} (the model's layers), got {tail_layers}")
  machine = machine_for(target)
  layout = lambda tail: _layout(model, sizes, seq_len, batch_size, sub_batch, live, tail, budget, optimizer,
                                grad_clip_norm, fsdp, target, machine, device_state_groups, parked_grads_dtype)
  plan = layout(tail_layers)
  first = _last_layers(plan)
  if tail_layers or device_state_groups is not None or first == sizes.num_layers:
    return plan
  if _all_resident(plan):
    plan = _grown_into_what_is_left(plan, layout, sizes.num_layers)
  if trade_state_for_tail and plan.compute_bound:
    return _traded_for_a_tail(plan, layout, sizes.num_layers)
  return plan


def _grown_into_what_is_left(plan: Plan, layout, num_layers: int) -> Plan:
  """The longest tail in the device memory left beside every group's state: the bytes per added layer from one more
  layer's plan, then the longest tail that the compiled peaks say fits, stepping down until one does."""
  first = _last_layers(plan)
  try:
    one_more = layout(first + 1)
  except ValueError:
    return plan
  if not _keeps_placement(plan, one_more):
    return plan
  per_layer = max(sum(one_more.device_bytes.values()) - sum(plan.device_bytes.values()), 1)
  left = plan.budget.device_bytes - sum(one_more.device_bytes.values())
  for tail in range(min(num_layers, first + 1 + left // per_layer), first + 1, -1):
    try:
      longer = layout(tail)
    except ValueError:
      continue
    if _keeps_placement(plan, longer):
      return longer
  return one_more


def _traded_for_a_tail(plan: Plan, layout, num_layers: int) -> Plan:
  """A compute-bound step spends its device memory best on kept residuals: each tail layer saves its recompute (a
  forward), where resident state only saves copies that the compute hides anyway. The longest tail whose plan
  (state moved to host memory to make room) stays compute-bound and is faster; found by bisection, as fitting and
  staying compute-bound only get harder as the tail grows."""
  def better(tail: int) -> Plan | None:
    try:
      longer = layout(tail)
    except ValueError:
      return None
    return longer if longer.compute_bound and longer.step_seconds < plan.step_seconds else None

  best, low, high = plan, _last_layers(plan) + 1, num_layers
  while low <= high:
    tail = (low + high) // 2
    if (longer := better(tail)) is not None:
      best, low = longer, tail + 1
    else:
      high = tail - 1
  return best


def _last_layers(plan: Plan) -> int:
  """Layers in the plan's last group."""
  start, stop = plan.bounds[-1]
  return stop - start


def _all_resident(plan: Plan) -> bool:
  return plan.engine.device_state_groups == plan.groups


def _keeps_placement(plan: Plan, longer: Plan) -> bool:
  """A longer tail takes only memory left over: every group's state still on the device, activations no further."""
  return _all_resident(longer) and (plan.engine.activations_on_host or not longer.engine.activations_on_host)


def _layout(model, sizes, seq_len, batch_size, sub_batch, live, tail, budget, optimizer, grad_clip_norm, fsdp, target,
            machine, kept_groups=None, parked_grads_dtype="float32") -> Plan:
  """make_plan's placement for one tail (0: the last group is the last of the live_layers groups)."""
  bounds = EngineConfig(live_layers=live, tail_layers=tail).bounds(sizes.num_layers)
  groups, n = len(bounds), batch_size // sub_batch
  last_layers = bounds[-1][1] - bounds[-1][0]
  layer = sizes.layer_params
  opt_bytes = lambda shapes: 2 * tree_bytes(shapes) if optimizer is None else optimizer_state_bytes(optimizer, shapes)
  layer_opt_bytes = opt_bytes(sizes.layer_shapes)
  state_per_layer = (sizes.layer_master_bytes + layer_opt_bytes) // fsdp  # master weights + optimizer state
  state_per_group = live * state_per_layer
  weights_per_group = live * sizes.layer_weight_bytes  # gathered whole on every device while the group runs
  act = sizes.activation_bytes(sub_batch, seq_len)
  stash = (groups - 1) * n * act  # every group's input but the last group's

  cfg = EngineConfig(sub_batches=n, live_layers=live, grad_clip_norm=grad_clip_norm, tail_layers=tail,
                     parked_grads_dtype=parked_grads_dtype)
  peaks = _step_peaks(model, cfg, sub_batch, seq_len)
  if target is not None and jax.devices()[0].platform == "cpu":
    peaks = peaks.on_gpu()
  # Clipping by the exact global norm holds every group's reduced gradient until the next step's forward updates the
  # group: a group whose state lives on the device parks it there, a host group in pinned host memory (a crossing
  # each way).
  parked_per_layer = layer * cfg.parked_bytes_per_param // fsdp
  parked = live * parked_per_layer
  # What the step keeps in flight (the schedule's own account of it), then the compiled calls' scratch. Where every
  # group's state fits on the device beside it, no state moves, and nothing is in flight for the updates.
  fixed = lambda host_state: {MARGIN: margin_bytes(target), **in_flight_bytes(
      sizes, cfg, sub_batch, seq_len, state_per_layer, opt_bytes(sizes.outer_shapes), fsdp, host_state)}
  # The layers whose state (and parked gradient) the device keeps, with the compiled calls' scratch and the last
  # group's residuals beside them: the parked gradients are never there together with the last group's calls and
  # residuals (sljax.schedule.step_peak_bytes).
  step_peak = lambda parked_on_device: step_peak_bytes(peaks.last_group, peaks.backward_scratch, parked_on_device)
  needs = lambda layers: layers * state_per_layer + step_peak(layers * parked_per_layer)
  fixed_device = fixed(host_state=False)
  if budget.device_bytes - sum(fixed_device.values()) < needs(sizes.num_layers) or (
      kept_groups is not None and kept_groups < groups):
    fixed_device = fixed(host_state=True)
  free = budget.device_bytes - sum(fixed_device.values())
  if free < needs(0):
    raise ValueError(f"{(sum(fixed_device.values()) + needs(0)) / GIB:.1f} GiB of device memory is needed for one "
                     f"group's step (sub-batch {sub_batch} x {seq_len}), but the device has "
                     f"{budget.device_bytes / GIB:.1f} GiB; lower the sub-batch size or the sequence length")

  resident = lambda device_groups: sum(  # layers whose state the device keeps
      b - a for (a, b), on_device in zip(bounds, state_on_device(groups, device_groups)) if on_device)
  on_host, device_groups = free < needs(sizes.num_layers) + stash, groups
  room = lambda: max(n for n in range(sizes.num_layers + 1) if n == 0 or needs(n) <= free)  # layers' state
  if kept_groups is not None:
    device_groups = kept_groups
    if needs(resident(device_groups)) > free:
      raise ValueError(f"the checkpoint resumed keeps the state of {device_groups} of {groups} groups "
                       f"({resident(device_groups)} layers) on the device, which has room for that of {room()} "
                       f"layer(s) at this batch; resume where the device has more memory")
  while kept_groups is None and on_host and device_groups and needs(resident(device_groups)) > free:
    device_groups -= 1  # all on the device if it all fits (no PCIe traffic); else the stash first, then state
  if last_layers > live and not state_on_device(groups, device_groups)[-1]:
    raise ValueError(f"a tail of {last_layers} layers needs its state on the device, which has room for the state of "
                     f"{room()} layer(s)")
  device_layers = resident(device_groups)
  host_layers, host_groups = sizes.num_layers - device_layers, groups - device_groups
  scratch = max(peaks.last_group_scratch, peaks.backward_scratch)
  device_bytes = dict(fixed_device, **{SCRATCH: scratch, RESIDUALS: peaks.residuals,
                                       "resident group state": device_layers * state_per_layer,
                                       "activation stash": 0 if on_host else stash})
  host_weights = host_layers * sizes.layer_weight_bytes // fsdp if sizes.separate_weights else 0
  host_bytes = {"group weights": host_weights, "group state": host_layers * state_per_layer,
                "activation stash": stash if on_host else 0}
  on_device = device_layers * parked_per_layer
  if parked:
    device_bytes["parked grads (clipping)"] = on_device
    # The residuals are gone before the backward parks a gradient (negative parts, or none): live arrays ...
    if min(peaks.residuals, on_device):
      device_bytes[RESIDUALS_APART] = -min(peaks.residuals, on_device)
    host_bytes["parked grads (clipping)"] = host_layers * parked_per_layer
  # ... and the calls' scratch: the last group's beside its residuals, a backward's beside the parked gradients.
  apart = step_peak(on_device) - max(peaks.residuals, on_device) - scratch
  if apart:
    device_bytes[NEVER_TOGETHER] = apart
  layers = [b - a for a, b in bounds]
  host_bytes["replaced, awaiting their free"] = retired_host_bytes(
      state_on_device(groups, device_groups), [n * state_per_layer for n in layers],
      [n * sizes.layer_weight_bytes // fsdp if sizes.separate_weights else 0 for n in layers],
      [n * parked_per_layer for n in layers])
  if sum(host_bytes.values()) > budget.host_bytes:
    needed = sum(host_bytes.values()) + sum(device_bytes.values())
    raise ValueError(
        f"training state and activations need {needed / GIB:.1f} GiB; the device has {budget.device_bytes / GIB:.1f} "
        f"GiB and pinned host memory {budget.host_bytes / GIB:.1f} GiB (host part needs "
        f"{sum(host_bytes.values()) / GIB:.1f}); lower batch_size"
        + (", or use narrower moments (--moments_dtype=bfloat16, int8)" if layer_opt_bytes > 6 * layer else
           ", or use 8-bit moments (--moments_dtype=int8)" if layer_opt_bytes > 3 * layer else "")
        + ("; or turn off clipping (--grad_clip_norm=0), which holds every gradient until the global norm is known"
           if parked else ""))

  shard = weights_per_group // fsdp  # one host group's weight copy on this device
  # A host group's weights cross for the forward and for the backward, but the last group's once (it runs both in
  # one pass); its update brings its state in and sends the new state and weight copy out. With clipping the update
  # waits for the next step's forward: the parked gradient (sent out in the backward) comes back with the state, and
  # that forward takes the weights from the new master weights instead of fetching them. Each group's input but the
  # last's is stashed in the forward and fetched back in the backward (one hidden state per row: a level). The
  # token batch (a few bytes per token) is left out.
  level = sizes.activation_bytes(batch_size, seq_len) if on_host else 0
  backward_weights = (host_groups - (not state_on_device(groups, device_groups)[-1])) * shard
  update_in, update_out = host_groups * (state_per_group + parked), host_groups * (state_per_group + shard)
  stash = (groups - 1) * level
  # The model's forward is a third of its training FLOPs. The forward pass runs every group's but the last group's;
  # the backward pass is three forwards: the last group's forward + backward, the others' recompute + backward.
  forward_flops = batch_size * seq_len * sizes.flops_per_token(seq_len) / 3
  seconds = lambda flops: flops / (machine.peak_flops * machine.layer_efficiency)
  forward = seconds(forward_flops * (sizes.num_layers - last_layers) / sizes.num_layers)
  if parked:
    phases = {"forward": Phase(forward, update_in, update_out + stash),
              "backward": Phase(seconds(3 * forward_flops), backward_weights + stash, host_groups * parked)}
  else:
    phases = {"forward": Phase(forward, host_groups * shard, stash),
              "backward": Phase(seconds(3 * forward_flops), backward_weights + update_in + stash, update_out)}
  return Plan(
      engine=dataclasses.replace(cfg, activations_on_host=on_host, device_state_groups=device_groups), fsdp=fsdp,
      sub_batch_size=sub_batch, device_bytes=device_bytes, host_bytes=host_bytes, phases=phases, budget=budget,
      machine=machine, layers=sizes.num_layers,
      params=sizes.num_layers * sizes.layer_params // fsdp + sizes.outer_params)


def plan_batch(model, seq_len: int, budget: Budget, devices: int = 1, max_rows: int = MAX_ROWS, **plan_args
               ) -> tuple[Plan, str]:
  """The plan for the smallest batch whose step is compute-bound (Plan.compute_bound), fills at least one sub-batch
  of `sub_batch_tokens` (fewer tokens per call leave the GPU's matmuls short of their speed, even with nothing to
  copy) and, on a GPU, spends at most ONCE_A_STEP_SHARE of its compute on the work done once a step whatever its rows
  (Plan.once_a_step_seconds: the update); and one line saying why.

  Rows per device are tried in powers of two (times the sub-batch count when plan_args fixes it) up to max_rows,
  until one is such or the next does not fit; when none is, the largest that fits. devices: the mesh size (the
  batch is rows x devices). plan_args go to make_plan. ValueError when not even the smallest fits."""
  rows, plans = max(plan_args.get("sub_batches", 0), 1), []
  full_sub_batch = plan_args.get("sub_batch_tokens", SUB_BATCH_TOKENS)
  amortize = for_gpu(plan_args.get("target"))
  fed = lambda p: p.compute_bound and p.rows * seq_len >= full_sub_batch
  amortized = lambda p: not amortize or p.once_a_step_seconds <= ONCE_A_STEP_SHARE * p.compute_seconds
  while rows <= max_rows:
    try:
      plans.append(make_plan(model, seq_len, rows, budget, **plan_args))
    except ValueError:
      if not plans:
        raise
      break
    if fed(plans[-1]) and amortized(plans[-1]):
      break
    rows *= 2
  plan = plans[-1]
  once = lambda p: f", once a step {p.once_a_step_seconds:.2f} s" if amortize else ""
  step = lambda p: ", ".join(f"{name} compute {phase.compute_seconds:.2f} s vs copies {p.copy_seconds(phase):.2f} s"
                             for name, phase in p.phases.items()) + once(p)
  batch = f"batch {plan.rows * devices} ({plan.rows} rows x {devices} device(s))"
  why = "the next does not fit" if rows <= max_rows else f"{max_rows} rows is the most tried"
  share = f" and at most {ONCE_A_STEP_SHARE:.0%} of its compute once a step (the update)" if amortize else ""
  if fed(plan) and amortized(plan):
    smaller = f"; {plans[-2].rows} rows: {step(plans[-2])}" if len(plans) > 1 else ""
    return plan, (f"{batch}: the smallest whose step is compute-bound ({step(plan)}, margin {COMPUTE_MARGIN:g}x) "
                  f"with at least {full_sub_batch} tokens{share}{smaller}")
  if fed(plan):
    return plan, (f"{batch}: the largest that fits ({why}), its once-a-step work above {ONCE_A_STEP_SHARE:.0%} of "
                  f"its compute ({step(plan)})")
  if plan.compute_bound:
    return plan, f"{batch}: the largest that fits ({why}), short of {full_sub_batch} tokens ({step(plan)})"
  return plan, f"{batch}: none is compute-bound, this is the largest that fits ({why}; {step(plan)})"
