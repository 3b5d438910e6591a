"""Machine facts in one place: the GPUs sljax plans for (memory, peak, copy rates), this machine's RAM, XLA's
memory settings (its share of each GPU, the pinned host pools) and the default memory budgets built from them.
Measured values say where they were measured; the others say what they assume."""

import dataclasses
import glob
import math
import os

import jax

GIB = 2**30
MIB = 2**20

# Of each GPU's memory, what sljax lets XLA preallocate (XLA's own default is 0.75, but the training plan packs
# optimizer state into what it is given).
XLA_MEMORY_FRACTION = 0.97
MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# XLA gives each GPU its own pinned host pool, capped at this many GB (64 when unset). The pool grows by doubling
# regions and never shrinks, so uncapped it can take far more RAM than the buffers it holds.
PINNED_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_PINNED_POOL_GIB = 64
# Of RAM, the pinned host memory a process takes by default (the host budget), split evenly among its GPUs; the rest
# is left to the process and the machine.
PINNED_FRACTION = 0.75
# On CPU the "device" and the "host" are the same RAM: each gets half of this fraction.
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
  copy_bytes_per_s: float  # pinned host -> device
  copy_to_host_bytes_per_s: float  # device -> pinned host
  copy_both_bytes_per_s: float  # in total, while copies run both ways at once
  layer_efficiency: float  # fraction of peak_flops a decoder layer's kernels reach (the training plan's compute time)
  generation_flops: float  # FLOP/s the generator's layer calls reach (few tokens per row: far from peak)
  memory_bytes_per_s: float  # device memory reads
  dispatch_seconds: float  # host time per jitted call
  # Once-a-step work per parameter (each group's optimizer update, clipping's norm, the embeddings' and head's update):
  # the part of a training step that does not grow with its rows
  update_seconds_per_param: float = 0.0

  @property
  def pinned_bytes(self) -> int:
    return int(PINNED_FRACTION * self.ram_bytes)


# The H200's allocator limit is measured: memory_stats()["bytes_limit"] at XLA_MEMORY_FRACTION, printed as 135.6 GiB
# by every committed H200 plan (benchmarks/results/*h200*.json); its total is nvidia-smi's 143,771 MiB. The others'
# limits assume XLA keeps back the same share of the driver's total as on the H200 (not measured).
_H200_MEMORY, _H200_ALLOCATOR = 143_771 * MIB, int(135.6 * GIB)

# One H200 (SXM) on a 128 GiB machine (the project's, kind nvidia-h200). Measured there: copies from and to pinned
# host memory at 53 / 54 GB/s, 85 GB/s in total both ways at once (benchmarks/results/generate_h200.json, with 2 GiB
# buffers: 53.5 each way, 99 both ways), the llama13b layer kernels at ~70% of peak with cuDNN flash attention,
# ~43 us per dispatch (rounded up). Assumed: the generator's 600 TFLOP/s (below the 632 an 8192^3 bf16 matmul
# reaches there) and 4.0 TB/s of memory reads (below the data sheet's 4.8). Peak from the data sheet. Once-a-step
# work: train.py --model=llama13b --moments_dtype=int8 with the same placement (39 of 40 groups' state on the device, a
# tail of 2) took 2.95 s a step at batch 8 and 11.13 s at batch 32 (benchmarks/results/train_py_llama13b_int8_moments_
# h200.json, ..._batch32_h200.json): 0.341 s a row and 0.218 s a step, 16.8 ps for each of its 13.0 B params. The same
# rate is assumed for the other optimizers' states (not measured apart).
_H200_SHEET_MEMORY_BYTES_PER_S = 4.8e12
H200 = Machine("h200", "H200", _H200_MEMORY, _H200_ALLOCATOR, ram_bytes=128 * GIB, peak_flops=989e12,
               copy_bytes_per_s=53e9, copy_to_host_bytes_per_s=54e9, copy_both_bytes_per_s=85e9,
               layer_efficiency=0.70, generation_flops=600e12, memory_bytes_per_s=4.0e12, dispatch_seconds=50e-6,
               update_seconds_per_param=16.8e-12)


def _like_h200(name: str, device_kind: str, memory_bytes: int, peak_flops: float, copy_bytes_per_s: float,
               memory_sheet_bytes_per_s: float) -> Machine:
  """A GPU not measured here, from its data sheet: its peak, one-way copy rate and memory bandwidth, each reaching
  what the H200's reach of theirs (the other copy rates, layer efficiency, generation FLOP/s and memory reads in the
  H200's proportion, the once-a-step work in inverse proportion to the memory bandwidth); XLA's allocator share,
  dispatch time and 128 GiB of RAM per GPU as on the H200."""
  copy = copy_bytes_per_s / H200.copy_bytes_per_s
  return dataclasses.replace(
      H200, name=name, device_kind=device_kind, memory_bytes=memory_bytes,
      allocator_bytes=int(memory_bytes * _H200_ALLOCATOR / _H200_MEMORY), peak_flops=peak_flops,
      copy_bytes_per_s=copy_bytes_per_s, copy_to_host_bytes_per_s=copy * H200.copy_to_host_bytes_per_s,
      copy_both_bytes_per_s=copy * H200.copy_both_bytes_per_s,
      generation_flops=peak_flops * H200.generation_flops / H200.peak_flops,
      memory_bytes_per_s=memory_sheet_bytes_per_s * H200.memory_bytes_per_s / _H200_SHEET_MEMORY_BYTES_PER_S,
      update_seconds_per_param=H200.update_seconds_per_param * _H200_SHEET_MEMORY_BYTES_PER_S / memory_sheet_bytes_per_s)


MACHINES: dict[str, Machine] = {
    "h200": H200,
    # SXM: the H200's PCIe 5.0 copy rate.
    "h100-80gb": _like_h200("h100-80gb", "H100", 81_559 * MIB, peak_flops=989e12, copy_bytes_per_s=53e9,
                            memory_sheet_bytes_per_s=3.35e12),
    # SXM: half the H200's copy rate (PCIe 4.0 x16).
    "a100-80gb": _like_h200("a100-80gb", "A100", 81_920 * MIB, peak_flops=312e12, copy_bytes_per_s=26.5e9,
                            memory_sheet_bytes_per_s=2.04e12),
}
# Whose rates a plan quotes when the device it runs on is not in the table (CPU): the machine the project measured.
REFERENCE = H200


def machine_of(device_kind: str) -> Machine | None:
  """The table's row for a jax.Device.device_kind ("NVIDIA H200", "NVIDIA H100 80GB HBM3"); None when unknown."""
  return next((m for m in MACHINES.values() if m.device_kind in device_kind), None)


def rates_of(device_kind: str) -> Machine:
  """The row whose rates estimates for this device take: its own, else the reference machine's."""
  return machine_of(device_kind) or REFERENCE


# ---- this machine ------------------------------------------------------------------------------------------------

def meminfo() -> dict[str, int]:
  """/proc/meminfo in bytes, by field (MemTotal, MemAvailable, ...)."""
  with open("/proc/meminfo") as f:
    fields = dict(line.split(":", 1) for line in f)
  return {name: int(value.split()[0]) * 1024 for name, value in fields.items() if value.split()[1:] == ["kB"]}


def ram_bytes() -> int:
  """This machine's RAM (MemTotal)."""
  return meminfo()["MemTotal"]


def available_ram_bytes() -> int:
  """RAM the kernel can give without swapping (MemAvailable)."""
  return meminfo()["MemAvailable"]


def local_gpu_count() -> int:
  """The GPUs this process will see, counted without starting a backend (CUDA_VISIBLE_DEVICES, else the driver's
  list); 1 where neither says."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return max(len([d for d in visible.split(",") if d.strip()]), 1)
  return max(len(glob.glob("/proc/driver/nvidia/gpus/*")), 1)


# ---- XLA's memory settings: read when the backend starts, so set them before anything touches a device -----------

def reserve_gpu_memory():
  """Lets XLA preallocate XLA_MEMORY_FRACTION of each GPU; a value the user set wins."""
  os.environ.setdefault(MEMORY_FRACTION_ENV, str(XLA_MEMORY_FRACTION))


def cap_pinned_pools(process_bytes: float | None = None):
  """Caps each GPU's pinned pool at its share of `process_bytes` (default: the host budget, PINNED_FRACTION of
  RAM), at least 1 GiB, so that the pools' growth cannot take the machine; a value the user set wins."""
  if process_bytes is None:
    process_bytes = PINNED_FRACTION * ram_bytes()
  os.environ.setdefault(PINNED_POOL_ENV, str(max(int(process_bytes / local_gpu_count() / GIB), 1)))


# An explicit host budget's pools are capped this much above it: the pool rounds its regions up, and what the plan puts
# on the host must fit.
PINNED_POOL_HEADROOM = 1.1


def configure_process(host_memory_gib: float = 0):
  """XLA's memory settings of a process, one rule for every CLI and benchmark, so that each plans under the same
  limits for the same flags: XLA preallocates XLA_MEMORY_FRACTION of each GPU, and each GPU's pinned pool is capped
  at its share of `host_memory_gib` (the process's pinned host budget) plus PINNED_POOL_HEADROOM, or with 0 at its
  share of the default host budget. Values the user set win. Call it before anything touches a device; ValueError
  for a budget that is not a number of GiB >= 0."""
  check_budget_gib(host_memory_gib=host_memory_gib)
  reserve_gpu_memory()
  cap_pinned_pools(host_memory_gib * GIB * PINNED_POOL_HEADROOM if host_memory_gib else None)


def pinned_pool_bytes() -> int:
  """Each GPU's pinned pool cap in force (XLA's default when unset)."""
  return int(os.environ.get(PINNED_POOL_ENV, XLA_PINNED_POOL_GIB)) * GIB


def xla_memory_env() -> dict[str, str | None]:
  """XLA's memory settings as this process has them, for a results file."""
  return {name: os.environ.get(name) for name in (MEMORY_FRACTION_ENV, PINNED_POOL_ENV, "XLA_FLAGS")}


# ---- budgets -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Budget:
  """Bytes one device may fill: its own memory, and its share of pinned host memory."""

  device_bytes: int
  host_bytes: int


def check_budget_gib(**budgets_gib: float):
  """ValueError unless each budget (a flag's name: GiB) is a finite number >= 0, 0 meaning the default budget: checked
  before anything is allocated, as int(inf GiB) would fail only later, in a traceback."""
  for name, gib in budgets_gib.items():
    if not (math.isfinite(gib) and gib >= 0):
      raise ValueError(f"--{name} must be a number of GiB >= 0 (0: the default), got {gib}")


def default_budget(device: jax.Device | None = None, sharing: int = 1) -> Budget:
  """One device's budget here: the allocator's limit on the accelerator; for pinned host memory its share (over the
  `sharing` devices of this process that keep host state side by side) of PINNED_FRACTION of RAM, capped by its
  GPU's pinned pool. On CPU, device and host each get half of CPU_MEMORY_FRACTION of RAM."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    host = int(ram_bytes() * CPU_MEMORY_FRACTION) // sharing
    return Budget(device_bytes=host // 2, host_bytes=host // 2)
  return Budget(device_bytes=int(device.memory_stats()["bytes_limit"]),
                host_bytes=min(int(PINNED_FRACTION * ram_bytes()) // sharing, pinned_pool_bytes()))


def target_budget(machine: Machine, sharing: int = 1) -> Budget:
  """One GPU's budget on `machine` as train.py would give it there: the allocator's limit, and its share of the
  pinned budget (PINNED_FRACTION of the machine's assumed RAM)."""
  return Budget(device_bytes=machine.allocator_bytes, host_bytes=machine.pinned_bytes // sharing)


def default_host_budget_help() -> str:
  """What a --host_memory_gib of 0 means, for the CLIs' help."""
  return (f"{PINNED_FRACTION:.0%} of RAM with a GPU, split among its GPUs and capped by each one's pinned pool; "
          f"on CPU {CPU_MEMORY_FRACTION / 2:.0%} of RAM")
