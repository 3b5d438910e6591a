"""Orbax checkpoints of a training state (any pytree of jax arrays, device- or pinned-host-resident) plus JSON
metadata, streamed through host memory a part at a time.

A step directory is an orbax `CheckpointManager` step with two items:
  meta/      JSON (orbax JsonCheckpointHandler)
  state/     manifest.json: every array's name, pytree path, dtype, shape, part and CRC-32
             part_00000/, part_00001/, ...: orbax PyTree checkpoints of consecutive arrays, each part at most a
             quarter of the staging budget

XLA's pinned host pool already holds the host-resident state, and orbax's own save stages every array through it at
once (about twice the state in host memory). Here each part is copied into ordinary host memory, checked (finite,
CRC-32) and written before the next one is read, so the extra host memory is bounded by `staging_bytes`, never by the
state's size. Restore reads a part, verifies it and places each array straight into its target sharding (memory
kind and mesh included, so a checkpoint restores onto another mesh) before reading the next.
"""

import concurrent.futures
import ctypes
import ctypes.util
import dataclasses
import errno
import glob
import json
import os
import shutil
import zlib
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from sljax.memory import tree_bytes

GIB = 2**30
STAGING_BYTES = 4 * GIB  # extra host memory a save or restore may use
# A part in flight costs more host memory than its bytes: the copy out of device memory, orbax's own copy of what it
# writes, and transfer buffers that the process keeps for the next save. A part is a quarter of the budget. Measured
# on one H200 with 43 GiB of state (benchmarks/results/checkpoint_scale_h200.json): 1 GiB parts peaked at 5.2 GiB
# above the level before the save (3.4 GiB of it still held after the save, and reused by the next) and 2.1 GiB
# during a restore; with 2 GiB parts 7.3 GiB (checkpoint_scale_2gib_parts_h200.json, state 46 GiB).
PARTS_PER_BUDGET = 4
FORMAT = 1  # manifest version


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


# ---- the streamed state item ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class StateSave(ocp.args.CheckpointArgs):
  state: Any


@dataclasses.dataclass
class StateRestore(ocp.args.CheckpointArgs):
  target: Any  # arrays or ShapeDtypeStructs with shardings


class StateHandler(ocp.CheckpointHandler):
  """Saves and restores a pytree of jax arrays part by part within `staging_bytes` of extra host memory."""

  def __init__(self, staging_bytes: int = STAGING_BYTES):
    self.part_bytes = max(staging_bytes // PARTS_PER_BUDGET, 1)
    self._parts = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))  # float state barely shrinks

  def save(self, directory: epath.Path, args: StateSave):
    names, paths, leaves = _flatten(args.state)
    arrays, files = [], {}
    for index, part in enumerate(_split(leaves, self.part_bytes)):
      staged = _stage([names[i] for i in part], [leaves[i] for i in part])
      self._write_part(directory, index, [x for x, _ in staged])
      files.update(_file_sizes(directory, _part_name(index)))
      arrays += [{"name": names[i], "path": paths[i], "dtype": np.dtype(leaves[i].dtype).name,
                  "shape": list(leaves[i].shape), "part": index, "crc32": crc}
                 for i, (_, crc) in zip(part, staged)]
      del staged  # freed before the next part is read
      _return_freed_memory()
    if jax.process_index() == 0:
      (directory / "manifest.json").write_text(json.dumps({"format": FORMAT, "arrays": arrays, "files": files}))

  def _write_part(self, directory: epath.Path, index: int, arrays: list):
    self._parts.save(directory / _part_name(index), args=ocp.args.PyTreeSave(arrays))

  def restore(self, directory: epath.Path, args: StateRestore):
    names, _, leaves = _flatten(args.target)
    targets, placed = dict(zip(names, leaves)), {}
    for entry, value in self._read_parts(directory):
      target = targets[entry["name"]]
      placed[entry["name"]] = jax.make_array_from_callback(
          tuple(target.shape), target.sharding, lambda where, value=value: value[where])
    return jax.tree.unflatten(jax.tree.structure(args.target), [placed[name] for name in names])

  def read_arrays(self, directory: epath.Path, wanted=lambda path: True) -> dict[tuple, np.ndarray]:
    """{path: numpy array} of the saved arrays whose path `wanted` accepts, verified; host memory for them only."""
    return {tuple(entry["path"]): value
            for entry, value in self._read_parts(directory, lambda entry: wanted(tuple(entry["path"])))}

  def _read_parts(self, directory: epath.Path, wanted=lambda entry: True):
    """(manifest entry, verified numpy array) of each saved array `wanted` accepts, reading one part at a time and
    skipping the parts that hold none of them."""
    manifest = read_manifest(directory)
    for index in sorted({entry["part"] for entry in manifest["arrays"]}):
      entries = [entry for entry in manifest["arrays"] if entry["part"] == index]
      if not any(map(wanted, entries)):
        continue
      part = _part_name(index)
      # A file cut short or missing is found here, before orbax starts reading: orbax gives up on the first array it
      # cannot read while tensorstore still reads the others, whose completions then print tracebacks.
      _check_files(directory, part, manifest["files"])
      as_numpy = [ocp.RestoreArgs(restore_type=np.ndarray)] * len(entries)
      values = self._parts.restore(directory / part,
                                   args=ocp.args.PyTreeRestore(item=[0] * len(entries), restore_args=as_numpy))
      for entry, value in zip(entries, values):
        if wanted(entry):
          _verify(entry, value)
          yield entry, value
      del values, value
      _return_freed_memory()

  def metadata(self, directory: epath.Path):
    return read_manifest(directory)

  def close(self):
    self._parts.close()


ocp.args.register_with_handler(StateHandler, for_save=True)(StateSave)
ocp.args.register_with_handler(StateHandler, for_restore=True)(StateRestore)


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


def _key(entry) -> str | int:
  for attribute in ("key", "idx", "name"):
    if hasattr(entry, attribute):
      return getattr(entry, attribute)
  return str(entry)


def _flatten(tree) -> tuple[list[str], list[list], list]:
  """(dotted names, paths as lists of keys, leaves) in pytree order."""
  with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = [[_key(entry) for entry in path] for path, _ in with_paths]
  return [".".join(map(str, path)) for path in paths], paths, [leaf for _, leaf in with_paths]


def _split(leaves: list, part_bytes: int) -> list[list[int]]:
  """Consecutive leaf indices, each run at most `part_bytes` (a larger leaf is a part of its own)."""
  parts, current, size = [], [], 0
  for i, x in enumerate(leaves):
    nbytes = tree_bytes(x)
    if current and size + nbytes > part_bytes:
      parts.append(current)
      current, size = [], 0
    current.append(i)
    size += nbytes
  return parts + [current] if current else parts


def _crc32(value: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(value).reshape(-1).view(np.uint8))


def _stage(names: list[str], leaves: list) -> list[tuple[Any, int | None]]:
  """Each leaf copied into ordinary host memory with its CRC-32, after checking that it is finite. A leaf that this
  process cannot see whole (several hosts) goes to orbax as it is, one part at a time, without a checksum."""

  def one(name, x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x, None
    # jax keeps the host copy of a device array on the array it was read from (on the H200 a save left the
    # device-resident state's size in host memory, benchmarks/results/checkpoint_scale_cached_host_copies_h200.json:
    # 14.2 GiB above the level before the save): read a device array through a fresh copy of it on the device,
    # which takes the cached host copy with it when dropped. Pinned-host arrays are read in place.
    if x.sharding.memory_kind == "device":
      x = jax.device_put(x, x.sharding, may_alias=False)
    value = np.asarray(x)
    if np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
      raise _NonFinite(name)
    return value, _crc32(value)

  with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(leaves), os.cpu_count() or 1)) as pool:
    return list(pool.map(one, names, leaves))  # copies, checks and checksums release the GIL


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
  if manifest.get("format") != FORMAT:
    raise _Garbled(f"manifest format {manifest.get('format')}, this sljax reads {FORMAT}")
  return manifest


# ---- the manager ---------------------------------------------------------------------------------------------------


class Checkpointer:
  """Saves every `save_every` steps into `directory` (0: never), keeps the newest `keep`, restores the latest.

  Saves are synchronous and streamed (see the module docstring): the state is read part by part while the step
  loop waits, with at most `staging_bytes` of extra host memory; when `save` returns the checkpoint is complete.
  """

  def __init__(self, directory: str, save_every: int, keep: int = 2, staging_bytes: int = STAGING_BYTES):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    handlers = {"state": StateHandler(staging_bytes), "meta": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def due(self, step: int) -> bool:
    return bool(self.save_every) and step % self.save_every == 0

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Saves when `step` is due (or `force`, unless saving is off) and not saved yet; returns whether it did. Raises CheckpointWriteError,
    leaving no partial directory, when the disk fills or a value of `state` is not finite."""
    if not self.save_every or (not force and not self.due(step)) or step == self.manager.latest_step():
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
            f"takes {tree_bytes(state) / 1e9:.1f} GB); nothing partial was left, newest checkpoint {kept}")

  def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
    """(step, state, meta) of the newest checkpoint, laid out as `abstract_state` says; None when there is none.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings (see `abstract_like`) or of arrays; the
    arrays are placed into those shardings whatever layout they were saved from. Raises CheckpointMismatchError when
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
    difference = _first_difference(saved, _arrays(abstract_state))
    if difference:
      raise CheckpointMismatchError(f"checkpoint {where} holds another training state than this run's: {difference}")
    args = ocp.args.Composite(state=StateRestore(abstract_state), meta=ocp.args.JsonRestore())
    try:
      restored = self.manager.restore(step, args=args)
    except Exception as error:  # tensorstore reports unreadable data as a bare Exception
      raise CheckpointCorruptError(_unreadable(where, error)) from None
    return step, restored.state, dict(restored.meta)

  def close(self):
    self.manager.close()


def check_disk(directory: str, checkpoint_bytes: int, keep: int, saves: int):
  """Raises DiskSpaceError, before anything is written, when the disk under `directory` cannot hold what the run will
  keep there: `min(keep, saves)` checkpoints of `checkpoint_bytes` (each save is written before the oldest is
  deleted, so one more while keeping `keep`), less those already there that will be deleted."""
  existing = len([name for name in os.listdir(directory) if name.isdigit()]) if os.path.isdir(directory) else 0
  at_once = min(keep + 1, existing + saves)
  needed = max(at_once - existing, 0) * checkpoint_bytes
  probe = os.path.abspath(directory)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  free = shutil.disk_usage(probe).free
  if needed > free:
    raise DiskSpaceError(
        f"checkpoints need {needed / 1e9:.1f} GB free under {directory} ({at_once} of {checkpoint_bytes / 1e9:.1f} "
        f"GB on disk at once: --keep_checkpoints={keep} and one being written"
        + (f", {existing} already there" if existing else "") + f") but {free / 1e9:.1f} GB is free; keep fewer "
        f"(--keep_checkpoints=1), save to a larger disk (--workdir), or train without checkpoints "
        f"(--checkpoint_every=0)")


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


def _arrays(tree) -> dict[str, str]:
  """Each array's dtype[shape] in `tree` (arrays or ShapeDtypeStructs), by dotted name."""
  names, _, leaves = _flatten(tree)
  return {name: f"{np.dtype(x.dtype).name}{list(x.shape)}" for name, x in zip(names, leaves)}


def _first_difference(saved: dict[str, str], wanted: dict[str, str]) -> str:
  """How many arrays differ and how the first of them does; empty when none does."""
  differ = sorted(name for name in saved.keys() | wanted.keys() if saved.get(name) != wanted.get(name))
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


class SavedGroups(NamedTuple):
  """The layer groups of an offload engine's checkpoint, from its manifest."""

  step_dir: str
  layers: list[int]  # per group: its stacked master weights' leading axis
  host: list[bool]  # per group: holds a compute copy ("weights"), as a group whose state lives in host memory does


def saved_groups(directory: str) -> SavedGroups | None:
  """The newest checkpoint's layer groups under `directory` when it holds the offload engine's state; None when
  there is no readable one."""
  try:
    step_dir = newest_checkpoint(directory)[0]
    arrays = read_manifest(os.path.join(step_dir, "state"))["arrays"]
  except (ValueError, _Garbled, OSError):
    return None  # the trainer says why it cannot resume from it
  groups = [entry for entry in arrays if entry["path"][0] == "groups"]
  layers = {entry["path"][1]: entry["shape"][0] for entry in groups if entry["path"][2] == "master"}
  copies = {entry["path"][1] for entry in groups if entry["path"][2] == "weights"}
  return SavedGroups(step_dir, [layers[g] for g in sorted(layers)], [g in copies for g in sorted(layers)]) if (
      layers) else None


def read_arrays(step_dir: str, wanted=lambda path: True) -> dict[tuple, np.ndarray]:
  """{pytree path: numpy array} of one checkpoint's training state (verified), for the paths `wanted` accepts."""
  handler = StateHandler()
  try:
    return handler.read_arrays(epath.Path(step_dir) / "state", wanted)
  except Exception as error:
    raise CheckpointCorruptError(_unreadable(step_dir, error)) from None
  finally:
    handler.close()


def restore_params(directory: str) -> dict:
  """Model params of the newest checkpoint under `directory`, without the optimizer state, as host numpy arrays
  {"outer", "layers"}. Reads both training states: the all-on-device one ({"params", "opt_state"}) and the offload
  engine's ({"outer", "groups": [{"master", ...}, ...]})."""
  step_dir = newest_checkpoint(directory)[0]
  try:
    tops = {entry["path"][0] for entry in read_manifest(os.path.join(step_dir, "state"))["arrays"]}
  except Exception as error:
    raise CheckpointCorruptError(_unreadable(step_dir, error)) from None
  if "params" in tops:
    return _nest(read_arrays(step_dir, lambda path: path[0] == "params"))["params"]
  if "groups" not in tops:
    raise ValueError(f"{step_dir} holds no model parameters sljax knows (keys: {', '.join(map(str, sorted(tops)))})")
  arrays = _nest(read_arrays(step_dir, lambda path: path[0] == "outer" or path[2:3] == ("master",)))
  groups = [arrays["groups"][g]["master"] for g in sorted(arrays["groups"])]
  return {"outer": arrays["outer"], "layers": jax.tree.map(lambda *parts: np.concatenate(parts), *groups)}


def _nest(flat: dict[tuple, np.ndarray]) -> dict:
  """{("a", 0, "b"): x} -> {"a": {0: {"b": x}}} (list indices become int keys)."""
  out = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out
