"""plan_lora: how the LoRA engine runs on one device within a device and a pinned host budget; over a data-parallel
mesh, how each device runs its rows within its own budgets (every device holds the whole base and adapters)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from sljax.footprint import (MARGIN, SCRATCH, SUB_BATCH_TOKENS, Footprint, Pass, compiled_sizes, compute_bound,
                             dequantize_bytes, machine_for, margin_bytes, pass_copy_seconds)
from sljax.lora.engine import LoraEngine, LoraEngineConfig, held_base, lora_groups, lora_layer_flops
from sljax.lora.model import LoraModel, split_adapters
from sljax.machines import GIB, Budget, Machine
from sljax.memory import tree_bytes
from sljax.plan import RESIDUALS, gpu_peak_from_cpu
from sljax.sizes import model_sizes, stacked_layer_shapes

# Streamed groups' weights on the device at once, as the step paces itself (one group ahead, sljax.memory.InFlight):
# the group whose calls may still be running (its buffers are freed once they have run), the next one, and the one
# after it, whose copy is issued as the next is taken.
STREAMED_IN_FLIGHT = 3


class LoraPlan(NamedTuple):
  engine: LoraEngineConfig
  batch: int  # rows per step, over all devices
  device_bytes: dict
  host_bytes: dict
  # The forward pass and the backward pass (recompute + input gradients: twice the forward's compute); each copies
  # every streamed layer in, the stash in pinned host memory goes out in the forward and comes back in the backward.
  phases: dict[str, Pass]
  budget: Budget
  machine: Machine
  base_bits: int = 0  # LoraConfig.base_bits: the resident and streamed base layers' kernels as codes and scales
  layers: int = 0  # the model's
  devices: int = 1  # the data-parallel mesh's: each takes batch / devices rows, the bytes and times are one device's
  # Where the plan chose the batch: why these rows (the fewest compute-bound, the most that fit, or sub-batches grown)
  batch_why: str = ""

  @property
  def rows(self) -> int:
    """Rows per step on each device."""
    return self.batch // self.devices

  @property
  def last_layers(self) -> int:
    """Layers in the last group: those that keep their residuals."""
    start, stop = lora_groups(self.layers, self.engine)[0][-1]
    return stop - start

  @property
  def footprint(self) -> Footprint:
    return Footprint(self.device_bytes, self.host_bytes)

  @property
  def copy_seconds(self) -> float:
    """The copies' time over a step, pass by pass."""
    return sum(pass_copy_seconds(self.machine, phase) for phase in self.phases.values())

  @property
  def compute_seconds(self) -> float:
    """The compute's time over a step, pass by pass."""
    return sum(phase.compute_seconds for phase in self.phases.values())

  @property
  def compute_bound(self) -> bool:
    return compute_bound(self.machine, list(self.phases.values()))

  def describe(self) -> str:
    e = self.engine
    stash = "in pinned host" if e.activations_on_host else "on the device"
    rows = f" ({self.rows} rows x {self.devices} devices, each with the whole base)" if self.devices > 1 else ""
    return "\n".join([
        f"LoRA plan: batch {self.batch}{rows} as {e.sub_batches} sub-batches, "
        + (f"all {self.layers} base layers resident" if e.resident_layers >= self.layers
           else f"{e.resident_layers} of {self.layers} base layers resident (the rest stream)")
        + f", {e.live_layers} per group, activations {stash}"
        + (f"; the base's kernels as int{self.base_bits} codes with scales" if self.base_bits else "")
        + (f"; the last {e.tail_layers} layers one group that keeps its residuals (not recomputed; "
           f"{self.device_bytes.get(RESIDUALS, 0) / GIB:.1f} GiB for one sub-batch, each layer's in buffers of its "
           f"own, freed as its backward runs)" if e.tail_layers else ""),
        *("  " + line for line in self.footprint.describe(self.budget)),
        "  " + "; ".join(f"{name}: compute {phase.compute_seconds:.2f} s, copies "
                         f"{pass_copy_seconds(self.machine, phase):.2f} s" for name, phase in self.phases.items())
        + f" ({'compute-bound' if self.compute_bound else 'transfer-bound'})"])


def held_layer_bytes(model: LoraModel) -> int:
  """Bytes of one base layer as the engine holds it (sljax.lora.engine.held_base: with base_bits, the kernels' codes
  and scales), from the shapes of the model's params."""
  return tree_bytes(jax.eval_shape(lambda stacked: held_base(model, stacked), stacked_layer_shapes(model.base, 1)))


def _lowered_calls(model: LoraModel, call: str, layers: int, rows: int, seq_len: int) -> list:
  """The step's per-sub-batch calls of `call`, lowered for one device at these shapes (nothing is allocated):
  "last_group" (a layer's forward keeping its residuals, the head + loss and its backward, a layer's backward: the
  calls the last group of `layers` layers runs) or "backward" (recompute + backward of a group of `layers` layers)."""
  step = LoraEngine(model, optax.sgd(0.0), LoraEngineConfig()).calls  # one device's
  shape = lambda *s, dtype=model.cfg.dtype: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
  x = shape(rows, seq_len, model_sizes(model.base).hidden)
  # Every call takes the whole adapter stack and its gradient accumulators (the group's layers are sliced inside).
  stack = jax.eval_shape(model.init_adapters, jax.random.key(0), stacked_layer_shapes(model.base, model.cfg.num_layers))
  grads, start = jax.eval_shape(step.zeros, stack), shape(dtype=jnp.int32)
  held = jax.eval_shape(step.hold, stacked_layer_shapes(model.base, layers))
  if call == "backward":
    return [step.backward.lower(held, stack, start, x, x, grads)]
  outer = model_sizes(model.base).outer_shapes
  _, residuals = jax.eval_shape(step.tail_forward, held, stack, start, start, x)
  return [step.tail_forward.lower(held, stack, start, start, x),
          step.head.lower(outer, x, shape(rows, seq_len, dtype=jnp.int32), shape(rows, seq_len, dtype=jnp.float32),
                          shape(dtype=jnp.float32)),
          step.tail_backward.lower(held, stack, start, start, residuals, x, grads)]


def _call_peaks(model: LoraModel, live_layers: int, last_layers: int, rows: int, seq_len: int) -> tuple[int, int]:
  """(The most compiled scratch any of the step's calls needs for one sub-batch of rows, temp bytes; one layer's
  residuals in the last group, the outputs of its forward call less its output activation), as this process's
  backend compiles them. The plan counts the calls' other outputs (dx, the adapters' gradients) as parts of its own.
  Cached by call: a search over tails compiles each tail's last-group calls, and the other groups' backward once."""
  sizes = lambda call, layers: compiled_sizes((type(model.base), model.cfg, model.lora, call, layers, rows, seq_len),
                                              lambda: _lowered_calls(model, call, layers, rows, seq_len))
  last = sizes("last_group", last_layers)
  backward = sizes("backward", live_layers) if model.cfg.num_layers > last_layers else []
  return (max(temp for temp, _ in last + backward),
          last[0][1] - model_sizes(model.base).activation_bytes(rows, seq_len))


# The fewest tokens a sub-batch call of a tail plan takes (plan_lora): a llama70b layer's matmuls at 2048 tokens are
# still large (2048 x 8192 x 28672); fewer would trade the tail's recompute for slower calls.
MIN_TAIL_CALL_TOKENS = 2048


def plan_lora(model: LoraModel, seq_len: int, budget: Budget, batch: int = 0, sub_batches: int = 0,
              live_layers: int = 1, max_rows: int = 256, optimizer: optax.GradientTransformation | None = None,
              target: Machine | None = None, tail_layers: int | None = None, devices: int = 1) -> LoraPlan:
  """How the engine runs on one device: sub-batches of about SUB_BATCH_TOKENS tokens; the group-boundary
  activations on the device when everything fits there, else in pinned host memory; as many base layers resident as
  the device holds beside the adapters' state, the activations and the compiled calls' peak (the rest stream from
  pinned host); and (batch 0) the fewest rows whose passes are compute-bound with a margin, else the most that fit.
  Then, where the whole base stays on the device, a tail (LoraEngineConfig.tail_layers; tail_layers: that one, 0
  none) as long as the memory left holds: its layers keep their residuals instead of being recomputed; with sub_batches
  0, the batch split into more sub-batches where their longer tail makes the step's compute shorter; and (batch 0)
  where the tail is then the whole model, its sub-batches grown while it still is, if a token computes faster so.
  target: plan for one GPU of that machine (its rates; made on a CPU, the calls' compiled peak corrected by
  sljax.plan.gpu_peak_from_cpu, an estimate) instead of for this process's device. devices: the data-parallel mesh's
  size; the batch is then rows x devices, every device takes its rows of each sub-batch (max_rows: per device), and
  the plan is each device's, within `budget` (one device's). ValueError when nothing fits."""
  sizes = model_sizes(model.base)
  machine = machine_for(target)
  on_cpu = jax.devices()[0].platform == "cpu"
  peaks_of = lambda rows, last_layers: [(gpu_peak_from_cpu if target and on_cpu else int)(peak)
                                        for peak in _call_peaks(model, live_layers, last_layers, rows, seq_len)]
  optimizer = optimizer or optax.adamw(1e-4)
  layers, layer = sizes.num_layers, held_layer_bytes(model)
  flops = lora_layer_flops(model, seq_len)
  adapters = split_adapters(jax.eval_shape(lambda: model.init_layers(jax.random.split(jax.random.key(0), layers))))[1]
  outer = sizes.outer_shapes
  fixed = {MARGIN: margin_bytes(target),
           "embeddings+head (frozen)": tree_bytes(outer),
           # each stacked over all layers, whatever the groups: master, gradients (one slot on each device), the new
           # master; the optimizer state and its new value
           "adapters (master, grads, optimizer, update)":
               3 * tree_bytes(adapters) + 2 * tree_bytes(jax.eval_shape(optimizer.init, adapters))}
  # One layer's dequantize at the device memory's rate (a lower bound: the GPU's kernel reaches about half of it).
  dequantize = dequantize_bytes(layer, jnp.dtype(model.cfg.dtype).itemsize * sizes.layer_params) / (
      machine.memory_bytes_per_s) * bool(model.lora.base_bits)
  if tail_layers is not None and not 0 <= tail_layers <= layers:
    raise ValueError(f"tail_layers must be in 0..{layers} (the model's layers), got {tail_layers}")

  def layout(rows: int, n: int, tail: int) -> LoraPlan | None:
    """The plan for rows (each device's) in n sub-batches whose step copies the fewest bytes: the stash on the device
    costs base layers that must then stream (twice per step each), the stash in host memory costs its own copies out
    and in. A tail (tail > 0) only where the whole base stays on the device."""
    groups = lora_groups(layers, LoraEngineConfig(n, live_layers, tail, tail_layers=tail))[0]
    last_layers = groups[-1][1] - groups[-1][0]
    sub = rows // n
    act = sizes.activation_bytes(sub, seq_len)
    stash = (len(groups) - 1) * n * act  # every group's input but the last's
    scratch, residuals = peaks_of(sub, last_layers)
    # At the machine's layer efficiency: the forward runs every layer once, the backward every layer's gradients
    # (lora_layer_flops: the base's input gradient, the adapters', attention's) and recomputes the layers before the
    # last group. Each pass copies every streamed layer in, the stash crosses once each way.
    per_token_flop = rows * seq_len / (machine.peak_flops * machine.layer_efficiency)  # seconds
    forward = per_token_flop * layers * flops.forward
    backward = per_token_flop * (layers * flops.backward + (layers - last_layers) * flops.forward)
    # A compressed base is dequantized by every sub-batch's call of each layer, once a pass: fewer, larger sub-batches
    # dequantize less.
    forward, backward = forward + n * layers * dequantize, backward + n * layers * dequantize
    plans = []
    for on_host in (False, True):
      device = dict(fixed, **{"activations in flight": 3 * n * act, SCRATCH: scratch,
                              RESIDUALS: last_layers * residuals, "stashed activations": 0 if on_host else stash})
      left = budget.device_bytes - sum(device.values())
      in_flight = STREAMED_IN_FLIGHT * live_layers * layer
      resident = layers if left >= layers * layer else int((left - in_flight) // layer)
      streamed = layers - resident
      if tail and streamed:
        continue
      host = {"streamed base layers": streamed * layer, "stashed activations": stash if on_host else 0}
      if resident < 0 or sum(host.values()) > budget.host_bytes:
        continue
      device["resident base layers"] = resident * layer
      device[f"streamed base groups ({STREAMED_IN_FLIGHT} in flight)"] = in_flight if streamed else 0
      out = stash if on_host else 0
      phases = {"forward": Pass(forward, streamed * layer, out), "backward": Pass(backward, streamed * layer + out, 0)}
      plans.append(LoraPlan(LoraEngineConfig(n, live_layers, resident, on_host, tail), rows * devices, device, host,
                            phases, budget, machine, model.lora.base_bits, layers, devices))
    return min(plans, key=lambda plan: plan.copy_seconds, default=None)

  def longest_tail(plan: LoraPlan) -> LoraPlan:
    """The plan with the longest tail the device memory left over holds, the base still all resident and the
    activations no further from the device (the plan itself where no tail does): a first guess from the bytes one
    more layer adds, then a layer at a time down or up to the longest whose compiled peaks fit."""
    rows, n, first = plan.rows, plan.engine.sub_batches, plan.last_layers
    plans = {}

    def fits(tail: int) -> bool:
      if tail not in plans:
        plans[tail] = layout(rows, n, tail)
      longer = plans[tail]
      return longer is not None and longer.engine.resident_layers == layers and (
          plan.engine.activations_on_host or not longer.engine.activations_on_host)

    if plan.engine.resident_layers < layers or first == layers or not fits(first + 1):
      return plan
    per_layer = max(plans[first + 1].footprint.device_bytes - plan.footprint.device_bytes, 1)
    tail = min(layers, first + 1 + (budget.device_bytes - plans[first + 1].footprint.device_bytes) // per_layer)
    while not fits(tail):  # stops at first + 1 at the latest
      tail -= 1
    while tail < layers and fits(tail + 1):
      tail += 1
    return plans[tail]

  per_call = max(1, SUB_BATCH_TOKENS // seq_len)  # rows per sub-batch call
  # The fewest sub-batches whose rows stay within per_call (or the number given).
  split = lambda rows: sub_batches or min(d for d in range(1, rows + 1) if rows % d == 0 and rows // d <= per_call)
  memory = (f"{budget.device_bytes / GIB:.1f} GiB of device and {budget.host_bytes / GIB:.1f} GiB of pinned host "
            f"memory" + (f" with a tail of {tail_layers} layers (the whole base on the device)" if tail_layers else ""))
  tail = tail_layers or 0
  if batch:
    if batch % (devices * (sub_batches or 1)):
      parts = [f"{sub_batches} sub-batches"] * bool(sub_batches) + [f"{devices} devices"] * (devices > 1)
      raise ValueError(f"LoRA: batch {batch} does not split into {' x '.join(parts)}")
    rows = batch // devices
    best = layout(rows, split(rows), tail)
    if best is None:
      each = f" ({rows} rows on each of {devices} devices)" if devices > 1 else ""
      raise ValueError(f"LoRA: batch {batch} x {seq_len} tokens{each} does not fit {memory}")
  else:
    best, step = None, sub_batches or per_call
    for rows in range(step, max_rows + 1, step):
      plan = layout(rows, split(rows), tail)
      if plan is None:
        break
      best = plan
      if plan.compute_bound:
        break
    if best is None:
      raise ValueError(f"LoRA: not even {step} rows of {seq_len} tokens{' per device' * (devices > 1)} fit {memory}")
  if tail_layers is not None:
    return best
  best_tail = longest_tail(best)
  if sub_batches or best.engine.resident_layers < layers or best_tail.last_layers == layers:
    return best_tail
  # With the whole base on the device, more sub-batches of fewer rows keep a longer tail (it holds one sub-batch's
  # residuals per layer), so fewer layers are recomputed, but a compressed base is dequantized once more per layer and
  # sub-batch. The splits into more sub-batches of MIN_TAIL_CALL_TOKENS a call at least are tried beside the one
  # above, from the most sub-batches down for as long as each keeps the whole model as its tail (fewer then keep a
  # shorter one, and each tail search lowers several calls); the one whose step computes least is kept.
  plans = [best_tail]
  splits = [n for n in range(best.engine.sub_batches + 1, best.rows + 1)
            if best.rows % n == 0 and best.rows // n * seq_len >= MIN_TAIL_CALL_TOKENS]
  for n in reversed(splits):
    plan = layout(best.rows, n, 0)
    if plan is None or plan.engine.resident_layers < layers:
      continue
    plans.append(longest_tail(plan))
    if plans[-1].last_layers < layers:
      break
  best = min(plans, key=lambda plan: plan.compute_seconds)
  return best if batch else _fuller_sub_batches(best, layout, layers, per_call, max_rows)


def _fuller_sub_batches(plan: LoraPlan, layout, layers: int, per_call: int, max_rows: int) -> LoraPlan:
  """A plan whose tail is the whole model, with its sub-batches grown a row at a time (per_call rows a call, max_rows
  a step, at most) for as long as that tail still fits, where that makes a token's compute shorter: as many calls
  dequantize a compressed base's layers for more tokens. (Without one, a token costs the same at any rows.)"""
  per_token = lambda plan: plan.compute_seconds / plan.rows
  n = plan.engine.sub_batches
  if plan.last_layers < layers or plan.engine.activations_on_host:
    return plan
  for sub in range(plan.rows // n + 1, min(per_call, max_rows // n) + 1):
    grown = layout(sub * n, n, layers)
    if grown is None or grown.last_layers < layers or grown.engine.activations_on_host or (
        per_token(grown) >= per_token(plan) * (1 - 1e-9)):
      break
    plan = grown._replace(batch_why=f"sub-batches of {sub} rows, the most that keep the whole model's residuals: "
                                     f"the base is dequantized once a call for more tokens")
  return plan
