"""Named models with their published shapes, and `build` to turn a name plus overrides into a model."""

import dataclasses

from models.config import ModelConfig
from models.llama import Llama
from models.opt import OPT


def _llama(hidden, ffn, layers, heads, kv_heads):
  return ModelConfig(
      family="llama", vocab_size=32000, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
      num_heads=heads, num_kv_heads=kv_heads, max_positions=4096, norm_eps=1e-5)


def _opt(hidden, layers, heads, **extra):
  return ModelConfig(
      family="opt", vocab_size=50272, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
      num_heads=heads, num_kv_heads=heads, max_positions=2048, **extra)


PRESETS: dict[str, ModelConfig] = {
    # CPU-sized: byte-level vocabulary, grouped-query attention, trains in minutes on two cores.
    "llama-tiny": ModelConfig(
        family="llama", vocab_size=256, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4,
        num_kv_heads=2, max_positions=512),
    "llama7b": _llama(4096, 11008, 32, 32, 32),
    "llama13b": _llama(5120, 13824, 40, 40, 40),
    "llama70b": _llama(8192, 28672, 80, 64, 8),
    "opt-125m": _opt(768, 12, 12),
    "opt-350m": _opt(1024, 24, 16, word_embed_proj_dim=512, layer_norm_before=False),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
    "opt-175b": _opt(12288, 96, 96),
}

FAMILIES = {"llama": Llama, "opt": OPT}


def parse_overrides(pairs: list[str]) -> dict:
  """["num_layers=8", "dtype=float32"] -> typed dict; unknown fields and bad values raise ValueError."""
  fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
  out = {}
  for pair in pairs:
    name, sep, text = pair.partition("=")
    if not sep:
      raise ValueError(f"override {pair!r} is not of the form field=value")
    if name not in fields:
      raise ValueError(f"unknown model field {name!r}; fields are: {', '.join(fields)}")
    kind = type(getattr(ModelConfig(), name))
    if kind is bool:
      if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"override {name} wants true or false, got {text!r}")
      out[name] = text.lower() in ("true", "1")
    else:
      try:
        out[name] = kind(text)
      except ValueError:
        raise ValueError(f"override {name} wants a {kind.__name__}, got {text!r}") from None
  return out


def get_config(name: str, overrides: list[str] | dict = ()) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model {name!r}; presets are: {', '.join(PRESETS)}")
  if not isinstance(overrides, dict):
    overrides = parse_overrides(list(overrides))
  unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
  if unknown:
    raise ValueError(f"unknown model field(s) {', '.join(sorted(unknown))}")
  return dataclasses.replace(PRESETS[name], **overrides)


def build(cfg: ModelConfig):
  return FAMILIES[cfg.family](cfg)
