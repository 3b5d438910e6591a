"""Where tensors live: device memory or pinned host memory of the devices of one mesh, and what moves between them.

Every transfer and every collective of the engine goes through a `Placement`, which counts the bytes in `moved`,
summed over all devices:
  host_to_device / device_to_host   PCIe (each device's shard: a layout replicated over the data axis moves once per
                                    replica)
  between_devices                   bytes sent by collectives, as a bandwidth-optimal ring sends them (what NCCL does):
                                    n devices all-gathering or reduce-scattering N bytes each send (n-1)/n N,
                                    all-reducing them 2 (n-1)/n N
"""

import collections
import dataclasses
import functools
import json
import os
import threading
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sljax.mesh import AXES, PER_DEVICE, REPLICATED, make_mesh, state_spec

DEVICE = "device"
HOST = "pinned_host"  # page-locked: host<->device copies run at full PCIe speed and asynchronously


@dataclasses.dataclass(frozen=True)
class Placement:
  """Shardings over `mesh` (axes "data", "fsdp") in either memory kind, transfers, and the two collectives."""

  mesh: Mesh
  moved: dict = dataclasses.field(compare=False, default_factory=lambda: {
      "host_to_device": 0, "device_to_host": 0, "between_devices": 0})

  @classmethod
  def single(cls, device: jax.Device | None = None) -> "Placement":
    return cls(make_mesh({"data": 1, "fsdp": 1}, [device or jax.devices()[0]]))

  @property
  def fsdp(self) -> int:
    return self.mesh.shape["fsdp"]

  @property
  def data(self) -> int:
    return self.mesh.shape["data"]

  def state_spec(self, shape: tuple[int, ...]) -> P:
    """Layout of a layer group's weights, master weights, optimizer state and (reduced) gradients."""
    return state_spec(shape, self.fsdp)

  def device(self, spec: P = REPLICATED) -> NamedSharding:
    return NamedSharding(self.mesh, spec, memory_kind=DEVICE)

  def host(self, spec: P = REPLICATED) -> NamedSharding:
    return NamedSharding(self.mesh, spec, memory_kind=HOST)

  def shardings(self, tree, kind: str = DEVICE, spec=REPLICATED):
    """A sharding per leaf of `tree` (arrays or shapes); `spec` is a PartitionSpec or a function of a leaf's shape."""
    return jax.tree.map(lambda x: NamedSharding(self.mesh, _spec_of(spec, x), memory_kind=kind), tree)

  # ---- PCIe ----------------------------------------------------------------------------------------------------

  def to_device(self, tree, spec=None):
    """Asynchronous: returns at once, the copy runs while the caller dispatches more work.

    `spec` (a PartitionSpec or a function of a leaf's shape) lays the leaves out anew; None keeps each array's
    layout (numpy arrays: replicated).
    """
    return self._put(tree, spec, DEVICE, "host_to_device")

  def to_host(self, tree, spec=None):
    return self._put(tree, spec, HOST, "device_to_host")

  def _put(self, tree, spec, kind: str, direction: str):
    leaves, treedef = jax.tree.flatten(tree)
    shardings = [self._target(x, spec, kind) for x in leaves]
    self.moved[direction] += sum(_bytes_on_devices(x, sharding) for x, sharding in zip(leaves, shardings)
                                 if _memory_kind(x) != kind and not isinstance(x, jax.core.Tracer))
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    placed = dict(zip(on_device, jax.device_put([leaves[i] for i in on_device], [shardings[i] for i in on_device])))
    for i, x in enumerate(leaves):  # host data: each process places its own devices' parts (works on several hosts)
      if i not in placed:
        value = np.asarray(x)
        placed[i] = jax.make_array_from_callback(value.shape, shardings[i], lambda index, v=value: v[index])
    return treedef.unflatten([placed[i] for i in range(len(leaves))])

  def _target(self, x, spec, kind: str) -> NamedSharding:
    sharding = getattr(x, "sharding", None)
    if spec is None and isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
      return sharding.with_memory_kind(kind)
    return NamedSharding(self.mesh, _spec_of(REPLICATED if spec is None else spec, x), memory_kind=kind)

  # ---- on each device's rows -----------------------------------------------------------------------------------

  def local(self, fn: Callable, in_specs, out_specs, donate=()) -> Callable:
    """fn jitted to run on each device's own rows (shard_map over the mesh); nothing inside communicates."""
    mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(mapped, donate_argnums=donate)

  def zero_slots(self, tree):
    """fp32 gradient accumulators for the leaves of `tree` (arrays or shapes), zero, one slot per device (a leading
    axis laid out `PER_DEVICE`): each device adds its rows' part to its own (`accumulate`), `reduce` sums them."""
    return _zero_slots(self.device(PER_DEVICE))(tree)

  # ---- between devices -----------------------------------------------------------------------------------------

  def gather(self, tree, dtype=None):
    """The whole of `tree` on every device, from the fsdp shards on the devices (cast to `dtype` first): one
    all-gather over the fsdp axis. Each device sends (fsdp-1)/fsdp of the tree's bytes (in `dtype`)."""
    dtype = None if dtype is None else np.dtype(dtype)
    if self.fsdp == 1 and all(dtype in (None, x.dtype) for x in jax.tree.leaves(tree)):
      return tree  # already whole on every device
    itemsize = lambda x: (dtype or x.dtype).itemsize
    per_device = sum((self.fsdp - 1) * (x.size // self.fsdp) * itemsize(x) for x in jax.tree.leaves(tree)
                     if "fsdp" in self.state_spec(x.shape))
    self.moved["between_devices"] += self.mesh.size * per_device
    return _all_gather(tree, mesh=self.mesh, dtype=dtype)

  def reduce(self, per_device, sharded: bool = True):
    """Sums per-device accumulators (each leaf has a leading axis with one slot per device, see `PER_DEVICE`) over
    the mesh. sharded: each leaf ends in its fsdp layout (`state_spec`): a reduce-scatter over fsdp, then an
    all-reduce of the shard over data; each device sends (f-1)/f N + 2 (d-1)/d N/f of a leaf's N bytes. Otherwise (or
    for a leaf fsdp does not divide) the sum is replicated: an all-reduce over all n devices, 2 (n-1)/n N each."""
    d, f, n = self.data, self.fsdp, self.mesh.size
    total = 0
    for x in jax.tree.leaves(per_device):
      size = (x.size // n) * x.dtype.itemsize  # N: one device's slot
      if sharded and "fsdp" in self.state_spec(x.shape[1:]):
        total += n * ((f - 1) * size // f) + 2 * (d - 1) * size  # n x [(f-1)/f N + 2 (d-1)/d N/f]
      else:
        total += 2 * (n - 1) * size
    self.moved["between_devices"] += total
    # Consumes the accumulators. A sum as large per device as they are (nothing scattered) reuses their memory.
    in_place = not sharded or self.fsdp == 1
    return (_reduce_in_place if in_place else _reduce)(per_device, mesh=self.mesh, sharded=sharded)


def accumulate(acc, grads):
  """acc + grads in fp32, in a per-device slot (leading axis; inside `Placement.local`); acc None (a first
  sub-batch): grads alone, so no zeros are written and read back."""
  if acc is None:
    return jax.tree.map(lambda g: g.astype(jnp.float32)[None], grads)
  return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)


@functools.cache
def _zero_slots(sharding: NamedSharding) -> Callable:
  devices = sharding.mesh.size
  return jax.jit(lambda tree: jax.tree.map(lambda x: jnp.zeros((devices, *x.shape), jnp.float32), tree),
                 out_shardings=sharding)


@functools.partial(jax.jit, static_argnames=("mesh", "dtype"))
def _all_gather(tree, *, mesh: Mesh, dtype):
  fsdp = mesh.shape["fsdp"]
  specs = jax.tree.map(lambda x: state_spec(x.shape, fsdp), tree)

  def whole(x, spec):
    x = x.astype(dtype or x.dtype)
    return lax.all_gather(x, "fsdp", axis=spec.index("fsdp"), tiled=True) if "fsdp" in spec else x

  def body(tree):
    return jax.tree.map(whole, tree, specs)

  return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=REPLICATED, check_vma=False)(tree)


def _reduce_fn(per_device, *, mesh: Mesh, sharded: bool):
  fsdp = mesh.shape["fsdp"]
  specs = jax.tree.map(lambda x: state_spec(x.shape[1:], fsdp) if sharded else REPLICATED, per_device)

  def total(slot, spec):
    x = slot[0]  # this device's accumulator
    if "fsdp" not in spec:
      return lax.psum(x, AXES)
    x = lax.psum_scatter(x, "fsdp", scatter_dimension=spec.index("fsdp"), tiled=True)
    return lax.psum(x, "data")

  def body(per_device):
    return jax.tree.map(total, per_device, specs)

  return jax.shard_map(body, mesh=mesh, in_specs=(P(AXES),), out_specs=specs, check_vma=False)(per_device)


_reduce = jax.jit(_reduce_fn, static_argnames=("mesh", "sharded"))
_reduce_in_place = jax.jit(_reduce_fn, static_argnames=("mesh", "sharded"), donate_argnums=0)


def _spec_of(spec, x) -> P:
  return spec(x.shape) if callable(spec) else spec


def _memory_kind(x) -> str:
  return getattr(getattr(x, "sharding", None), "memory_kind", None) or HOST  # numpy arrays count as host


def _bytes_on_devices(x, sharding: NamedSharding) -> int:
  """Bytes of x's shards over all devices of the sharding (replicas counted once each)."""
  return _stored_bytes(int(np.prod(sharding.shard_shape(x.shape))), x.dtype) * sharding.mesh.size


def _stored_bytes(size: int, dtype) -> int:
  """Bytes of `size` values as XLA stores them: int4 two to a byte (PRNG keys: their dtype's own itemsize)."""
  extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
  return -(-size * (8 * dtype.itemsize if extended else jax.dtypes.itemsize_bits(dtype)) // 8)


def tree_bytes(tree) -> int:
  return sum(_stored_bytes(x.size, x.dtype) for x in jax.tree.leaves(tree))


def prefetch(items: Iterable, fetch: Callable) -> Iterator:
  """Yields fetch(item) for each item, issuing the next item's fetch before the current one is used. What it yields
  is the caller's alone: not held here while the caller runs (it is freed once the caller drops it, not at the next
  item). Held to the next item, the training step's last group kept its parked gradient (clipping: llama13b's
  13-layer tail, 15 GiB) on the device beside the tail's residuals, from its update to the first backward group."""
  items = iter(items)
  try:
    ahead = [fetch(next(items))]  # no local variable names what was yielded: gone from here once yielded
  except StopIteration:
    return
  for item in items:
    ahead.append(fetch(item))
    yield ahead.pop(0)
  yield ahead.pop()


class InFlight:
  """Bounds how far the host runs ahead of the device: `add(output)` of a call waits for the output added `limit`
  calls before it. A call or a copy allocates its outputs when it is issued, not when it runs, and a buffer the host
  drops is freed only once the calls that read it have run: a loop that never waits would hold every group's weights
  and activations at once. An output donated to a later call since (deleted) is not waited for."""

  def __init__(self, limit: int):
    self.limit, self.outputs = limit, collections.deque()

  def add(self, output: jax.Array):
    self.outputs.append(output)
    while len(self.outputs) > self.limit:
      oldest = self.outputs.popleft()
      if not oldest.is_deleted():
        oldest.block_until_ready()


# XLA's GPU client keeps each device's pinned host buffers in a pool that grows by pinning a new region, twice the last
# one's size, whenever its free chunks cannot hold a buffer, and never shrinks. Pinning is slow: on the project's H100
# machine (128 GiB of RAM, as the H200's) a 32 GiB region took 19 s, 0.6 s a GiB (benchmarks/results/
# pinned_pool_h100.json), and the call that asked for the buffer waits that long, so a pool that grows in the middle of
# a run stops one step for as long.
POOL_CHUNK_BYTES = 2**30


def pinned_buffer_maker(device: jax.Device, nbytes: int) -> Callable[[], jax.Array]:
  """A compiled call that makes a buffer of `nbytes` (zeros) in `device`'s pinned host memory: made on the device,
  copied out."""
  sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=HOST)
  return jax.jit(functools.partial(jnp.zeros, (nbytes,), jnp.uint8), out_shardings=sharding).lower().compile()


def grow_pinned_pools(devices: Iterable[jax.Device], nbytes: int, chunk: int = POOL_CHUNK_BYTES) -> int:
  """Has each device's pinned host pool hold `nbytes` at once, before a run's first step: allocates that much of
  pinned host memory on each device in chunks (made on the device, copied out), holds it all, then frees it. XLA's
  pool keeps the regions it grew, so the steps' buffers find them instead of growing the pool mid-run (what a GPU
  plan counts in pinned host memory then costs its pinning once, here). Returns the bytes each device held at
  once: fewer than asked where the pool ran out first (its cap, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB), which is logged,
  not raised: the run itself may need less than its plan counts."""
  chunks = -(-nbytes // chunk)
  held: list[jax.Array] = []
  counts = []
  for device in devices:
    make = pinned_buffer_maker(device, chunk)
    count = 0
    try:
      for count in range(1, chunks + 1):
        held.append(make())
        held[-1].block_until_ready()  # fails here, not later, when the pool is out of room
    except jax.errors.JaxRuntimeError as error:
      count -= 1
      logging.warning("pinned host pool of %s: held %.1f GiB of the %.1f GiB asked (%s)", device,
                      count * chunk / 2**30, nbytes / 2**30, str(error).splitlines()[0])
    counts.append(count)
  for x in held:
    x.delete()
  return min(counts, default=0) * chunk


def resident_bytes() -> int:
  """This process's resident host memory (RSS), pinned pools included."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
  """While entered, samples resident host memory every `interval` seconds; `extra` is the peak above the level at
  entry (what a save, a restore or a step adds on top of what the process held)."""

  def __init__(self, interval: float = 0.002):
    self.interval = interval

  def __enter__(self):
    self.start = self.peak = resident_bytes()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._done.wait(self.interval):
      self.peak = max(self.peak, resident_bytes())

  def __exit__(self, *exc_info):
    self._done.set()
    self._thread.join()
    self.peak = max(self.peak, resident_bytes())
    self.extra = self.peak - self.start


def live_bytes() -> dict[str, int]:
  """Bytes of this process's live jax arrays by memory kind, as stored (int4 two to a byte)."""
  held = collections.Counter()
  for x in jax.live_arrays():
    if not x.is_deleted():
      held[x.sharding.memory_kind] += _stored_bytes(x.size, x.dtype)
  return dict(held)


class MemoryPeaks:
  """While entered, samples the live arrays' bytes per memory kind every `interval` seconds (a thread: it takes the
  GIL from the dispatching thread, so the run it watches slows a little); on exit, `peaks` holds the most seen per
  kind, and "device_allocator" the accelerator's own peak (memory_stats' peak_bytes_in_use: compiled calls'
  scratch and the allocator's rounding included; None on a CPU, which keeps no such count)."""

  def __init__(self, interval: float = 0.02):
    self.interval = interval
    self.peaks: dict[str, int | None] = {}

  def __enter__(self):
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _take(self):
    for kind, held in live_bytes().items():
      self.peaks[kind] = max(self.peaks.get(kind, 0), held)

  def _sample(self):
    while not self._done.wait(self.interval):
      self._take()

  def __exit__(self, *exc_info):
    self._done.set()
    self._thread.join()
    self._take()
    stats = jax.devices()[0].memory_stats() or {}
    self.peaks["device_allocator"] = stats.get("peak_bytes_in_use")

  def line(self) -> str:
    """What the CLIs print with --memory_peaks: "memory peaks: " and the peaks as JSON (bytes)."""
    return "memory peaks: " + json.dumps(self.peaks, sort_keys=True)
