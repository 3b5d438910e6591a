"""A fine-tuning run's checkpoints read back: train.py --lora_rank checkpoints the engine's state with a pointer to
its frozen base (`run_meta`); generate.py --lora_checkpoint and sljax.export read the adapters back
(`open_checkpoint`, `read_adapters`) and merge them into that base one layer group at a time (`MergedWeights`), so
the plain base model runs the fine-tuned one; a resume restores a checkpoint of either adapter layout into the
engine's state (`restore_view`). Loads nothing of training.

The adapters' layout (the metadata's lora.format, FORMAT):
  2  ("adapters", *leaf): each adapter leaf stacked over all layers, as LoraModel's params and the engine's state
     hold it; its optimizer state's per-parameter leaves alike ("opt", ..., *leaf)
  1  (no lora.format) ("adapters", g, *leaf), ("opt", ..., g, *leaf): a list of layer groups, each leaf stacked over
     its group's layers, as the engine once held them; read by joining the groups, so it resumes under any grouping
"""

import dataclasses
import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from models.common import params_reader
from models.config import ModelConfig
from models.hf import HFWeights
from models.presets import build
from sljax.checkpoint import (CheckpointMismatchError, Saved, View, newest_checkpoint, path_key, read_arrays,
                              saved_shapes)
from sljax.lora.model import LoraConfig, join_adapters, merge

FORMAT = 2
READABLE_FORMATS = (1, 2)


def random_base_key(seed: int) -> jax.Array:
  """The key of a run's random base (`LoraEngine.init_base`) when the run is seeded `seed` (its adapters start from
  jax.random.key(seed), as every run's init does)."""
  return jax.random.fold_in(jax.random.key(seed), 1)


def run_meta(lora: LoraConfig, hf_dir: str, seed: int) -> dict:
  """What a fine-tuning run's checkpoints say of their adapters and of the frozen base they belong to, which is not
  saved: the LoRA config (base_bits: the base the adapters trained on was quantized; they merge into the unquantized
  one), and the base's Hugging Face directory (absolute) or the seed of a random base. JSON, as a checkpoint's
  metadata reads back."""
  base = {"hf_dir": os.path.abspath(hf_dir)} if hf_dir else {"random_seed": seed}
  return json.loads(json.dumps({**dataclasses.asdict(lora), "base": base, "format": FORMAT}))


def adapters_format(step_dir: str, entry: dict) -> int:
  """The adapters' layout of a checkpoint whose metadata's "lora" is `entry` (run_meta's); ValueError (one line)
  when this sljax does not read it."""
  saved = entry.get("format", 1)  # written before the format was recorded
  if saved not in READABLE_FORMATS:
    raise ValueError(f"checkpoint {step_dir} holds LoRA adapters in layout {saved!r} (its metadata's lora.format), "
                     f"which this sljax does not read (it reads {' and '.join(map(str, READABLE_FORMATS))}): read it "
                     f"with the sljax that wrote it, or train afresh in another --workdir")
  return saved


def describe_base(base: dict) -> str:
  return base["hf_dir"] if "hf_dir" in base else f"a random base of seed {base['random_seed']}"


class LoraCheckpoint(NamedTuple):
  """The newest checkpoint of a fine-tuning run, its arrays not read yet."""

  step_dir: str
  meta: dict  # the run's metadata (sljax.launch.train writes it): "model_config", "lora" (run_meta), ...
  lora: LoraConfig
  base: dict  # run_meta's: {"hf_dir": path} or {"random_seed": seed}
  format: int  # the adapters' layout (FORMAT)


def open_checkpoint(directory: str) -> LoraCheckpoint:
  """The newest checkpoint under `directory` (a train.py --lora_rank run's workdir or its checkpoints/); ValueError
  (one line) when there is none or it holds no adapters."""
  step_dir, meta = newest_checkpoint(directory)
  entry = meta.get("lora")
  if not entry or "model_config" not in meta:
    raise ValueError(f"checkpoint {step_dir} holds no LoRA adapters: it was not written by train.py --lora_rank")
  lora = LoraConfig(entry["rank"], entry["alpha"], tuple(entry["targets"]), entry.get("base_bits", 0))
  return LoraCheckpoint(step_dir, meta, lora, entry["base"], adapters_format(step_dir, entry))


def read_adapters(checkpoint: LoraCheckpoint) -> dict:
  """The checkpoint's adapters stacked over all layers (as LoraModel's params hold them), numpy, of either layout;
  nothing else of its state (the optimizer's) is read."""
  arrays = read_arrays(checkpoint.step_dir, lambda path: path[0] == "adapters")
  if checkpoint.format == FORMAT:
    return traverse_util.unflatten_dict({path[1:]: value for path, value in arrays.items()})
  by_group = {}
  for path, value in arrays.items():
    by_group.setdefault(path[1], {})[path[2:]] = value
  groups = [traverse_util.unflatten_dict(by_group[g]) for g in sorted(by_group)]
  return jax.tree.map(lambda *xs: np.concatenate(xs), *groups)


def restore_view(directory: str, state) -> View | None:
  """What restores the newest checkpoint under `directory` into the engine's state, given as `state` (shapes and
  shardings, LoraEngine.abstract): None (the state as it is) for one in FORMAT or where there is none; for a format-1
  one, `groups_view` of its layer groups. ValueError (one line) when its layout is unknown or its groups do not cover
  the state's layers."""
  try:
    step_dir, meta = newest_checkpoint(directory)
  except ValueError:
    return None  # none, or unreadable: the restore says which
  if "lora" not in meta or adapters_format(step_dir, meta["lora"]) == FORMAT:
    return None
  layers = {path[1]: shape[0] for path, shape in saved_shapes(step_dir).items()
            if path[0] == "adapters" and isinstance(path[1], int)}
  group_layers = [layers[g] for g in sorted(layers)]
  expected = jax.tree.leaves(state["adapters"])[0].shape[0]
  if sum(group_layers) != expected:
    raise CheckpointMismatchError(f"checkpoint {step_dir} holds LoRA adapters in layer groups (layout 1) of "
                                  f"{sum(group_layers)} layers in all, and this run's model has {expected}")
  return groups_view(state, group_layers)


def groups_view(state, group_layers: list[int]) -> View:
  """A restore of a format-1 checkpoint, whose adapters and their optimizer state's per-parameter leaves are a list
  of layer groups of `group_layers` layers, into the stacked `state` (shapes and shardings): each group's arrays
  placed as saved, then each stacked leaf joined from its groups on the device."""
  flat = [(tuple(map(path_key, path)), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]
  adapters = [path[1:] for path, _ in flat if path[0] == "adapters"]
  leaves, arrays, sources = [], [], []  # sources: the indices in `leaves` each stacked leaf is joined from
  for path, leaf in flat:
    # Where the adapter's own path starts: the group index went there (a list of groups in place of the tree).
    at = min((k for adapter in adapters for k in range(len(path) - len(adapter) + 1)
              if path[k:k + len(adapter)] == adapter), default=None)
    if at is None:  # the step, an optimizer leaf shared by all adapters (Adam's count)
      parts = [(path, leaf)]
    else:
      parts = [((*path[:at], g, *path[at:]), jax.ShapeDtypeStruct((n, *leaf.shape[1:]), leaf.dtype,
                                                                   sharding=leaf.sharding))
               for g, n in enumerate(group_layers)]
    sources.append((at is not None, list(range(len(leaves), len(leaves) + len(parts)))))
    for part_path, part in parts:
      arrays.append(Saved(part_path, len(leaves)))
      leaves.append(part)
  join = jax.jit(lambda parts: [jnp.concatenate(p) if stacked else p[0] for (stacked, _), p in zip(sources, parts)],
                 out_shardings=[leaf.sharding for _, leaf in flat])
  treedef = jax.tree.structure(state)
  build = lambda placed: jax.tree.unflatten(treedef, join([[placed[i] for i in indices] for _, indices in sources]))
  return View(leaves, arrays, build)


class RandomBase:
  """The random base `LoraEngine.init_base(key)` makes, as a reader of the base model's params: outer() and
  layers(start, stop), numpy in the model's param dtype, made when read."""

  def __init__(self, model, key: jax.Array):
    outer_key, layers_key = jax.random.split(key)
    self.outer_key, self.layer_keys = outer_key, jax.random.split(layers_key, model.cfg.num_layers)
    self.init_outer, self.init_layers = jax.jit(model.init_outer), jax.jit(model.init_layers)

  def outer(self) -> dict:
    return jax.tree.map(np.asarray, self.init_outer(self.outer_key))

  def layers(self, start: int, stop: int) -> dict:
    return jax.tree.map(np.asarray, self.init_layers(self.layer_keys[start:stop]))


class MergedWeights:
  """A reader of the base model's params (`base`: params or a reader, e.g. models.hf.HFWeights) with `adapters`
  (stacked over all layers) folded into its kernels by `merge`, one group at a time as layers(start, stop) reads it:
  the plain base model then computes the fine-tuned one, at no cost per token."""

  def __init__(self, base, lora: LoraConfig, adapters: dict):
    self.base, self.lora, self.adapters = params_reader(base), lora, adapters

  def outer(self) -> dict:
    return self.base.outer()

  def layers(self, start: int, stop: int) -> dict:
    adapters = jax.tree.map(lambda x: x[start:stop], self.adapters)
    return jax.tree.map(np.asarray, merge(self.lora, join_adapters(self.base.layers(start, stop), adapters)))


def base_weights(checkpoint: LoraCheckpoint, cfg: ModelConfig, hf_dir: str | None = None):
  """A reader of the base the checkpoint's adapters were trained on, as `cfg` (the run's model config, its dtypes
  perhaps changed) describes it: the Hugging Face directory its metadata names (`hf_dir`: a copy of that base
  elsewhere), else the run's random base. ValueError (one line) when the directory is not there or holds another
  model."""
  where = hf_dir or checkpoint.base.get("hf_dir")
  if not where:
    return RandomBase(build(cfg), random_base_key(checkpoint.base["random_seed"]))
  try:
    return HFWeights(where, **dataclasses.asdict(cfg))  # every field the run's: its shapes are checked on the files
  except ValueError as error:
    base = f"the base of {checkpoint.step_dir}'s adapters"
    raise ValueError(f"{error}: --hf_dir must hold {base}" if hf_dir else
                     f"{error}: {base}, where its metadata says (--hf_dir: where it is now, if it moved)") from None
