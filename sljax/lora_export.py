"""Writes a LoRA run's fine-tuned model as a Hugging Face directory (config.json, safetensors shards and their index)
that transformers' from_pretrained loads: the newest checkpoint's adapters folded into the kernels of their base.

  python -m sljax.lora_export --checkpoint runs/llama7b-lora --out llama7b-merged
  python -m sljax.lora_export --checkpoint runs/llama7b-lora --hf_dir /data/Llama-2-7b-hf --out llama7b-merged

The base is the one the checkpoint names (--hf_dir: that base, read from there), read, merged and written one shard
of layers at a time (sljax.lora.checkpoint.MergedWeights, models.hf.save_hf_shards), so a model larger than host RAM
exports; in the run's param dtype (--set param_dtype=bfloat16 writes an fp32 run's in bf16, half the bytes).
"""

import dataclasses
import os

import jax.numpy as jnp

from absl import app, logging

from models.config import ModelConfig
from models.hf import save_hf_shards
from models.presets import parse_overrides
from sljax.flags import define
from sljax.lora.checkpoint import MergedWeights, base_weights, open_checkpoint, read_adapters
from sljax.machines import configure_process


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """What to merge and where to write it."""

  checkpoint: str = ""  # a train.py --lora_rank run: its workdir or checkpoints/ (the newest step is read)
  out: str = ""  # the directory to write, new or empty
  hf_dir: str = ""  # the adapters' base, read from here (default: where the checkpoint's metadata says it is)
  overrides: tuple[str, ...] = ()  # override field=value of the run's model config, repeatable
  shard_gib: float = 5.0  # each shard of layers at most about this size (at least one layer)

  def __post_init__(self):
    for name in ("checkpoint", "out"):
      if not getattr(self, name):
        raise ValueError(f"give --{name}")


def export(cfg: ExportConfig) -> ModelConfig:
  """Merges and writes; returns the written model's config. ValueError (one line), before anything is written, when
  the checkpoint, its base or --out will not do."""
  if os.path.exists(cfg.out) and not (os.path.isdir(cfg.out) and not os.listdir(cfg.out)):
    raise ValueError(f"--out {cfg.out} exists and is not an empty directory")
  checkpoint = open_checkpoint(cfg.checkpoint)
  model_cfg = ModelConfig(**{**checkpoint.meta["model_config"], **parse_overrides(cfg.overrides)})
  merged = MergedWeights(base_weights(checkpoint, model_cfg, cfg.hf_dir or None), checkpoint.lora,
                         read_adapters(checkpoint))
  layer_bytes = model_cfg.layer_param_count() * jnp.dtype(model_cfg.param_dtype).itemsize
  save_hf_shards(cfg.out, model_cfg, merged, max(1, int(cfg.shard_gib * 2**30 // layer_bytes)))
  return model_cfg


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
  print(f"wrote {request.out}: {model_cfg.family}, {model_cfg.param_count() / 1e6:.1f} M params, "
        f"{model_cfg.param_dtype}")


if __name__ == "__main__":
  # Defined here, not on import: train.py's --hf_dir and --set would clash with them in a process that has both.
  EXPORT = define(ExportConfig, rename={"overrides": "set"})
  app.run(main)
