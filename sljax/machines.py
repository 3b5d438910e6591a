"""Machine facts in one table: each GPU sljax plans for, with the memory train.py gives it, the RAM assumed beside it,
its peak and its copy rate. Measured values say where they were measured; the others say what they assume."""

import dataclasses

GIB = 2**30
MIB = 2**20

# Of each GPU's memory, what train.py lets XLA preallocate (XLA_PYTHON_CLIENT_MEM_FRACTION; XLA's own default is 0.75,
# but the plan packs optimizer state into what it is given).
XLA_MEMORY_FRACTION = 0.97
# Of RAM, the pinned host memory a process takes by default, split evenly among its GPUs: XLA's pinned pools grow by
# doubling and never shrink, so the rest is left to the process and the machine.
PINNED_FRACTION = 0.75
# On CPU the "device" and the "host" are the same RAM: the plan gives each half of this fraction.
CPU_MEMORY_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class Machine:
  """One GPU and the host RAM beside it."""

  name: str  # what --target takes
  device_kind: str  # a substring of jax.Device.device_kind
  memory_bytes: int  # the GPU's memory as the driver reports it
  allocator_bytes: int  # XLA's allocator limit at XLA_MEMORY_FRACTION (memory_stats()["bytes_limit"])
  ram_bytes: int  # host RAM assumed for a machine with one such GPU (the pinned budget is PINNED_FRACTION of it)
  peak_flops: float  # dense bf16 FLOP/s
  copy_bytes_per_s: float  # pinned host <-> device, one direction
  layer_efficiency: float  # fraction of peak_flops a decoder layer's kernels reach (the plan's compute time)

  @property
  def pinned_bytes(self) -> int:
    return int(PINNED_FRACTION * self.ram_bytes)


# The H200's allocator limit is measured: memory_stats()["bytes_limit"] at XLA_MEMORY_FRACTION, printed as 135.6 GiB
# by every committed H200 plan (benchmarks/results/*h200*.json); its total is nvidia-smi's 143,771 MiB. The others'
# limits assume XLA keeps back the same share of the driver's total as on the H200 (not measured).
_H200_MEMORY, _H200_ALLOCATOR = 143_771 * MIB, int(135.6 * GIB)


def _allocator(memory_bytes: int) -> int:
  return int(memory_bytes * _H200_ALLOCATOR / _H200_MEMORY)


MACHINES: dict[str, Machine] = {
    # One H200 (SXM) on a 128 GiB machine (the project's, kind nvidia-h200). Copy rate and layer efficiency measured
    # there (shared/DESIGN.md sections 1 and 5: 53 GB/s host->device from pinned memory; the llama13b layer kernels
    # reach ~70% of peak with cuDNN flash attention); peak from the data sheet.
    "h200": Machine("h200", "H200", _H200_MEMORY, _H200_ALLOCATOR, ram_bytes=128 * GIB, peak_flops=989e12,
                    copy_bytes_per_s=53e9, layer_efficiency=0.70),
    # Not measured: the data sheet's peak (SXM), the H200's PCIe 5.0 copy rate and layer efficiency (same Hopper
    # kernels), the same 128 GiB of RAM per GPU as the H200 machine.
    "h100-80gb": Machine("h100-80gb", "H100", 81_559 * MIB, _allocator(81_559 * MIB), ram_bytes=128 * GIB,
                         peak_flops=989e12, copy_bytes_per_s=53e9, layer_efficiency=0.70),
    # Not measured: the data sheet's peak (SXM), half the H200's copy rate (PCIe 4.0 x16), the H200's layer
    # efficiency, 128 GiB of RAM per GPU.
    "a100-80gb": Machine("a100-80gb", "A100", 81_920 * MIB, _allocator(81_920 * MIB), ram_bytes=128 * GIB,
                         peak_flops=312e12, copy_bytes_per_s=26.5e9, layer_efficiency=0.70),
}
# Whose rates a plan quotes when the device it runs on is not in the table (CPU): the machine the project measured.
REFERENCE = MACHINES["h200"]


def machine_of(device_kind: str) -> Machine | None:
  """The table's row for a jax.Device.device_kind ("NVIDIA H200", "NVIDIA H100 80GB HBM3"); None when unknown."""
  return next((m for m in MACHINES.values() if m.device_kind in device_kind), None)


def ram_bytes() -> int:
  """This machine's RAM (MemTotal)."""
  with open("/proc/meminfo") as f:
    return int(dict(line.split(":", 1) for line in f)["MemTotal"].split()[0]) * 1024
