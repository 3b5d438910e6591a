"""The device mesh: data parallelism x FSDP, how each kind of tensor is laid out on it, and the multi-host start.

Axes: `data` (replicas, each with the whole state between its fsdp devices) and `fsdp` (each device holds 1/fsdp of
every group's weights and optimizer state). The default mesh puts fsdp over the devices of one host (fast links) and
data across hosts. Batch rows are split over every device (`PER_DEVICE`), so all devices compute.
"""

import os
import socket
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp")
# The leading axis split over every device: batch rows, and per-device slots of gradient accumulators.
PER_DEVICE = P(AXES)
REPLICATED = P()


def parse_mesh(text: str) -> dict[str, int]:
  """"data:2,fsdp:4" -> {"data": 2, "fsdp": 4}; an axis left out has size 1; "" -> the default for this run."""
  if not text:
    return default_mesh_shape()
  shape = dict.fromkeys(AXES, 1)
  for part in text.split(","):
    name, _, size = part.partition(":")
    if name.strip() not in AXES or not size.strip().isdigit() or int(size) < 1:
      raise ValueError(f"mesh {text!r}: expected comma-separated axis:size with axes {' and '.join(AXES)}, "
                       f"e.g. data:2,fsdp:4")
    shape[name.strip()] = int(size)
  return shape


def default_mesh_shape() -> dict[str, int]:
  """FSDP over each host's devices, data parallel across hosts. On CPU one device per process: several CPU devices
  in one process are a testing device (--xla_force_host_platform_device_count), not more compute."""
  local = 1 if jax.default_backend() == "cpu" else jax.local_device_count()
  return {"data": jax.process_count(), "fsdp": local}


def make_mesh(shape: dict[str, int] | str | None = None, devices=None) -> Mesh:
  """A ("data", "fsdp") mesh over `devices` (default: all). Its size must divide the device count; a smaller mesh
  takes the same number of devices from each process (the first ones). ValueError otherwise, before anything is
  allocated."""
  shape = parse_mesh(shape) if isinstance(shape, str) or shape is None else dict(dict.fromkeys(AXES, 1), **shape)
  devices = list(jax.devices() if devices is None else devices)
  size = shape["data"] * shape["fsdp"]
  if len(devices) % size:
    raise ValueError(f"mesh data:{shape['data']},fsdp:{shape['fsdp']} has {size} devices, which does not divide the "
                     f"{len(devices)} devices available")
  sizes = tuple(shape[axis] for axis in AXES)
  if size == len(devices):
    return Mesh(mesh_utils.create_device_mesh(sizes, devices), AXES)  # topology-aware order (NVLink neighbours)
  processes = sorted({d.process_index for d in devices})
  if size % len(processes) == 0:
    per_process = size // len(processes)
    devices = [d for p in processes for d in [d for d in devices if d.process_index == p][:per_process]]
  return Mesh(np.array(devices[:size]).reshape(sizes), AXES)


def state_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """Layout of one leaf of a layer group's state (stacked on a leading layer axis): split over fsdp along its largest
  dimension that fsdp divides, never the layer axis; replicated when none does (and over the data axis always)."""
  candidates = [d for d in range(1, len(shape)) if shape[d] % fsdp == 0]
  if fsdp == 1 or not candidates:
    return REPLICATED
  dim = max(candidates, key=lambda d: (shape[d], -d))
  return P(*[None] * dim, "fsdp")


def check_batch(rows: int, sub_batches: int, mesh: Mesh):
  """Every sub-batch is split over every device: rows must be a multiple of sub_batches x devices."""
  devices = mesh.size
  if rows % (sub_batches * devices):
    parts = [f"{sub_batches} sub-batches"] * (sub_batches > 1) + [f"{devices} devices"] * (devices > 1)
    raise ValueError(f"batch of {rows} rows is not divisible by {' x '.join(parts)} (mesh data:{mesh.shape['data']},"
                     f"fsdp:{mesh.shape['fsdp']}): use a multiple of {sub_batches * devices}")


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1,
                           timeout_s: int = 300) -> bool:
  """Joins a multi-process run through `jax.distributed` (one process per host, every host runs the same command).

  Each setting comes from its argument, else from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
  JAX_PROCESS_ID); under SLURM with several tasks, JAX reads srun's variables itself. Returns False (and does
  nothing) for a single process. A coordinator that cannot be reached within `timeout_s` raises TimeoutError; JAX
  itself aborts the process once `timeout_s` passes without every process joining.
  """
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  count = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
  index = process_id if process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1"))
  slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1"))
  if not address and slurm_tasks <= 1:
    if count > 1:
      raise ValueError(f"{count} processes need a coordinator address (--coordinator_address=host:port)")
    return False
  if address and (count < 1 or index < 0):
    raise ValueError(f"coordinator {address}: also give the number of processes and this process's id")
  if address and index > 0:
    _wait_for_coordinator(address, timeout_s)
  logging.info("joining %s as process %s of %s (time-out %d s)", address or "the SLURM job's coordinator",
               index if index >= 0 else "?", count or slurm_tasks, timeout_s)
  jax.distributed.initialize(address or None, count or None, index if index >= 0 else None,
                             initialization_timeout=timeout_s)
  return True


def _wait_for_coordinator(address: str, timeout_s: float):
  """Polls the coordinator's port: process 0 may start a little later than the others, but not never."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
      return
    except OSError as error:
      if time.monotonic() >= deadline:
        raise TimeoutError(f"coordinator {address} could not be reached within {timeout_s} s ({error}); is process 0 "
                           f"running, and is the address reachable from this host?") from None
      time.sleep(0.5)
