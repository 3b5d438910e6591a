"""Writes a train.py run's model as a Hugging Face directory (config.json, safetensors shards and their index) that
transformers' from_pretrained loads. A full run's newest checkpoint gives its params; a LoRA run's gives its
adapters, folded into the kernels of the base they were trained on.

  python -m sljax.export --checkpoint=runs/llama13b --out=llama13b-hf
  python -m sljax.export --checkpoint=runs/llama7b-lora --out=llama7b-merged
  python -m sljax.export --checkpoint=runs/llama7b-lora --hf_dir=/data/Llama-2-7b-hf --out=llama7b-merged

Read and written one shard of layers at a time (sljax.checkpoint.read_params or sljax.lora.checkpoint.MergedWeights,
then models.hf.save_hf_shards), so host memory holds about one shard (--shard_gib) and the outer params whatever the
model's size; in the run's param dtype (--set=param_dtype=bfloat16 writes an fp32 run in bf16, half the bytes). The
files go into a temporary directory beside --out, renamed to it when complete: an export cut short leaves no --out.
Installed (pip install .), `sljax-export` is the same command.
"""

import dataclasses
import os
import shutil
import sys
import tempfile

import jax.numpy as jnp
from absl import logging
from flax import traverse_util
from safetensors import SafetensorError

from models.config import ModelConfig
from models.hf import config_to_hf, save_hf_shards
from models.presets import parse_overrides
from sljax.checkpoint import newest_checkpoint, read_params
from sljax.cli import run_command
from sljax.flags import define
from sljax.lora.checkpoint import MergedWeights, base_weights, open_checkpoint, read_adapters
from sljax.machines import configure_process

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """What to export and where to write it."""

  checkpoint: str = ""  # a train.py run, full or LoRA: its workdir or checkpoints/ (the newest step is read)
  out: str = ""  # the directory to write, new or empty
  hf_dir: str = ""  # a LoRA run's base, read from here (default: where the checkpoint's metadata says it is)
  overrides: tuple[str, ...] = ()  # param_dtype=bfloat16: the dtype written, the one model field an export may change
  shard_gib: float = 5.0  # each shard of layers at most about this size (at least one layer)

  def __post_init__(self):
    for name in ("checkpoint", "out"):
      if not getattr(self, name):
        raise ValueError(f"give --{name}")
    if not self.shard_gib > 0:
      raise ValueError(f"--shard_gib must be positive, got {self.shard_gib}")


class Cast:
  """A reader (outer(), layers(start, stop)) whose arrays come out in `dtype`, each read array let go as its copy is
  made: what is read and its cast are not both in host memory whole."""

  def __init__(self, reader, dtype: str):
    self.reader, self.dtype = reader, jnp.dtype(dtype)

  def _cast(self, tree) -> dict:
    flat = traverse_util.flatten_dict(tree)
    del tree
    for key in flat:
      flat[key] = flat[key].astype(self.dtype, copy=False)
    return traverse_util.unflatten_dict(flat)

  def outer(self) -> dict:
    return self._cast(self.reader.outer())

  def layers(self, start: int, stop: int) -> dict:
    return self._cast(self.reader.layers(start, stop))


def open_run(cfg: ExportConfig) -> tuple[ModelConfig, Cast, str]:
  """The model to write (the run's config, --set applied), a reader of its trained params in that config's param
  dtype, and the dtype they are read in (the run's). Reads the checkpoint's metadata and manifest, and a LoRA run's
  adapters and its base's headers. ValueError (one line) when the checkpoint, its base or --set will not do."""
  step_dir, meta = newest_checkpoint(cfg.checkpoint)
  if "model_config" not in meta:
    raise ValueError(f"checkpoint {step_dir} was not written by train.py: its metadata has no model_config")
  overrides = parse_overrides(cfg.overrides)
  if set(overrides) - {"param_dtype"}:
    field = sorted(set(overrides) - {"param_dtype"})[0]
    raise ValueError(f"--set {field}: an export writes the model the run trained, in another param_dtype at most")
  run_cfg = ModelConfig(**meta["model_config"])
  if meta.get("lora"):
    checkpoint = open_checkpoint(cfg.checkpoint)
    # Merged in the run's param dtype, as the adapters were trained against the base; cast after.
    reader = MergedWeights(base_weights(checkpoint, run_cfg, cfg.hf_dir or None), checkpoint.lora,
                           read_adapters(checkpoint))
  elif cfg.hf_dir:
    raise ValueError(f"--hf_dir names a LoRA run's base; checkpoint {step_dir} is a full run's and holds its weights")
  else:
    reader = read_params(cfg.checkpoint)
    if reader.num_layers != run_cfg.num_layers:
      raise ValueError(f"checkpoint {step_dir} holds {reader.num_layers} layers, its metadata says "
                       f"{run_cfg.num_layers}")
  out_cfg = dataclasses.replace(run_cfg, **overrides)
  return out_cfg, Cast(reader, out_cfg.param_dtype), run_cfg.param_dtype


def check_out(out: str, size: int):
  """ValueError (one line) when the directory `out` is there and not empty, cannot be made, or its disk has not
  `size` bytes free."""
  if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
    raise ValueError(f"--out {out} exists and is not an empty directory")
  existing = os.path.dirname(os.path.abspath(out))
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f"--out {out} cannot be written: {existing} is not a directory")
  free = shutil.disk_usage(existing).free
  if size > free:
    raise ValueError(f"--out {out}: the model takes {_size(size)}, {_size(free)} is free there")


def export(cfg: ExportConfig) -> ModelConfig:
  """Writes the run's model to cfg.out; returns its config. ValueError (one line) before anything is written when the
  checkpoint, --set or --out will not do; when writing fails after all (a disk that fills), ValueError with nothing
  left at --out or beside it."""
  model_cfg, reader, read_dtype = open_run(cfg)
  config_to_hf(model_cfg)  # a model transformers cannot hold is refused here, not after the first shard
  size = model_cfg.param_count() * jnp.dtype(model_cfg.param_dtype).itemsize
  check_out(cfg.out, size)
  # A shard's layers are in host memory as read (the run's param dtype), then as written: the larger bounds it.
  held = max(jnp.dtype(read_dtype).itemsize, jnp.dtype(model_cfg.param_dtype).itemsize)
  layers_per_shard = max(1, int(cfg.shard_gib * GIB // (model_cfg.layer_param_count() * held)))
  out = os.path.abspath(cfg.out)
  try:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".partial", dir=os.path.dirname(out))
  except OSError as error:
    raise ValueError(f"--out {cfg.out} cannot be written: {error.strerror} ({error.filename})") from None
  try:
    save_hf_shards(partial, model_cfg, reader, layers_per_shard)
    # mkdtemp makes the directory 0700 and safetensors its files 0600: as a plain mkdir and open would, instead.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o777 & ~umask)
    for name in os.listdir(partial):
      os.chmod(os.path.join(partial, name), 0o666 & ~umask)
    os.rename(partial, out)  # replaces an empty directory, atomically
  except (OSError, SafetensorError) as error:
    why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    free = shutil.disk_usage(os.path.dirname(out)).free
    raise ValueError(f"writing {cfg.out} failed ({why}; {_size(free)} free there, the model takes {_size(size)}): "
                     f"nothing was left") from None
  finally:
    shutil.rmtree(partial, ignore_errors=True)  # gone already when renamed
  return model_cfg


def _size(nbytes: int) -> str:
  return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"sljax: unexpected arguments {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)  # orbax's INFO lines for every part read
  configure_process()
  try:
    request = EXPORT.build()
    model_cfg = export(request)
  except ValueError as error:
    raise SystemExit(f"sljax: {error}") from None
  print(f"wrote {request.out}: {model_cfg.family}, {model_cfg.num_layers} layers, "
        f"{model_cfg.param_count() / 1e6:.1f} M params, {model_cfg.param_dtype}")


def console():
  """`sljax-export` and `python -m sljax.export`. The flags are defined here, not on import: train.py's --hf_dir and
  --set would clash with them in a process that imports both (a test, a notebook)."""
  global EXPORT
  EXPORT = define(ExportConfig, rename={"overrides": "set"})
  run_command(sys.modules[__name__])


if __name__ == "__main__":
  console()
