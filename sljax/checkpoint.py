"""Orbax checkpoints of a training state (any pytree of jax arrays, device- or host-resident) plus JSON metadata."""

import os

import jax
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
  """The checkpoint on disk holds a different state (another model, other shapes) than the one asked for."""


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
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Saves when `step` is a multiple of `save_every` (or `force`) and not saved yet; returns whether it did."""
    if (not force and step % self.save_every) or step == self.manager.latest_step():
      return False
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    return self.manager.save(step, args=args, force=True)

  def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
    """(step, state, meta) of the newest checkpoint, laid out as `abstract_state` says; None when there is none.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings (see `abstract_like`) or of arrays.
    """
    step = self.manager.latest_step()
    if step is None:
      return None
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
    try:
      restored = self.manager.restore(step, args=args)
    except (ValueError, KeyError, TypeError) as error:
      raise CheckpointMismatchError(
          f"checkpoint {self.directory} (step {step}) does not match this model's training state: "
          f"{_first_sentence(error)}") from error
    return step, restored.state, dict(restored.meta)

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def _first_sentence(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0].split(". ")[0].rstrip(".:") if text else type(error).__name__
