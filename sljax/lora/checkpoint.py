"""A fine-tuning run's checkpoints read back: train.py --lora_rank checkpoints the engine's state with a pointer to
its frozen base (`run_meta`); generate.py --lora_checkpoint and sljax.export read the adapters back
(`open_checkpoint`, `read_adapters`) and merge them into that base one layer group at a time (`MergedWeights`), so
the plain base model runs the fine-tuned one. Loads nothing of training.
"""

import dataclasses
import json
import os
from typing import NamedTuple

import jax
import numpy as np
from flax import traverse_util

from models.common import params_reader
from models.config import ModelConfig
from models.hf import HFWeights
from models.presets import build
from sljax.checkpoint import newest_checkpoint, read_arrays
from sljax.lora.model import LoraConfig, join_adapters, merge


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
  return json.loads(json.dumps({**dataclasses.asdict(lora), "base": base}))


def describe_base(base: dict) -> str:
  return base["hf_dir"] if "hf_dir" in base else f"a random base of seed {base['random_seed']}"


class LoraCheckpoint(NamedTuple):
  """The newest checkpoint of a fine-tuning run, its arrays not read yet."""

  step_dir: str
  meta: dict  # the run's metadata (sljax.launch.train writes it): "model_config", "lora" (run_meta), ...
  lora: LoraConfig
  base: dict  # run_meta's: {"hf_dir": path} or {"random_seed": seed}


def open_checkpoint(directory: str) -> LoraCheckpoint:
  """The newest checkpoint under `directory` (a train.py --lora_rank run's workdir or its checkpoints/); ValueError
  (one line) when there is none or it holds no adapters."""
  step_dir, meta = newest_checkpoint(directory)
  entry = meta.get("lora")
  if not entry or "model_config" not in meta:
    raise ValueError(f"checkpoint {step_dir} holds no LoRA adapters: it was not written by train.py --lora_rank")
  lora = LoraConfig(entry["rank"], entry["alpha"], tuple(entry["targets"]), entry.get("base_bits", 0))
  return LoraCheckpoint(step_dir, meta, lora, entry["base"])


def read_adapters(checkpoint: LoraCheckpoint) -> dict:
  """The checkpoint's adapters stacked over all layers (as LoraModel's params hold them), numpy; nothing else of its
  state (the optimizer's) is read."""
  by_group = {}
  for path, value in read_arrays(checkpoint.step_dir, lambda path: path[0] == "adapters").items():
    by_group.setdefault(path[1], {})[path[2:]] = value
  groups = [traverse_util.unflatten_dict(by_group[g]) for g in sorted(by_group)]
  return jax.tree.map(lambda *xs: np.concatenate(xs), *groups)


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
