"""What a checkpoint holds of each engine's training state, whatever its placement (a sljax.checkpoint.View):

  ("step",)                      updates applied (the offload engine's counter; the device engine's optimizer count)
  ("outer", *leaf)               embeddings + head, fp32 master weights
  ("outer_opt", *leaf)           their optimizer state, per parameter (Adam's mu.embed, nu.embed, ...)
  ("opt_scalars", j, *leaf)      the optimizer's leaves shared by every parameter (Adam's count): one value for all
  ("layers", i, *leaf)           layer i's fp32 master weights, without a leading layer axis
  ("layers_opt", i, *leaf)       layer i's optimizer state, per parameter

Optimizer leaves are named by their path in the optimizer's state without a chain's positions (`mu.attn.q`), so that
an optimizer with clipping chained in front (the device engine's) names them as the one without does (the offload
engine's, which clips itself). Per-parameter leaves are those whose shape changes when the parameters' does
(optimizer.init on 1 and on 2 layers). Arrays are written leaf by leaf, each leaf's layers in order, so that a
restore into any layer grouping completes one leaf of a group after another. Compute copies (a host group's bf16
"weights") are not saved: a restore rebuilds them from the master weights. Any engine, grouping, mesh or memory
placement restores a checkpoint of either engine.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sljax.checkpoint import Saved, View, path_key


def _paths(tree) -> list[tuple[tuple, object]]:
  """(keys, leaf) of each leaf of `tree`, in pytree order."""
  return [(tuple(map(path_key, path)), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _optimizer_name(path) -> tuple:
  """An optimizer state leaf's path without sequence positions (an optax chain's)."""
  return tuple(path_key(entry) for entry in path if not isinstance(entry, jax.tree_util.SequenceKey))


def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def per_parameter(optimizer, params) -> list[bool]:
  """Which leaves of optimizer.init(params) are per parameter (their shape follows the parameters': Adam's moments)
  rather than shared by all (Adam's count)."""
  params = _shapes(params)
  doubled = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), params)
  one, two = (jax.tree.leaves(jax.eval_shape(optimizer.init, tree)) for tree in (params, doubled))
  return [a.shape != b.shape for a, b in zip(one, two)]


class _Layout:
  """Collects a View: leaves by their index in the state's flattened leaves, arrays in the checkpoint's order."""

  def __init__(self, state):
    self.leaves, self.treedef = jax.tree.flatten(state)
    self.at = jax.tree.unflatten(self.treedef, list(range(len(self.leaves))))  # each leaf's index, as a tree
    self.step, self.outer, self.scalars, self.layers = [], [], [], []

  def extra(self, leaf) -> int:
    """A leaf the state does not hold (dropped by `build`)."""
    self.leaves.append(leaf)
    return len(self.leaves) - 1

  def view(self, build) -> View:
    # Leaf by leaf across the groups, each leaf's layers in order: see the module docstring.
    layers = [array for _, _, array in sorted(self.layers, key=lambda item: item[:2])]
    return View(self.leaves, self.step + self.outer + self.scalars + layers, build)


def _opt_names(optimizer, params, indices) -> tuple[list, list]:
  """(per-parameter (name, index), shared (name, index)) of an optimizer state's leaves, by its index tree."""
  named = [(_optimizer_name(path), index) for path, index in jax.tree_util.tree_flatten_with_path(indices)[0]]
  per, shared = [], []
  for item, is_per in zip(named, per_parameter(optimizer, params)):
    (per if is_per else shared).append(item)
  names = [name for name, _ in per]
  if len(set(names)) != len(names):
    raise ValueError(f"the optimizer's state names two per-parameter leaves alike ({names}): sljax cannot save it "
                     f"per layer")
  return per, shared


def offload_view(engine, state, restoring: bool = False) -> View:
  """The View of the offload engine's settled `state` (arrays, to save) or of `engine.abstract_state(key)` (to
  restore into: host groups' compute copies are then rebuilt from their master weights)."""
  layout = _Layout(state)
  at = layout.at
  layout.step.append(Saved(("step",), at["step"]))
  layout.outer += [Saved(("outer", *name), index) for name, index in _paths(at["outer"])]
  per, shared = _opt_names(engine.optimizer, state["outer"], at["outer_opt"])
  layout.outer += [Saved(("outer_opt", *name), index) for name, index in per]
  layout.scalars += [Saved(("opt_scalars", j, *name), index) for j, (name, index) in enumerate(shared)]
  for g, ((start, _), group, held) in enumerate(zip(engine.groups, at["groups"], state["groups"])):
    layers = jax.tree.leaves(held["master"])[0].shape[0]
    names = _paths(group["master"])
    layout.layers += [(k, g, Saved(("layers", start + i, *name), index, i))
                      for k, (name, index) in enumerate(names) for i in range(layers)]
    per, shared = _opt_names(engine.optimizer, held["master"], group["opt"])
    layout.layers += [(len(names) + k, g, Saved(("layers_opt", start + i, *name), index, i))
                      for k, (name, index) in enumerate(per) for i in range(layers)]
    if restoring:  # one saved value for every group's copy of a shared leaf
      layout.scalars += [Saved(("opt_scalars", j, *name), index) for j, (name, index) in enumerate(shared)]

  return layout.view(lambda placed: engine.with_compute_copies(jax.tree.unflatten(layout.treedef, placed)))


def _scalar_sharding(sharding):
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, P(), memory_kind=sharding.memory_kind)
  return sharding


def device_view(optimizer, state, restoring: bool = False) -> View:
  """The View of the all-on-device state {"params": {"outer", "layers"}, "opt_state"} (arrays, to save; or its
  abstract state, to restore into). Its optimizer state is the full model's: a leaf under the params' "outer" key is
  the embeddings' and head's, under "layers" the layers' (stacked on a leading axis), others are shared. It keeps no
  step counter: its optimizer's first shared integer leaf (Adam's count) is saved as the step."""
  layout = _Layout(state)
  at, params = layout.at, state["params"]
  layout.outer += [Saved(("outer", *name), index) for name, index in _paths(at["params"]["outer"])]
  layers = jax.tree.leaves(params["layers"])[0].shape[0]
  for k, (name, index) in enumerate(_paths(at["params"]["layers"])):
    layout.layers += [(k, 0, Saved(("layers", i, *name), index, i)) for i in range(layers)]
  named = [(path, index) for path, index in jax.tree_util.tree_flatten_with_path(at["opt_state"])[0]]
  leaves = [leaf for _, leaf in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]]
  per = per_parameter(optimizer, params)
  shared, order = [], len(jax.tree.leaves(params["layers"]))  # the layers' optimizer leaves after their weights
  for (path, index), is_per, leaf in zip(named, per, leaves):
    name = _optimizer_name(path)
    if not is_per:
      shared.append((name, index, leaf))
      continue
    top = next(i for i, key in enumerate(name) if key in ("outer", "layers"))  # where the params' tree starts
    rest = name[:top] + name[top + 1:]
    if name[top] == "outer":
      layout.outer.append(Saved(("outer_opt", *rest), index))
    else:
      layout.layers += [(order, 0, Saved(("layers_opt", i, *rest), index, i)) for i in range(layers)]
      order += 1
  layout.scalars += [Saved(("opt_scalars", j, *name), index) for j, (name, index, _) in enumerate(shared)]
  counts = [(index, leaf) for _, index, leaf in shared if jnp.issubdtype(leaf.dtype, jnp.integer) and leaf.shape == ()]
  if restoring:  # read into a leaf of its own, dropped
    sharding = _scalar_sharding(jax.tree.leaves(state)[0].sharding)
    layout.step.append(Saved(("step",), layout.extra(jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding))))
  else:
    layout.step.append(Saved(("step",), counts[0][0] if counts else layout.extra(np.zeros((), np.int32))))
  size = len(jax.tree.leaves(state))
  return layout.view(lambda placed: jax.tree.unflatten(layout.treedef, placed[:size]))
