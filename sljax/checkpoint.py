"""Orbax checkpoints of a training state (any pytree of jax arrays, device- or host-resident) plus JSON metadata."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath


class CheckpointError(ValueError):
  """The newest checkpoint cannot be restored; the message names its directory and says why in one line."""


class CheckpointMismatchError(CheckpointError):
  """The checkpoint on disk holds a different state (another model, other shapes) than the one asked for."""


class CheckpointCorruptError(CheckpointError):
  """The checkpoint on disk cannot be read: files truncated, missing or garbled."""


def abstract_like(state):
  """The shapes, dtypes and shardings (memory kinds included) of `state`: a restore target that allocates nothing."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


class Checkpointer:
  """Saves every `save_every` steps into `directory`, keeps the newest `keep`, restores the latest.

  Saves are asynchronous: the arrays are copied off before `save` returns and written in the background; `close`
  waits for the last write.
  """

  def __init__(self, directory: str, save_every: int, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Saves when `step` is a multiple of `save_every` (or `force`) and not saved yet; returns whether it did."""
    if (not force and step % self.save_every) or step == self.manager.latest_step():
      return False
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    return self.manager.save(step, args=args, force=True)

  def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
    """(step, state, meta) of the newest checkpoint, laid out as `abstract_state` says; None when there is none.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings (see `abstract_like`) or of arrays; the
    arrays are resharded to it when they were saved from another layout. Raises CheckpointMismatchError when the
    checkpoint holds other arrays (names, shapes, dtypes), CheckpointCorruptError when it cannot be read. A save
    interrupted mid-write is never the newest: orbax writes into a temporary directory and renames it when done.
    """
    self.manager.wait_until_finished()  # a save still being written may be the newest
    step = self.manager.latest_step()
    if step is None:
      return None
    where = os.path.join(self.directory, str(step))
    try:
      stored = self.manager.item_metadata(step).state
      if stored is None:
        raise FileNotFoundError("no array metadata")
    except Exception as error:
      raise CheckpointCorruptError(_unreadable(where, error)) from None
    difference = _first_difference(_arrays(stored), _arrays(abstract_state))
    if difference:
      raise CheckpointMismatchError(f"checkpoint {where} holds another training state than this run's: {difference}")
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
    try:
      restored = self.manager.restore(step, args=args)
    except Exception as error:  # tensorstore reports unreadable data as a bare Exception
      raise CheckpointCorruptError(_unreadable(where, error)) from None
    return step, restored.state, dict(restored.meta)

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def _first_sentence(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0].split(". ")[0].rstrip(".:") if text else type(error).__name__


def _unreadable(where: str, error: Exception) -> str:
  while error.__cause__ is not None:  # the innermost error says what is wrong with which file
    error = error.__cause__
  return f"checkpoint {where} cannot be read ({_first_sentence(error)}); delete it to resume from the one before"


def _arrays(tree) -> dict[str, str]:
  """Each array's dtype[shape] in `tree` (arrays, ShapeDtypeStructs or orbax metadata), by orbax's dotted name."""
  name = lambda key: str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
  return {".".join(map(name, path)): f"{np.dtype(x.dtype).name}{list(x.shape)}"
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _first_difference(saved: dict[str, str], wanted: dict[str, str]) -> str:
  """How many arrays differ and how the first of them does; empty when none does."""
  differ = sorted(name for name in saved.keys() | wanted.keys() if saved.get(name) != wanted.get(name))
  if not differ:
    return ""
  name = differ[0]
  return (f"{len(differ)} of {len(wanted)} arrays differ, first {name}: {saved.get(name, 'absent')} saved, "
          f"{wanted.get(name, 'absent')} wanted")


def newest_checkpoint(directory: str) -> tuple[str, dict]:
  """(step directory, meta) of the newest checkpoint under `directory`: a run's workdir or its checkpoints/."""
  if os.path.isdir(os.path.join(directory, "checkpoints")):
    directory = os.path.join(directory, "checkpoints")
  steps = [int(name) for name in os.listdir(directory) if name.isdigit()] if os.path.isdir(directory) else []
  if not steps:
    raise ValueError(f"{directory} holds no checkpoint")
  step_dir = os.path.join(directory, str(max(steps)))
  with open(os.path.join(step_dir, "meta", "metadata")) as f:
    return step_dir, json.load(f)


def restore_params(directory: str) -> dict:
  """Model params of the newest checkpoint under `directory`, without the optimizer state, as host numpy arrays
  {"outer", "layers"}. Reads both training states: the all-on-device one ({"params", "opt_state"}) and the offload
  engine's ({"outer", "groups": [{"master", ...}, ...]})."""
  state_dir = os.path.join(newest_checkpoint(directory)[0], "state")
  checkpointer = ocp.PyTreeCheckpointer()
  stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree
  if "params" in stored:
    wanted = {"params": stored["params"]}
  elif "groups" in stored:
    wanted = {"outer": stored["outer"], "groups": [{"master": group["master"]} for group in stored["groups"]]}
  else:
    raise ValueError(f"{state_dir} holds no model parameters sljax knows (keys: {', '.join(stored)})")
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
  state = checkpointer.restore(
      state_dir, args=ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args, partial_restore=True))
  if "params" in state:
    return state["params"]
  layers = jax.tree.map(lambda *groups: np.concatenate(groups), *[group["master"] for group in state["groups"]])
  return {"outer": state["outer"], "layers": layers}
