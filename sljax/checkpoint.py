"""Orbax checkpoints of a training state plus JSON metadata, streamed through host memory a part at a time.

A step directory is an orbax `CheckpointManager` step with two items:
  meta/      JSON (orbax JsonCheckpointHandler)
  state/     manifest.json: every array's name, path, dtype, shape, part and CRC-32
             part_00000/, part_00001/, ...: orbax PyTree checkpoints of consecutive arrays

What is saved is a `View` of the state: for the engines (sljax.checkpoint_layout) the model's master weights and
optimizer state one layer at a time, whatever the layer groups, memory kinds or mesh that held them, so that any
placement restores it; any other pytree (a LoRA run's adapters) is saved as it is.

XLA's pinned host pool already holds the host-resident state, and orbax's own save stages every array through it at
once (about twice the state in host memory). Here each part is copied into ordinary host memory, checked (finite) and
handed to one of WRITERS writer threads (an orbax Checkpointer each), which checksum (CRC-32) and write that many
parts at once while the next is copied; a restore reads and verifies as many parts at once as the budget holds (a part
read costs less memory than one written) while the one before them is placed, each array straight into its target
sharding (memory kind and mesh included), in manifest order. Parts are sized for the writers + 1 in flight: the extra
host memory is bounded by `staging_bytes`, never by the state's size.
"""

import collections
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import functools
import glob
import json
import math
import os
import queue
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from sljax.memory import tree_bytes

GIB = 2**30
STAGING_BYTES = 4 * GIB  # extra host memory a save or restore may use
# A part in flight costs more host memory than its bytes: the copy out of device memory, orbax's own copy of what it
# writes, and transfer buffers that the process keeps for the next save. A part is a quarter (PARTS_PER_BUDGET) of the
# budget shared by the parts in flight: WRITERS parts written at once while the next is staged (or read at once while
# the one before is placed), WRITERS + 1 in all. So part = staging / (PARTS_PER_BUDGET x (WRITERS + 1)): 4 GiB / 20 =
# 205 MiB. Measured on the H200 with orbax alone (parts of 512 MiB, issue #35), against the disk's own 1.50 GB/s written
# and 1.93 read (fsynced files): one Checkpointer wrote 0.86 GB/s and read 1.28, four in threads (their own Checkpointer
# each) 1.62 and 1.53. A budget too small for WRITERS parts of MIN_PART_BYTES (orbax writes a few metadata files per
# part) gets fewer writers, down to one, never larger parts; several processes keep one, so that each meets orbax's
# barriers part by part in the same order. Measured with one writer and 1 GiB parts, one at a time, on one H200 with 43
# GiB of state (benchmarks/results/checkpoint_scale_h200.json): a save peaked at 5.2 GiB above the level before it (3.4
# GiB of it still held after the save, and reused by the next) and a restore at 2.1 GiB; with 2 GiB parts 7.3 GiB
# (checkpoint_scale_2gib_parts_h200.json, state 46 GiB).
PARTS_PER_BUDGET = 4
WRITERS = 4
MIN_PART_BYTES = 64 * 2**20
# A restore holds less per part than a save: orbax's read buffer and the numpy array it returns, 2.2 to 3.0 part bytes
# per part in flight on the H200 (12-layer llama13b, 205 MiB parts: 2.2 GiB with 5 parts in flight, 4.2 GiB with 9,
# and 4.8 GiB with 8 in the run of 2026-12-04, over the 4 GiB budget). Reading is what bounds a restore (there, 4
# readers left the placing thread waiting 18 of 32 s at 0.79 of the disk's read rate; 7 reached 0.96), so a restore
# reads as many parts at once as the budget holds at the largest cost measured: 5 readers in 4 GiB.
RESTORE_BYTES_PER_PART_BYTE = 3.0
# Manifest versions. 2: an engine's state is saved per layer (sljax.checkpoint_layout). 1: as the engine held it in
# memory (layer groups stacked, compute copies included); read for its params and for pytrees saved as they are,
# not resumed by an engine (sljax.resume says so).
FORMAT = 2
READABLE_FORMATS = (1, 2)
FORMAT_1_REFUSED = ("checkpoint {where} is in sljax's checkpoint format 1, which held the engine's memory layout and "
                    "which this sljax does not resume: finish that run with the sljax that wrote it, or start afresh "
                    "in another --workdir")


class CheckpointError(ValueError):
  """The newest checkpoint cannot be restored; the message names its directory and says why in one line."""


class CheckpointMismatchError(CheckpointError):
  """The checkpoint on disk holds a different state (another model, other shapes) than the one asked for."""


class CheckpointCorruptError(CheckpointError):
  """The checkpoint on disk cannot be read: files truncated, missing or garbled."""


class DiskSpaceError(ValueError):
  """The disk under a run's checkpoints cannot hold what the run would keep there (found before any step)."""


class CheckpointWriteError(RuntimeError):
  """A save did not happen (disk full, unwritable, or a state with non-finite values); nothing partial is left and
  the checkpoints before it are intact. The message says why in one line."""


def abstract_like(state):
  """The shapes, dtypes and shardings (memory kinds included) of `state`: a restore target that allocates nothing."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


# ---- what a checkpoint holds of a state ------------------------------------------------------------------------------


class Saved(NamedTuple):
  """One array of a checkpoint and where a state holds it: the leaf `leaf` of a View's leaves, whole (layer None) or
  the slice `layer` of its leading (layer) axis."""

  path: tuple
  leaf: int
  layer: int | None = None


@dataclasses.dataclass
class View:
  """A state as a checkpoint holds it. `leaves`: the state's arrays (a save) or, for a restore, ShapeDtypeStructs
  with the shardings (memory kinds and mesh) to place them in. `arrays`: the checkpoint's arrays in the order they
  are written, each taken from (placed into) its leaf; a path saved twice is written once, and a restore may place
  one saved array into several leaves. `build(placed)`: the state from the restored leaves (None where no array
  fills one). sljax.checkpoint_layout gives the engines' views; any other pytree is saved as it is (`view_of`)."""

  leaves: list
  arrays: list[Saved]
  build: Callable[[list], Any]


def view_of(tree) -> View:
  """A pytree saved as it is: each leaf one array named by its pytree path."""
  _, paths, leaves = _flatten(tree)
  treedef = jax.tree.structure(tree)
  return View(leaves, [Saved(tuple(path), i) for i, path in enumerate(paths)],
              lambda placed: jax.tree.unflatten(treedef, placed))


def _as_view(state) -> View:
  return state if isinstance(state, View) else view_of(state)


def saved_bytes(state) -> int:
  """Bytes a checkpoint of `state` (a View or a pytree) holds."""
  view, seen, total = _as_view(state), set(), 0
  for array in view.arrays:
    if array.path not in seen:
      seen.add(array.path)
      leaf = view.leaves[array.leaf]
      total += tree_bytes(leaf) // (leaf.shape[0] if array.layer is not None else 1)
  return total


def _name(path) -> str:
  return ".".join(map(str, path))


def _array_shape(view: View, array: Saved) -> list[int]:
  shape = list(view.leaves[array.leaf].shape)
  return shape if array.layer is None else shape[1:]


def _arrays(view: View) -> dict[str, str]:
  """Each array's dtype[shape] in `view`, by dotted name."""
  return {_name(array.path): f"{np.dtype(view.leaves[array.leaf].dtype).name}{_array_shape(view, array)}"
          for array in view.arrays}


# ---- the streamed state item ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class StateSave(ocp.args.CheckpointArgs):
  state: Any  # a View or a pytree of arrays


@dataclasses.dataclass
class StateRestore(ocp.args.CheckpointArgs):
  target: Any  # a View or a pytree of arrays or ShapeDtypeStructs with shardings


class _Run(NamedTuple):
  """Arrays of a save taken from one leaf in one copy: consecutive layers of it, or the whole leaf."""

  leaf: int
  arrays: list[Saved]
  nbytes: int


class Timings:
  """Seconds spent per kind of work in the last save or restore, summed over the threads that did it (so the readers'
  or writers' sums can exceed the wall time): where a save's or a restore's time goes."""

  def __init__(self):
    self.seconds, self._lock = collections.Counter(), threading.Lock()

  @contextlib.contextmanager
  def timed(self, kind: str):
    start = time.perf_counter()
    try:
      yield
    finally:
      with self._lock:
        self.seconds[kind] += time.perf_counter() - start


class StateHandler(ocp.CheckpointHandler):
  """Saves and restores a state (a View, or a pytree of jax arrays) part by part within `staging_bytes` of extra host
  memory, `writers` + 1 parts at a time: a save copies the next part out of device or pinned memory and checks it
  while up to `writers` parts are written at once; a restore reads (and verifies) up to `readers` (by default as many
  as the budget holds, `readers_for`) parts at once, ahead of the one being placed as far as the budget's bytes
  allow. `timings` says where the last one's time went."""

  def __init__(self, staging_bytes: int = STAGING_BYTES, readers: int | None = None):
    self.writers = writers_for(staging_bytes)
    self.part_bytes = max(staging_bytes // (PARTS_PER_BUDGET * (self.writers + 1)), 1)
    self.readers = readers or readers_for(staging_bytes, self.part_bytes, self.writers)
    self.timings = Timings()
    self._idle = queue.SimpleQueue()  # an orbax Checkpointer per writer (or reader) thread
    for _ in range(max(self.writers, self.readers)):
      self._idle.put(ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)))  # floats barely shrink

  @contextlib.contextmanager
  def _checkpointer(self):
    parts = self._idle.get()
    try:
      yield parts
    finally:
      self._idle.put(parts)

  def save(self, directory: epath.Path, args: StateSave):
    view = _as_view(args.state)
    entries, files = {}, {}
    self.timings = timings = Timings()

    def write(index: int, staged: list):
      # Checksums here, in the writers, not in the thread that stages: zlib's CRC-32 (~3.6 GB/s on one core) would
      # otherwise hold up the next part's copy.
      with timings.timed("checksum"):
        crcs = [_crc32(value) if isinstance(value, np.ndarray) else None for _, value in staged]
      with timings.timed("write"):
        self._write_part(directory, index, [value for _, value in staged])
      files[index] = _file_sizes(directory, _part_name(index))
      entries[index] = [{"name": _name(array.path), "path": list(array.path), "dtype": np.dtype(value.dtype).name,
                         "shape": list(value.shape), "part": index, "crc32": crc}
                        for (array, value), crc in zip(staged, crcs)]

    # Up to `writers` parts are written while this thread stages the next, and no more bytes than writers + 1 parts
    # of part_bytes: a part is staged once a writer is free and the parts being written leave room for it (an array
    # larger than a part is a part of its own: llama13b's fp32 embedding is 625 MiB, three parts' worth; on the H200
    # four such in flight took a save 0.5 GiB past its staging budget). A failure anywhere ends the save: the writers
    # still running finish their part first (leaving the pool waits for them), then the first failure is raised.
    budget = (self.writers + 1) * self.part_bytes
    with concurrent.futures.ThreadPoolExecutor(max_workers=self.writers) as pool:
      writing = {}  # future -> the bytes of the part it writes
      for index, part in enumerate(_pack(_runs(view, self.part_bytes), self.part_bytes)):
        size = sum(run.nbytes for run in part)

        def wait_while(busy):
          with timings.timed("wait for writers"):
            while writing and busy():
              done, _ = concurrent.futures.wait(writing, return_when=concurrent.futures.FIRST_COMPLETED)
              for written in done:
                del writing[written]
                written.result()

        wait_while(lambda: sum(writing.values()) + size > budget)  # room to stage it beside those being written
        with timings.timed("stage"):
          staged = _stage(view, part)
        wait_while(lambda: len(writing) >= self.writers)  # a free writer
        writing[pool.submit(write, index, staged)] = size
        del staged
        _return_freed_memory()
      for written in concurrent.futures.as_completed(writing):
        written.result()
    _return_freed_memory()
    if jax.process_index() == 0:
      manifest = {"format": FORMAT, "arrays": [entry for index in sorted(entries) for entry in entries[index]],
                  "files": {path: size for index in sorted(files) for path, size in files[index].items()}}
      (directory / "manifest.json").write_text(json.dumps(manifest))

  def _write_part(self, directory: epath.Path, index: int, arrays: list):
    with self._checkpointer() as parts:
      parts.save(directory / _part_name(index), args=ocp.args.PyTreeSave(arrays))

  def restore(self, directory: epath.Path, args: StateRestore):
    view = _as_view(args.target)
    into = collections.defaultdict(list)
    for array in view.arrays:
      into[_name(array.path)].append(array)
    assemblies = {array.leaf: _Assembly(view.leaves[array.leaf], self.part_bytes)
                  for array in view.arrays if array.layer is not None}
    placed = [None] * len(view.leaves)
    self.timings = Timings()
    for entry, value in self._read_parts(directory, lambda entry: entry["name"] in into):
      with self.timings.timed("place"):
        for array in into[entry["name"]]:
          target = view.leaves[array.leaf]
          if array.layer is None:
            placed[array.leaf] = _place(value.astype(target.dtype, copy=False), target)
          elif assemblies[array.leaf].add(array.layer, value):
            placed[array.leaf] = assemblies.pop(array.leaf).result()
        del value
    return view.build(placed)

  def read_arrays(self, directory: epath.Path, wanted=lambda path: True) -> dict[tuple, np.ndarray]:
    """{path: numpy array} of the saved arrays whose path `wanted` accepts, verified; host memory for them only."""
    return {tuple(entry["path"]): value
            for entry, value in self._read_parts(directory, lambda entry: wanted(tuple(entry["path"])))}

  def _read_parts(self, directory: epath.Path, wanted=lambda entry: True):
    """(manifest entry, verified numpy array) of each saved array `wanted` accepts, in manifest order, skipping the
    parts that hold none of them. Up to `readers` parts are read (and verified) at once, a reader going on to the next
    part as soon as its own is read, while the caller takes them in order, within RESTORE_BYTES_PER_PART_BYTE x
    readers parts of this handler's size of host memory (below)."""
    manifest = read_manifest(directory)
    by_part, held = collections.defaultdict(list), collections.Counter()
    for entry in manifest["arrays"]:
      by_part[entry["part"]].append(entry)
      held[entry["part"]] += np.dtype(entry["dtype"]).itemsize * math.prod(entry["shape"])
    indices = [index for index in sorted(by_part) if any(map(wanted, by_part[index]))]

    def read(index: int) -> list[tuple[dict, np.ndarray]]:
      entries, part = by_part[index], _part_name(index)
      # A file cut short or missing is found here, before orbax starts reading: orbax gives up on the first array it
      # cannot read while tensorstore still reads the others, whose completions then print tracebacks.
      _check_files(directory, part, manifest["files"])
      as_numpy = [ocp.RestoreArgs(restore_type=np.ndarray)] * len(entries)
      with self._checkpointer() as parts, self.timings.timed("read"):
        values = parts.restore(directory / part,
                               args=ocp.args.PyTreeRestore(item=[0] * len(entries), restore_args=as_numpy))
      kept = [(entry, value) for entry, value in zip(entries, values) if wanted(entry)]
      with self.timings.timed("verify"):
        for entry, value in kept:
          _verify(entry, value)
      return kept

    # Parts are read in manifest order by up to `readers` threads and handed over in that order. A part costs host
    # memory by its state: RESTORE_BYTES_PER_PART_BYTE x its bytes while it is read (orbax's buffers and the arrays),
    # its bytes once read (the arrays, waiting for or held by the caller). A reader whose part is read before the
    # ones ahead of it takes the next part at once, while the bytes of all parts allow: a slow part holds up the
    # caller, not the other readers, and no more than 2 x readers parts are ahead (a checkpoint of parts far smaller
    # than this handler's is not read whole ahead of the caller). The budget is RESTORE_BYTES_PER_PART_BYTE x readers
    # parts of this handler's size
    # (with readers + 1 parts, 3.6 GiB of cost, the H200 measured 4.4 GiB above the level before the restore:
    # benchmarks/results/checkpoint_scale_readers_ahead_h200.json), and one part is read ahead at least (a checkpoint
    # written with larger parts is read fewer at a time).
    budget = RESTORE_BYTES_PER_PART_BYTE * self.readers * self.part_bytes
    lock, ahead, following = threading.RLock(), collections.deque(), iter(indices)
    state = {"upcoming": next(following, None), "reading": 0, "cost": 0.0, "stopped": False}
    with concurrent.futures.ThreadPoolExecutor(max_workers=self.readers) as pool:

      def read_ahead():
        with lock:
          while not state["stopped"] and state["upcoming"] is not None and (not ahead or (
              state["reading"] < self.readers and len(ahead) < 2 * self.readers
              and state["cost"] + RESTORE_BYTES_PER_PART_BYTE * held[state["upcoming"]] <= budget)):
            size = held[state["upcoming"]]
            state["reading"] += 1
            state["cost"] += RESTORE_BYTES_PER_PART_BYTE * size
            future = pool.submit(read, state["upcoming"])
            ahead.append((size, future))
            state["upcoming"] = next(following, None)
            future.add_done_callback(functools.partial(was_read, size))

      def was_read(size: int, future: concurrent.futures.Future):
        with lock:
          state["reading"] -= 1
          state["cost"] -= (RESTORE_BYTES_PER_PART_BYTE - 1) * size  # its arrays stay until the caller is done
          state["stopped"] |= future.cancelled() or future.exception() is not None
        read_ahead()

      try:
        read_ahead()
        while ahead:  # never empty while parts are left: read_ahead starts one whenever none is ahead
          with lock:
            size, arrived = ahead.popleft()
          with self.timings.timed("wait for readers"):
            part = arrived.result()
          while part:
            yield part.pop(0)
          del arrived, part
          _return_freed_memory()
          with lock:
            state["cost"] -= size
          read_ahead()
      finally:
        with lock:
          state["stopped"] = True

  def metadata(self, directory: epath.Path):
    return read_manifest(directory)

  def close(self):
    for _ in range(max(self.writers, self.readers)):
      self._idle.get().close()


ocp.args.register_with_handler(StateHandler, for_save=True)(StateSave)
ocp.args.register_with_handler(StateHandler, for_restore=True)(StateRestore)


def writers_for(staging_bytes: int) -> int:
  """Parts a save writes (and a restore reads) at once within `staging_bytes`: WRITERS, fewer where parts would fall
  below MIN_PART_BYTES (one at least), one when several processes save."""
  if jax.process_count() > 1:
    return 1
  room = staging_bytes // (PARTS_PER_BUDGET * MIN_PART_BYTES) - 1
  return max(1, min(WRITERS, room))


def readers_for(staging_bytes: int, part_bytes: int, writers: int) -> int:
  """Parts a restore reads at once: as many as fit `staging_bytes` with the one being placed, at
  RESTORE_BYTES_PER_PART_BYTE each, never fewer than the save's writers; as many as the writers when several processes
  restore (each meets orbax's barriers part by part in the same order)."""
  if jax.process_count() > 1:
    return writers
  return max(writers, int(staging_bytes // (RESTORE_BYTES_PER_PART_BYTE * part_bytes)) - 1)


def _runs(view: View, part_bytes: int) -> list[_Run]:
  """The arrays of `view` (each path once) as runs of one leaf each: a leaf's consecutive layers together, those of a
  device-resident leaf larger than a part in runs of at most a part (a pinned-host leaf is read whole anyway)."""
  seen, runs = set(), []
  for array in view.arrays:
    if array.path in seen:
      continue
    seen.add(array.path)
    leaf = view.leaves[array.leaf]
    nbytes = tree_bytes(leaf) // (leaf.shape[0] if array.layer is not None else 1)
    last = runs[-1] if runs else None
    if (last is not None and last.leaf == array.leaf and array.layer is not None
        and last.arrays[-1].layer == array.layer - 1
        and (_on_host(leaf) or last.nbytes + nbytes <= part_bytes)):
      runs[-1] = _Run(last.leaf, last.arrays + [array], last.nbytes + nbytes)
    else:
      runs.append(_Run(array.leaf, [array], nbytes))
  return runs


def _pack(runs: list[_Run], part_bytes: int) -> list[list[_Run]]:
  """Consecutive runs, each part at most `part_bytes` (a larger run is a part of its own)."""
  parts, current, size = [], [], 0
  for run in runs:
    if current and size + run.nbytes > part_bytes:
      parts.append(current)
      current, size = [], 0
    current.append(run)
    size += run.nbytes
  return parts + [current] if current else parts


def _on_host(x) -> bool:
  """Whether `x` (a jax array or ShapeDtypeStruct) lives in host memory (pinned or not)."""
  return getattr(getattr(x, "sharding", None), "memory_kind", None) not in (None, "device")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _layers(x, start: int, stop: int):
  return jax.lax.slice_in_dim(x, start, stop)


def _stage(view: View, runs: list[_Run]) -> list[tuple[Saved, Any]]:
  """(array, its value in ordinary host memory) of each array of `runs`, each run's leaf (or its layers) copied once
  and split into layers in numpy, after checking that it is finite. A leaf that this process cannot see whole
  (several hosts) goes to orbax as jax arrays (saved without a checksum)."""

  def one(run: _Run):
    x, first, last = view.leaves[run.leaf], run.arrays[0].layer, run.arrays[-1].layer
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return [(array, x if array.layer is None else _layers(x, array.layer, array.layer + 1)[0])
              for array in run.arrays]
    whole = first is None or (first == 0 and last == x.shape[0] - 1) or _on_host(x)
    if not whole:  # device slices of a leaf larger than a part, one run's at a time
      x, base = _layers(x, first, last + 1), first
    else:
      base = 0
      # jax keeps the host copy of a device array on the array it was read from (on the H200 a save left the
      # device-resident state's size in host memory, benchmarks/results/checkpoint_scale_cached_host_copies_h200.json:
      # 14.2 GiB above the level before the save): read a device array through a fresh copy of it on the device,
      # which takes the cached host copy with it when dropped. Pinned-host arrays are read in place.
      if isinstance(x, jax.Array) and not _on_host(x):
        x = jax.device_put(x, x.sharding, may_alias=False)
    value = np.asarray(x)
    staged = []
    for array in run.arrays:
      part = value if array.layer is None else value[array.layer - base]
      if np.issubdtype(part.dtype, np.inexact) and not _finite(part):
        raise _NonFinite(_name(array.path))
      staged.append((array, part))
    return staged

  with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(runs), os.cpu_count() or 1)) as pool:
    return [item for staged in pool.map(one, runs) for item in staged]  # copies and checks release the GIL


def _place(value: np.ndarray, target):
  """A host array placed straight into `target`'s sharding (memory kind and mesh)."""
  return jax.make_array_from_callback(tuple(target.shape), target.sharding, lambda where: value[where])


@functools.partial(jax.jit, static_argnums=1)
def _joined(chunks, sharding):
  return jax.lax.with_sharding_constraint(jnp.concatenate(chunks), sharding)


class _Assembly:
  """A restored leaf stacked from its saved layers as they arrive, in host memory when it fits a part; a larger one
  in chunks of about a part placed on the device as they complete, joined there (then moved to its memory kind)."""

  def __init__(self, target, part_bytes: int):
    self.target, self.layers = target, target.shape[0]
    layer_bytes = max(tree_bytes(target) // max(self.layers, 1), 1)
    self.chunk = self.layers if tree_bytes(target) <= part_bytes else max(part_bytes // layer_bytes, 1)
    self.waiting, self.next, self.chunks = {}, 0, []

  def add(self, layer: int, value: np.ndarray) -> bool:
    """Takes a saved layer; True once every layer has come."""
    self.waiting[layer] = value
    while self.next < self.layers:
      stop = min(self.next + self.chunk, self.layers)
      if any(i not in self.waiting for i in range(self.next, stop)):
        break
      layers = [self.waiting.pop(i) for i in range(self.next, stop)]
      stacked = (layers[0][None] if len(layers) == 1 else np.stack(layers)).astype(self.target.dtype, copy=False)
      if self.chunk == self.layers:
        self.chunks.append(_place(stacked, self.target))
      else:
        sharding = self.target.sharding.with_memory_kind("device")
        self.chunks.append(_place(stacked, jax.ShapeDtypeStruct(stacked.shape, stacked.dtype, sharding=sharding)))
      del stacked
      self.next = stop
    return self.next == self.layers

  def result(self):
    if len(self.chunks) == 1:
      return self.chunks[0]
    sharding = self.target.sharding
    joined = _joined(tuple(self.chunks), sharding.with_memory_kind("device"))
    self.chunks = []
    return joined if not _on_host(self.target) else jax.device_put(joined, sharding)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def _return_freed_memory():
  """Gives the freed part buffers back to the OS. glibc keeps freed blocks below its adaptive mmap threshold (and
  every thread's arena) for reuse, so without this a save's peak stays resident: measured on CPU, 45-95 MiB of 8 MiB
  parts stayed resident after each save, 2-24 MiB with it."""
  if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
    _LIBC.malloc_trim(0)


def _file_sizes(directory: epath.Path, part: str) -> dict[str, int]:
  """{path under `directory`: bytes} of every file orbax wrote for `part`."""
  root = os.fspath(directory)
  return {os.path.relpath(os.path.join(folder, name), root): os.path.getsize(os.path.join(folder, name))
          for folder, _, names in os.walk(os.path.join(root, part)) for name in names}


def _check_files(directory: epath.Path, part: str, files: dict[str, int]):
  for path, size in files.items():
    if path.startswith(part + os.sep):
      where = os.path.join(os.fspath(directory), path)
      if not os.path.exists(where):
        raise _Garbled(f"{path} is missing")
      if os.path.getsize(where) != size:
        raise _Garbled(f"{path} holds {os.path.getsize(where)} bytes, {size} were written")


def _part_name(index: int) -> str:
  return f"part_{index:05d}"


def path_key(entry) -> str | int:
  """A pytree path entry as a plain key: a dict key, an attribute name or a sequence index."""
  for attribute in ("key", "idx", "name"):
    if hasattr(entry, attribute):
      return getattr(entry, attribute)
  return str(entry)


def _flatten(tree) -> tuple[list[str], list[list], list]:
  """(dotted names, paths as lists of keys, leaves) in pytree order."""
  with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = [[path_key(entry) for entry in path] for path, _ in with_paths]
  return [".".join(map(str, path)) for path in paths], paths, [leaf for _, leaf in with_paths]


def _finite(value: np.ndarray, chunk: int = 2**20) -> bool:
  """Whether every element is finite, checked a chunk at a time: no temporary of a quarter of the part (on a busy
  CPU, first touched, a 200 MB array's whole-array check ran at 0.34 GB/s, the chunked one at 16)."""
  flat = value.reshape(-1)
  return all(np.isfinite(flat[start:start + chunk]).all() for start in range(0, flat.size, chunk))


def _crc32(value: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(value).reshape(-1).view(np.uint8))


class _NonFinite(Exception):
  pass


def _verify(entry: dict, value: np.ndarray):
  want = (entry["dtype"], list(entry["shape"]))
  if (np.dtype(value.dtype).name, list(value.shape)) != want:
    raise _Garbled(f"{entry['name']} reads as {value.dtype}{list(value.shape)}, the manifest says {want}")
  if entry["crc32"] is not None and _crc32(value) != entry["crc32"]:
    raise _Garbled(f"{entry['name']} fails its checksum")


class _Garbled(Exception):
  pass


def read_manifest(directory: epath.Path | str) -> dict:
  path = epath.Path(directory) / "manifest.json"
  if not path.exists():
    raise _Garbled("no manifest.json: not an sljax checkpoint of this format (written before checksums?)")
  manifest = json.loads(path.read_text())
  if manifest.get("format") not in READABLE_FORMATS:
    readable = " and ".join(map(str, READABLE_FORMATS))
    raise _Garbled(f"manifest format {manifest.get('format')}, this sljax reads {readable}")
  return manifest


# ---- the manager ---------------------------------------------------------------------------------------------------


class Checkpointer:
  """Saves every `save_every` steps into `directory` (0: only when forced), keeps the newest `keep`, restores the
  latest.

  Saves are synchronous and streamed (see the module docstring): the state is read part by part while the step
  loop waits, with at most `staging_bytes` of extra host memory; when `save` returns the checkpoint is complete.
  """

  def __init__(self, directory: str, save_every: int, keep: int = 2, staging_bytes: int = STAGING_BYTES):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    if jax.process_index() == 0:
      # A save a killed run left half-written is removed here: the caller holds the workdir (trainer.hold_workdir),
      # so no other run is writing it.
      for path in partial_saves(self.directory):
        shutil.rmtree(path, ignore_errors=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    self.state_handler = StateHandler(staging_bytes)  # its timings say where the last save's or restore's time went
    handlers = {"state": self.state_handler, "meta": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def due(self, step: int) -> bool:
    return bool(self.save_every) and step % self.save_every == 0

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Saves when `step` is due (or `force`: the trainer's saves by time and at the end) and not saved yet; returns
    whether it did. Raises CheckpointWriteError, leaving no partial directory, when the disk fills or a value of
    `state` is not finite."""
    if (not force and not self.due(step)) or step == self.manager.latest_step():
      return False
    args = ocp.args.Composite(state=StateSave(state), meta=ocp.args.JsonSave(meta))
    try:
      return self.manager.save(step, args=args, force=True)
    except Exception as error:  # orbax and tensorstore wrap OS errors in their own types
      self._remove_partial(step)
      raise CheckpointWriteError(self._write_failure(step, state, error)) from None

  def _remove_partial(self, step: int):
    for path in glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")) + [
        os.path.join(self.directory, str(step))]:
      shutil.rmtree(path, ignore_errors=True)
    self.manager.reload()

  def _write_failure(self, step: int, state, error: Exception) -> str:
    newest = self.manager.latest_step()
    kept = "none yet" if newest is None else os.path.join(self.directory, str(newest))
    cause = _innermost(error)
    if isinstance(cause, _NonFinite):
      return (f"step {step}'s training state holds a non-finite value ({cause}): not saved; newest checkpoint "
              f"{kept}")
    free = shutil.disk_usage(self.directory).free
    full = getattr(cause, "errno", None) == errno.ENOSPC or "No space left" in str(cause)
    why = "the disk is full" if full else _first_sentence(cause)
    return (f"saving step {step} to {self.directory} failed: {why} ({free / 1e9:.1f} GB free there, a checkpoint "
            f"takes {saved_bytes(state) / 1e9:.1f} GB); nothing partial was left, newest checkpoint {kept}")

  def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
    """(step, state, meta) of the newest checkpoint, laid out as `abstract_state` says; None when there is none.

    `abstract_state` is a View (an engine's, sljax.checkpoint_layout) or a pytree of `jax.ShapeDtypeStruct` with
    shardings (see `abstract_like`) or of arrays; the arrays are placed into those shardings whatever layout they
    were saved from (an optimizer state's floats cast to the dtype asked for). Raises CheckpointMismatchError when
    the checkpoint holds other arrays (names, shapes, dtypes), CheckpointCorruptError when it cannot be read or a
    checksum fails. A save interrupted mid-write is never the newest: orbax writes into a temporary directory and
    renames it when done.
    """
    step = self.manager.latest_step()
    if step is None:
      return None
    where = os.path.join(self.directory, str(step))
    try:
      stored = read_manifest(os.path.join(where, "state"))
      saved = {entry["name"]: f"{entry['dtype']}{entry['shape']}" for entry in stored["arrays"]}
    except Exception as error:
      raise CheckpointCorruptError(_unreadable(where, error)) from None
    wanted = _arrays(_as_view(abstract_state))
    difference = _first_difference(saved, wanted)
    if difference and stored["format"] == 1 and isinstance(abstract_state, View):
      raise CheckpointMismatchError(FORMAT_1_REFUSED.format(where=where))
    if difference:
      raise CheckpointMismatchError(f"checkpoint {where} holds another training state than this run's: {difference}")
    cast = sorted({f"{saved[name].split('[')[0]} -> {wanted[name].split('[')[0]}" for name in wanted
                   if saved[name] != wanted[name]})
    if cast:
      logging.warning("checkpoint %s: optimizer state cast %s, as this run keeps it", where, ", ".join(cast))
    args = ocp.args.Composite(state=StateRestore(abstract_state), meta=ocp.args.JsonRestore())
    try:
      restored = self.manager.restore(step, args=args)
    except Exception as error:  # tensorstore reports unreadable data as a bare Exception
      raise CheckpointCorruptError(_unreadable(where, error)) from None
    return step, restored.state, dict(restored.meta)

  def close(self):
    self.manager.close()


def saved_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints under `directory` (orbax renames a save to its step when it is whole)."""
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []


def partial_saves(directory: str) -> list[str]:
  """The temporary directories of saves that never completed (a run killed while saving) under `directory`."""
  return glob.glob(os.path.join(directory, "*.orbax-checkpoint-tmp*"))


def check_disk(directory: str, checkpoint_bytes: int, keep: int, saves: int):
  """Raises DiskSpaceError, before anything is written, when the disk under `directory` cannot hold what the run will
  keep there: `min(keep, saves)` checkpoints of `checkpoint_bytes` (each save is written before the oldest is
  deleted, so one more while keeping `keep`), less those already there that will be deleted. What a killed save left
  (partial_saves) counts as free: the Checkpointer removes it before it writes."""
  existing = len(saved_steps(directory))
  at_once = min(keep + 1, existing + saves)
  needed = max(at_once - existing, 0) * checkpoint_bytes
  probe = os.path.abspath(directory)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  free = shutil.disk_usage(probe).free + sum(directory_bytes(path) for path in partial_saves(directory))
  if needed > free:
    raise DiskSpaceError(
        f"checkpoints need {needed / 1e9:.1f} GB free under {directory} ({at_once} of {checkpoint_bytes / 1e9:.1f} "
        f"GB on disk at once: --keep_checkpoints={keep} and one being written"
        + (f", {existing} already there" if existing else "") + f") but {free / 1e9:.1f} GB is free; keep fewer "
        f"(--keep_checkpoints=1), save to a larger disk (--workdir), or train without checkpoints "
        f"(--checkpoint_every=0)")


def directory_bytes(path: str) -> int:
  """The bytes of the files under `path`; a file removed or renamed while it is walked (a save in progress) counts
  nothing."""
  total = 0
  for root, _, names in os.walk(path):
    for name in names:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total


def _innermost(error: BaseException) -> BaseException:
  while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
    error = error.__cause__ or error.__context__
  return error


def _first_sentence(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0].split(". ")[0].rstrip(".:") if text else type(error).__name__


def _unreadable(where: str, error: Exception) -> str:
  return (f"checkpoint {where} cannot be read ({_first_sentence(_innermost(error))}); delete it to resume from the "
          f"one before")


def _castable(name: str, saved: str | None, wanted: str | None) -> bool:
  """Whether an optimizer state's array differs only in its float dtype (a bf16 or fp32 first moment)."""
  if saved is None or wanted is None or not name.startswith(("outer_opt.", "layers_opt.")):
    return False
  (saved_dtype, saved_shape), (wanted_dtype, wanted_shape) = (text.split("[", 1) for text in (saved, wanted))
  floats = all(jnp.issubdtype(jnp.dtype(dtype), jnp.floating) for dtype in (saved_dtype, wanted_dtype))
  return floats and saved_shape == wanted_shape


def _first_difference(saved: dict[str, str], wanted: dict[str, str]) -> str:
  """How many arrays differ and how the first of them does; empty when none does (an optimizer state's floats in
  another float dtype do not: a restore casts them)."""
  differ = sorted(name for name in saved.keys() | wanted.keys()
                  if saved.get(name) != wanted.get(name) and not _castable(name, saved.get(name), wanted.get(name)))
  if not differ:
    return ""
  name = differ[0]
  return (f"{len(differ)} of {len(wanted)} arrays differ, first {name}: {saved.get(name, 'absent')} saved, "
          f"{wanted.get(name, 'absent')} wanted")


# ---- reading without a training state -------------------------------------------------------------------------------


def newest_checkpoint(directory: str) -> tuple[str, dict]:
  """(step directory, meta) of the newest complete checkpoint under `directory`: a run's workdir or its
  checkpoints/. ValueError when there is none."""
  directory = os.path.abspath(directory)
  if os.path.isdir(os.path.join(directory, "checkpoints")):
    directory = os.path.join(directory, "checkpoints")
  steps = [int(name) for name in os.listdir(directory) if name.isdigit()] if os.path.isdir(directory) else []
  if not steps:
    raise ValueError(f"{directory} holds no checkpoint")
  step_dir = os.path.join(directory, str(max(steps)))
  try:
    with open(os.path.join(step_dir, "meta", "metadata")) as f:
      return step_dir, json.load(f)
  except (OSError, ValueError) as error:
    raise CheckpointCorruptError(_unreadable(step_dir, error)) from None


def saved_format(directory: str) -> tuple[str, int, set] | None:
  """(step directory, manifest format, the state's top-level keys) of the newest checkpoint under `directory`; None
  when there is no readable one (the trainer says why it cannot resume from it)."""
  try:
    step_dir = newest_checkpoint(directory)[0]
    manifest = read_manifest(os.path.join(step_dir, "state"))
  except (ValueError, _Garbled, OSError):
    return None
  return step_dir, manifest["format"], {entry["path"][0] for entry in manifest["arrays"]}


def saved_shapes(step_dir: str) -> dict[tuple, list[int]]:
  """{pytree path: shape} of one checkpoint's arrays, from its manifest alone; CheckpointCorruptError (one line) when
  it cannot be read."""
  try:
    return {tuple(entry["path"]): entry["shape"] for entry in read_manifest(os.path.join(step_dir, "state"))["arrays"]}
  except Exception as error:
    raise CheckpointCorruptError(_unreadable(step_dir, error)) from None


def read_arrays(step_dir: str, wanted=lambda path: True) -> dict[tuple, np.ndarray]:
  """{pytree path: numpy array} of one checkpoint's training state (verified), for the paths `wanted` accepts."""
  handler = StateHandler()
  try:
    return handler.read_arrays(epath.Path(step_dir) / "state", wanted)
  except Exception as error:
    raise CheckpointCorruptError(_unreadable(step_dir, error)) from None
  finally:
    handler.close()


class SavedParams:
  """One checkpoint's model params as a reader (models.common.params_reader's contract): `meta`, `num_layers`,
  outer() and layers(start, stop), stacked host numpy arrays as the run saved them, each call reading only the parts
  of the training state that hold what it returns and keeping of each part only that. From read_params."""

  def __init__(self, step_dir: str, meta: dict, num_layers: int, group_layers: list[int] | None,
               per_layer: bool = False):
    self.step_dir, self.meta, self.num_layers = step_dir, meta, num_layers
    # Format 1: None, the device engine's state, {"params": {"outer", "layers"}}; else the offload engine's,
    # {"outer", "groups": [{"master": group g's group_layers[g] layers stacked, ...}, ...]}.
    self._groups = group_layers
    self._per_layer = per_layer  # format 2 (sljax.checkpoint_layout): ("outer", ...), ("layers", i, ...)

  def outer(self) -> dict:
    top = ("outer",) if self._groups or self._per_layer else ("params", "outer")
    return self._read(lambda path: (path[len(top):], 0, slice(None)) if path[:len(top)] == top else None)

  def layers(self, start: int, stop: int) -> dict:
    if not 0 <= start < stop <= self.num_layers:
      raise ValueError(f"layers {start}..{stop} are outside the checkpoint's {self.num_layers}")
    if self._per_layer:  # each layer's arrays, given their layer axis back
      return self._read(lambda path: (path[2:], path[1], np.newaxis) if path[0] == "layers" and start <= path[1] < stop
                        else None)
    if self._groups is None:
      return self._read(lambda path: (path[2:], 0, slice(start, stop)) if path[:2] == ("params", "layers") else None)
    firsts = np.cumsum([0, *self._groups])

    def cut(path):
      if path[0] != "groups" or path[2] != "master" or not start - self._groups[path[1]] < firsts[path[1]] < stop:
        return None
      return path[3:], path[1], slice(max(start - firsts[path[1]], 0), stop - firsts[path[1]])

    return self._read(cut)

  def _read(self, cut) -> dict:
    """The saved arrays that cut(path) -> (leaf path, order, slice along the layers) keeps (None: not read), each
    cut as its part is read, a leaf's pieces joined in their order."""
    pieces, handler = {}, StateHandler()
    try:
      for entry, value in handler._read_parts(epath.Path(self.step_dir) / "state",
                                              lambda entry: cut(tuple(entry["path"])) is not None):
        leaf, order, where = cut(tuple(entry["path"]))
        piece = value[where]
        # A slice of a larger array is copied, so that the array can go; a whole one (or a view adding an axis) is kept.
        pieces.setdefault(leaf, []).append((order, piece if piece.size == value.size else piece.copy()))
    except Exception as error:
      raise CheckpointCorruptError(_unreadable(self.step_dir, error)) from None
    finally:
      handler.close()
    return _nest({leaf: np.concatenate([x for _, x in sorted(parts, key=lambda p: p[0])]) if len(parts) > 1
                  else parts[0][1] for leaf, parts in pieces.items()})


def read_params(directory: str) -> SavedParams:
  """The newest checkpoint's model params under `directory` (a run's workdir or its checkpoints/) as a reader; only
  its metadata and manifest are read here. ValueError (one line) when there is none or it holds no model params."""
  step_dir, meta = newest_checkpoint(directory)
  paths = saved_shapes(step_dir).items()
  per_layer = [path[1] for path, _ in paths if path[0] == "layers"]
  if per_layer:
    return SavedParams(step_dir, meta, max(per_layer) + 1, None, per_layer=True)
  stacked = [shape[0] for path, shape in paths if path[:2] == ("params", "layers")]
  masters = {path[1]: shape[0] for path, shape in paths if path[0] == "groups" and path[2] == "master"}
  if stacked:
    return SavedParams(step_dir, meta, stacked[0], None)
  if masters:
    return SavedParams(step_dir, meta, sum(masters.values()), [masters[g] for g in sorted(masters)])
  tops = sorted({str(path[0]) for path, _ in paths})
  raise ValueError(f"{step_dir} holds no model parameters sljax knows (keys: {', '.join(tops)})")


def restore_params(directory: str) -> dict:
  """Model params of the newest checkpoint under `directory`, without the optimizer state, as host numpy arrays
  {"outer", "layers"} (the layers stacked): of either format and engine (read_params)."""
  reader = read_params(directory)
  return {"outer": reader.outer(), "layers": reader.layers(0, reader.num_layers)}


def _nest(flat: dict[tuple, np.ndarray]) -> dict:
  """{("a", 0, "b"): x} -> {"a": {0: {"b": x}}} (list indices become int keys)."""
  out = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out
