"""Hugging Face checkpoints: `load_hf` reads a transformers LLaMA/OPT directory, `save_hf` writes one back.

Names map mechanically: our module `q_proj` in layer i is `model.layers.{i}.self_attn.q_proj` (LLaMA) or
`model.decoder.layers.{i}.self_attn.q_proj` (OPT); Dense kernels are the transposed torch Linear weights.
"""

import glob
import json
import os

import jax
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.common import Params
from models.config import ModelConfig
from models.presets import build

# Config values our models hard-code; a checkpoint that says otherwise would load but compute something else.
_FIXED = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "opt": {
        "activation_function": "relu", "enable_bias": True, "layer_norm_elementwise_affine": True,
        "_remove_final_layer_norm": False, "tie_word_embeddings": True},
}
_OPT_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which Hugging Face OPT uses
_SUBMODULE = {
    "q_proj": "self_attn.", "k_proj": "self_attn.", "v_proj": "self_attn.", "o_proj": "self_attn.",
    "out_proj": "self_attn.", "gate_proj": "mlp.", "up_proj": "mlp.", "down_proj": "mlp."}
_LEAF = {"kernel": "weight", "embedding": "weight", "scale": "weight", "weight": "weight", "bias": "bias"}


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
  """A transformers config.json (as a dict) -> ModelConfig; `overrides` (e.g. dtype="float32") win."""
  model_type = hf.get("model_type")
  if model_type not in _FIXED:
    raise ValueError(f"unsupported model_type {model_type!r}; sljax loads 'llama' and 'opt'")
  for key, want in _FIXED[model_type].items():
    if hf.get(key, want) != want:
      raise ValueError(f"unsupported {model_type} config {key}={hf[key]!r}; sljax supports only {want!r}")
  shared = dict(
      family=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
      max_positions=hf["max_position_embeddings"])
  if model_type == "llama":
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 / 4
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"unsupported llama rope_type {rope_type!r}; sljax supports only 'default'")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
      raise ValueError(f"unsupported llama head_dim {head_dim}; sljax needs hidden_size / num_attention_heads")
    fields = dict(
        intermediate_size=hf["intermediate_size"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  else:
    embed_dim = hf.get("word_embed_proj_dim") or hf["hidden_size"]
    fields = dict(
        intermediate_size=hf["ffn_dim"], num_kv_heads=hf["num_attention_heads"], norm_eps=_OPT_NORM_EPS,
        word_embed_proj_dim=0 if embed_dim == hf["hidden_size"] else embed_dim,
        layer_norm_before=hf.get("do_layer_norm_before", True))
  return ModelConfig(**{**shared, **fields, **overrides})


def config_to_hf(cfg: ModelConfig) -> dict:
  """ModelConfig -> a transformers config.json dict (LlamaForCausalLM or OPTForCausalLM)."""
  shared = dict(
      model_type=cfg.family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      max_position_embeddings=cfg.max_positions, dtype=cfg.param_dtype, **_FIXED[cfg.family])
  if cfg.family == "llama":
    # Top-level rope_theta (not transformers 5's rope_parameters) so that transformers 4 reads it too.
    return dict(
        architectures=["LlamaForCausalLM"], intermediate_size=cfg.intermediate_size,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False, **shared)
  if cfg.norm_eps != _OPT_NORM_EPS:
    raise ValueError(f"Hugging Face OPT fixes the LayerNorm eps at {_OPT_NORM_EPS}; this model has {cfg.norm_eps}")
  return dict(
      architectures=["OPTForCausalLM"], ffn_dim=cfg.intermediate_size, word_embed_proj_dim=cfg.embed_dim,
      do_layer_norm_before=cfg.layer_norm_before, **shared)


def _hf_name(family: str, module: str, leaf: str, layer: int | None = None) -> str:
  """Our (module, leaf) in the outer params (layer None) or in layer `layer` -> the Hugging Face tensor name."""
  model = "model." if family == "llama" else "model.decoder."
  if layer is None:
    path = "lm_head" if module == "lm_head" else model + module
  else:
    path = f"{model}layers.{layer}.{_SUBMODULE.get(module, '')}{module}"
  return f"{path}.{_LEAF[leaf]}"


class HFWeights:
  """A Hugging Face LLaMA/OPT directory (config.json + *.safetensors, one file or shards), read lazily: the
  constructor reads the config and every file's header and checks that every tensor the config needs is there, in
  the shape it implies, and that no file is truncated; `outer()` and `layers(start, stop)` read only the tensors
  they return. A model larger than host RAM can so be placed one layer group at a time
  (sljax.generate.OffloadedGenerator.load), and a damaged file is refused before anything is allocated."""

  def __init__(self, path: str, **overrides):
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
      raise ValueError(f"{path} is not a Hugging Face model directory: it has no config.json")
    hf = _read_json(config_path)
    self.path, self.cfg = path, config_from_hf(hf, **overrides)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
      raise ValueError(f"{path} has no *.safetensors files (re-save .bin checkpoints with save_pretrained)")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
      shards = set(_read_json(index_path).get("weight_map", {}).values())
      absent = sorted(shards - {os.path.basename(file) for file in files})
      if absent:
        raise ValueError(f"{path} lacks {len(absent)} of the {len(shards)} files its index names: "
                         f"{', '.join(absent[:4])}")
    self._stored = {}  # tensor name -> (file, name inside it)
    shapes = {}  # tensor name -> shape, from the headers
    for file in files:
      # safe_open checks the header against the file: every tensor's offsets in range, its bytes its shape's and
      # dtype's, the data exactly covering the rest of the file (so a truncated file is refused here).
      try:
        with safe_open(file, framework="np") as f:
          in_file = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
      except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is not a readable safetensors file, or is truncated ({error})") from None
      shapes.update(in_file)
      self._stored.update({name: (file, name) for name in in_file})
    if hf.get("tie_word_embeddings") and "lm_head.weight" not in self._stored and "model.embed_tokens.weight" in shapes:
      self._stored["lm_head.weight"] = self._stored["model.embed_tokens.weight"]  # tied head: an untied copy
      shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    self._shapes = traverse_util.flatten_dict(jax.eval_shape(build(self.cfg).init, jax.random.key(0)))
    needed = [(key, i) for key in self._shapes for i in ([None] if key[0] == "outer" else range(self.cfg.num_layers))]
    missing = [self._name(key, i) for key, i in needed if self._name(key, i) not in self._stored]
    if missing:
      raise ValueError(f"{path} lacks {len(missing)} tensors that the config needs: {', '.join(missing[:4])}")
    for key, i in needed:
      want = self._shapes[key].shape[0 if i is None else 1:]  # a layer's, without the stacking axis
      want = want[::-1] if key[-1] == "kernel" else want  # stored as the torch Linear weight: transposed
      if shapes[self._name(key, i)] != want:
        raise ValueError(f"{path}: {self._name(key, i)} has shape {shapes[self._name(key, i)]}, the config "
                         f"implies {want}")

  def _name(self, key, layer):
    _, module, leaf = key
    return _hf_name(self.cfg.family, module, leaf, layer)

  def _read(self, key, layer) -> np.ndarray:
    file, inner = self._stored[self._name(key, layer)]
    with safe_open(file, framework="np") as f:
      tensor = f.get_tensor(inner)
    return tensor.T if key[-1] == "kernel" else tensor

  def _part(self, part: str, read) -> Params:
    """part's leaves read by read(key) (their shapes were checked when the directory was opened)."""
    return traverse_util.unflatten_dict({
        key[1:]: np.ascontiguousarray(read(key).astype(self.cfg.param_dtype, copy=False))
        for key in self._shapes if key[0] == part})

  def outer(self) -> Params:
    """The embeddings, final norm and head, as host numpy arrays in the config's param_dtype."""
    return self._part("outer", lambda key: self._read(key, None))

  def layers(self, start: int, stop: int) -> Params:
    """Layers start..stop-1 stacked on a leading axis, as host numpy arrays in the config's param_dtype."""
    if not 0 <= start < stop <= self.cfg.num_layers:
      raise ValueError(f"layers {start}..{stop} are outside the model's {self.cfg.num_layers}")
    return self._part("layers", lambda key: np.stack([self._read(key, i) for i in range(start, stop)]))


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise ValueError(f"{path} is not valid JSON ({error})") from None


def load_hf(path: str, **overrides) -> tuple[ModelConfig, Params]:
  """Reads config.json and *.safetensors (one file or shards) into (cfg, params); params are host numpy arrays."""
  weights = HFWeights(path, **overrides)
  return weights.cfg, {"outer": weights.outer(), "layers": weights.layers(0, weights.cfg.num_layers)}


def _tensors(cfg: ModelConfig, part: str, tree, first_layer: int = 0) -> dict[str, np.ndarray]:
  """Hugging Face tensors of the outer params (part "outer") or of stacked layers first_layer.. (part "layers").
  Each stacked leaf of `tree` is let go once its tensors are made (the caller holding no other reference, as
  save_hf_shards does not): a shard is then in host memory once, with one leaf's transposed copy, not twice."""
  tensors, flat = {}, traverse_util.flatten_dict(tree)
  del tree
  for module, leaf in list(flat):
    value = np.asarray(flat.pop((module, leaf)))
    for i, tensor in [(None, value)] if part == "outer" else enumerate(value, first_layer):
      tensors[_hf_name(cfg.family, module, leaf, i)] = np.ascontiguousarray(tensor.T if leaf == "kernel" else tensor)
    del value, tensor
  return tensors


def _write_config(path: str, cfg: ModelConfig):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(cfg), f, indent=2)


def save_hf(path: str, cfg: ModelConfig, params: Params):
  """Writes config.json and model.safetensors that transformers' from_pretrained loads."""
  _write_config(path, cfg)
  tensors = {**_tensors(cfg, "outer", params["outer"]), **_tensors(cfg, "layers", params["layers"])}
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def save_hf_shards(path: str, cfg: ModelConfig, reader, layers_per_shard: int):
  """Writes config.json, safetensors shards (the outer params, then layers_per_shard layers each) and the index
  transformers reads them by (model.safetensors.index.json), from a reader with outer() and layers(start, stop)
  (models.common.InMemoryParams, HFWeights, ...): only one shard's tensors are in host memory at a time, so a model
  larger than host RAM can be written."""
  _write_config(path, cfg)
  starts = range(0, cfg.num_layers, layers_per_shard)
  names = [f"model-{i + 1:05d}-of-{len(starts) + 1:05d}.safetensors" for i in range(len(starts) + 1)]
  weight_map, total = {}, 0
  pieces = [lambda: _tensors(cfg, "outer", reader.outer())] + [
      lambda a=a: _tensors(cfg, "layers", reader.layers(a, min(a + layers_per_shard, cfg.num_layers)), a)
      for a in starts]
  for name, piece in zip(names, pieces):
    tensors = piece()
    save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, name))
    total += sum(x.nbytes for x in tensors.values())
    del tensors  # before the next shard is read
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
