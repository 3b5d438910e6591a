"""Where tensors live: device memory or pinned host memory, addressed through one mesh."""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DEVICE = "device"
HOST = "pinned_host"  # page-locked: host<->device copies run at full PCIe speed and asynchronously


@dataclasses.dataclass(frozen=True)
class Placement:
  """Shardings over `mesh` in either memory kind. Every transfer in the engine goes through here, and is counted
  in `moved` (bytes over all devices, by direction)."""

  mesh: Mesh
  moved: dict = dataclasses.field(default_factory=lambda: {"host_to_device": 0, "device_to_host": 0}, compare=False)

  @classmethod
  def single(cls, device: jax.Device | None = None) -> "Placement":
    return cls(Mesh(np.array([device or jax.devices()[0]]), ("data",)))

  def device(self, spec: P = P()) -> NamedSharding:
    return NamedSharding(self.mesh, spec, memory_kind=DEVICE)

  def host(self, spec: P = P()) -> NamedSharding:
    return NamedSharding(self.mesh, spec, memory_kind=HOST)

  def to_device(self, tree, spec: P = P()):
    """Asynchronous: returns at once, the copy runs while the caller dispatches more work."""
    self._count(tree, lambda kind: kind != DEVICE, "host_to_device")  # numpy arrays count as host
    return jax.device_put(tree, self.device(spec))

  def to_host(self, tree, spec: P = P()):
    self._count(tree, lambda kind: kind == DEVICE, "device_to_host")
    return jax.device_put(tree, self.host(spec))

  def _count(self, tree, moves, direction: str):
    self.moved[direction] += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
                                 if moves(getattr(getattr(x, "sharding", None), "memory_kind", None)))


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
