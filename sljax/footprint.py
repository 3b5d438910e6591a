"""The planning core: what every planner counts the same way.

The three planners (training `sljax.plan`, LoRA `sljax.lora.plan`, generation `sljax.generate_plan`) are search
policies over what this module owns: the bytes a layout holds per memory tier (`Footprint`), the one margin a GPU plan
leaves unplanned (`GPU_MARGIN_BYTES`), the one copy-time model (`copy_seconds`), the one compute-bound test
(`compute_bound`), the compiled-peak cache (`compiled_peak`) and whose rates a plan is made at (`machine_for`, from
sljax.machines, `--target` included). Loads no engine: inference plans with it too.
"""

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Callable, Hashable, NamedTuple

import jax

from sljax.machines import GIB, Budget, Machine, rates_of

# Device memory a plan for a GPU leaves unplanned: what neither XLA's compiled memory analysis nor the live arrays
# show (the allocator's rounding and fragmentation, buffers outside the compiled calls). The LoRA llama70b run
# peaked 1.8 GiB above its plan's counted parts (benchmarks/results/lora_llama70b_h200.json); the measured peak of
# each planner's cases against its plan is in benchmarks/results/plan_vs_peak_h200.json. On a CPU the live arrays
# are all there is (tests/test_plan.py's live-bytes tests), so a CPU plan leaves none.
GPU_MARGIN_BYTES = 2 * GIB
MARGIN = "margin (unplanned)"
# The part every plan names the compiled calls' scratch by: XLA's temp bytes, which no live array shows.
SCRATCH = "compiled calls' scratch"
# A plan is compute-bound "with a margin" when its compute is at least this many times its copies over the step: on
# the H200 only 64% of the copy time hid behind compute in the traced llama13b step (shared/DESIGN.md section 5), so
# the copies are given twice their time. Each pass must also hide its own copies at least once over.
COMPUTE_MARGIN = 2.0
# Tokens per sub-batch call the training planners aim at: enough to keep the GPU's matmuls at speed.
SUB_BATCH_TOKENS = 16384


def for_gpu(target: Machine | None) -> bool:
  """Whether a plan is for a GPU: this process's device is one, or a --target names one."""
  return target is not None or jax.devices()[0].platform != "cpu"


def machine_for(target: Machine | None) -> Machine:
  """Whose rates a plan's times are predicted at: the target's, else this device's (the reference machine's where
  the table has no row for it, as on a CPU)."""
  return target or rates_of(jax.devices()[0].device_kind)


def margin_bytes(target: Machine | None) -> int:
  """The device bytes a plan leaves unplanned (GPU_MARGIN_BYTES on a GPU, none on a CPU)."""
  return GPU_MARGIN_BYTES if for_gpu(target) else 0


@dataclasses.dataclass(frozen=True)
class Footprint:
  """What a layout holds at its peak, per memory tier, by part (a part may be negative: bytes that two other parts
  count but that are never held together)."""

  device: dict[str, int]
  host: dict[str, int]

  @property
  def device_bytes(self) -> int:
    return sum(self.device.values())

  @property
  def host_bytes(self) -> int:
    return sum(self.host.values())

  def shortfall(self, budget: Budget) -> int:
    """Bytes over the budget, both tiers together (0: it fits)."""
    return max(self.device_bytes - budget.device_bytes, 0) + max(self.host_bytes - budget.host_bytes, 0)

  def fits(self, budget: Budget) -> bool:
    return not self.shortfall(budget)

  def describe(self, budget: Budget) -> list[str]:
    """One line per tier: its total of the budget, and its parts."""
    return [_tier("device", self.device, budget.device_bytes), _tier("pinned host", self.host, budget.host_bytes)]


def _tier(name: str, parts: dict[str, int], budget: int) -> str:
  items = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if v)
  return f"{name}: {sum(parts.values()) / GIB:.1f} of {budget / GIB:.1f} GiB ({items})"


class Pass(NamedTuple):
  """One pass over the layers (a training step's forward or backward, a generation's prompt or decode pass): its
  predicted compute and the bytes that cross PCIe during it, which hide behind that compute or not at all."""

  compute_seconds: float
  host_to_device_bytes: int
  device_to_host_bytes: int


def copy_seconds(machine: Machine, host_to_device: float, device_to_host: float) -> float:
  """The copies' time: each direction at its own rate, both together at most at the machine's combined rate."""
  return max(host_to_device / machine.copy_bytes_per_s, device_to_host / machine.copy_to_host_bytes_per_s,
             (host_to_device + device_to_host) / machine.copy_both_bytes_per_s)


def pass_copy_seconds(machine: Machine, one: Pass) -> float:
  return copy_seconds(machine, one.host_to_device_bytes, one.device_to_host_bytes)


def compute_bound(machine: Machine, passes: list[Pass]) -> bool:
  """Compute at least COMPUTE_MARGIN times the copies over all passes, and at least the copies in every pass."""
  copies = [pass_copy_seconds(machine, one) for one in passes]
  return sum(one.compute_seconds for one in passes) >= COMPUTE_MARGIN * sum(copies) and all(
      one.compute_seconds >= copy for one, copy in zip(passes, copies))


def dequantize_bytes(stored: int, dequantized: int) -> int:
  """Device memory traffic of dequantizing compressed layers: their codes and scales (`stored` bytes) read, their
  kernels (`dequantized` bytes, in the compute dtype) written; at the machine's memory_bytes_per_s."""
  return stored + dequantized


def step_seconds(machine: Machine, passes: list[Pass]) -> float:
  """Each pass takes the longer of its compute and its copies."""
  return sum(max(one.compute_seconds, pass_copy_seconds(machine, one)) for one in passes)


_ANALYSES: dict = {}  # (temp, output) bytes of compiled calls by the planner's key: compiles take seconds
# A folder where the analyses also persist between processes of one source tree (the key does not name the code),
# for processes that plan the same tiny models again and again: the tests' train.py runs (tests/conftest.py sets it).
# Unset, each process compiles its own.
PEAK_CACHE_ENV = "SLJAX_COMPILED_PEAK_CACHE"


def compiled_peak(key: Hashable, lowered: Callable[[], list], outputs: bool = False) -> int:
  """The most scratch one of the calls `lowered()` returns (jax `Lowered` objects) needs, as this process's backend
  compiles them: XLA's temp bytes, plus the outputs' where the plan does not count those as parts of its own. Cached
  by `key`, which must name everything the calls' shapes depend on."""
  return max(temp + (output if outputs else 0) for temp, output in compiled_sizes(key, lowered))


def compiled_sizes(key: Hashable, lowered: Callable[[], list]) -> list[tuple[int, int]]:
  """(XLA's temp bytes, output bytes) of each call `lowered()` returns, in its order, cached as `compiled_peak`."""
  if key not in _ANALYSES:
    _ANALYSES[key] = _persisted(key, lambda: [(a.temp_size_in_bytes, a.output_size_in_bytes)
                                              for a in (call.compile().memory_analysis() for call in lowered())])
  return _ANALYSES[key]


def _persisted(key: Hashable, analyses: Callable[[], list]) -> list:
  """analyses(), read from (or written to) PEAK_CACHE_ENV's folder when it is set, under a name hashed from `key`'s
  repr and what else the compiler's result depends on: jax's version and settings, the backend and XLA_FLAGS. A key
  whose repr names an object's address only misses."""
  folder = os.environ.get(PEAK_CACHE_ENV)
  if not folder:
    return analyses()
  device = jax.devices()[0]
  named = repr((key, jax.__version__, device.platform, device.device_kind, os.environ.get("XLA_FLAGS"),
                sorted(jax.config.values.items())))
  path = os.path.join(folder, hashlib.sha256(named.encode()).hexdigest() + ".json")
  if os.path.exists(path):
    with open(path) as f:
      return [tuple(pair) for pair in json.load(f)]
  result = analyses()
  os.makedirs(folder, exist_ok=True)
  with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:  # whole files only
    json.dump(result, f)
  os.replace(f.name, path)
  return result
