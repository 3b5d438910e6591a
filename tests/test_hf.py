"""Parity with Hugging Face: tiny random LLaMA/OPT saved by transformers, loaded by load_hf, same logits."""

import json
import random
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from models.hf import HFWeights, config_from_hf, load_hf, save_hf
from models.presets import build


def _llama_config(seed: int, queries_per_kv_head: int) -> transformers.LlamaConfig:
  rng = random.Random(seed)
  kv_heads, head_dim = rng.choice([1, 2]), rng.choice([4, 8, 16])
  heads = kv_heads * queries_per_kv_head
  return transformers.LlamaConfig(
      vocab_size=rng.randint(40, 300), hidden_size=heads * head_dim, intermediate_size=rng.randint(8, 80),
      num_hidden_layers=rng.randint(2, 3), num_attention_heads=heads, num_key_value_heads=kv_heads,
      max_position_embeddings=64, rms_norm_eps=rng.choice([1e-5, 1e-6]), rope_theta=10 ** rng.uniform(2, 6),
      tie_word_embeddings=rng.random() < 0.3, attn_implementation="eager")


def _opt_config(seed: int, layer_norm_before: bool, project: bool) -> transformers.OPTConfig:
  """`project`: word_embed_proj_dim != hidden_size; with post-LayerNorm that is the opt-350m shape."""
  rng = random.Random(seed)
  heads, head_dim = rng.choice([2, 3, 4]), rng.choice([4, 8, 16])
  hidden = heads * head_dim
  return transformers.OPTConfig(
      vocab_size=rng.randint(40, 300), hidden_size=hidden, ffn_dim=rng.randint(8, 80),
      num_hidden_layers=rng.randint(2, 3), num_attention_heads=heads, max_position_embeddings=rng.randint(24, 64),
      word_embed_proj_dim=rng.choice([n for n in range(4, 40) if n != hidden]) if project else hidden,
      do_layer_norm_before=layer_norm_before, attn_implementation="eager")


CONFIGS = {
    "llama-mha": lambda: _llama_config(0, 1),
    "llama-gqa2": lambda: _llama_config(1, 2),
    "llama-gqa3": lambda: _llama_config(2, 3),
    "llama-gqa4": lambda: _llama_config(3, 4),
    "opt-pre": lambda: _opt_config(4, True, False),
    "opt-pre-project": lambda: _opt_config(5, True, True),
    "opt-post": lambda: _opt_config(6, False, False),
    "opt-350m-shape": lambda: _opt_config(7, False, True),
}


def _torch_model(hf_config, seed: int = 0):
  torch.manual_seed(seed)
  family = {"llama": transformers.LlamaForCausalLM, "opt": transformers.OPTForCausalLM}[hf_config.model_type]
  model = family(hf_config).eval()
  with torch.no_grad():
    for p in model.parameters():  # nonzero biases and non-unit norms, so a mis-mapped tensor cannot hide
      p.add_(0.05 * torch.randn_like(p))
  return model


def _tokens(hf_config, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.integers(0, hf_config.vocab_size, (2, int(rng.integers(3, 20))))


def _torch_logits(model, tokens_BxS: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens_BxS)).logits.numpy()


def _our_logits(cfg, params, tokens_BxS: np.ndarray) -> np.ndarray:
  return np.asarray(build(cfg).forward(params, jnp.asarray(tokens_BxS, jnp.int32)))


# One of each kind in the fast tier (-m "not slow"): multi-head and grouped-query LLaMA, OPT pre and post norm.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in (
    "llama-gqa3", "llama-gqa4", "opt-pre-project", "opt-350m-shape") else name for name in CONFIGS])
def test_logits_match_transformers(tmp_path, name):
  hf_config = CONFIGS[name]()
  torch_model = _torch_model(hf_config)
  torch_model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = load_hf(tmp_path, dtype="float32", param_dtype="float32")
  assert (cfg.family, cfg.num_layers, cfg.hidden_size) == (
      hf_config.model_type, hf_config.num_hidden_layers, hf_config.hidden_size)
  tokens_BxS = _tokens(hf_config, seed=list(CONFIGS).index(name))
  expected_BxSxV = _torch_logits(torch_model, tokens_BxS)
  np.testing.assert_allclose(_our_logits(cfg, params, tokens_BxS), expected_BxSxV, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa2", "opt-350m-shape", "opt-pre-project"])
def test_round_trip_through_save_hf(tmp_path, name):
  hf_config = CONFIGS[name]()
  torch_model = _torch_model(hf_config, seed=1)
  torch_model.save_pretrained(tmp_path / "hf")
  cfg, params = load_hf(tmp_path / "hf", dtype="float32")
  save_hf(tmp_path / "sljax", cfg, params)

  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sljax", attn_implementation="eager")
  assert type(reloaded) is type(torch_model)
  original, restored = torch_model.state_dict(), reloaded.state_dict()
  assert original.keys() == restored.keys()
  for key in original:
    np.testing.assert_array_equal(restored[key].numpy(), original[key].numpy(), err_msg=key)
  tokens_BxS = _tokens(hf_config, seed=1)
  np.testing.assert_array_equal(_torch_logits(reloaded.eval(), tokens_BxS), _torch_logits(torch_model, tokens_BxS))
  assert load_hf(tmp_path / "sljax", dtype="float32")[0] == cfg


def test_sharded_bfloat16_checkpoint(tmp_path):
  hf_config = CONFIGS["opt-350m-shape"]()
  torch_model = _torch_model(hf_config).to(torch.bfloat16)
  torch_model.save_pretrained(tmp_path, max_shard_size="4KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  cfg, params = load_hf(tmp_path)  # bf16 tensors, float32 master weights by default
  weights = {k: v.float().numpy() for k, v in torch_model.state_dict().items()}
  last = hf_config.num_hidden_layers - 1
  assert params["layers"]["fc1"]["kernel"].dtype == np.float32
  embedding = params["outer"]["embed_tokens"]["embedding"]
  np.testing.assert_array_equal(embedding, weights["model.decoder.embed_tokens.weight"])
  np.testing.assert_array_equal(
      params["layers"]["fc1"]["kernel"][last], weights[f"model.decoder.layers.{last}.fc1.weight"].T)


def test_load_errors_are_clear(tmp_path):
  with pytest.raises(ValueError, match="no config.json"):
    load_hf(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
    load_hf(tmp_path)

  hf_config = CONFIGS["llama-gqa2"]()
  _torch_model(hf_config).save_pretrained(tmp_path)
  tensors = load_file(tmp_path / "model.safetensors")
  del tensors["model.layers.0.mlp.up_proj.weight"]
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"lacks 1 tensors .*model\.layers\.0\.mlp\.up_proj\.weight"):
    load_hf(tmp_path)


@pytest.mark.parametrize("name,change", [
    ("llama-mha", {"attention_bias": True}), ("llama-mha", {"hidden_act": "gelu"}),
    ("llama-mha", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}),
    ("opt-pre", {"enable_bias": False}), ("opt-pre", {"activation_function": "gelu"})])
def test_unsupported_variants_are_refused(name, change):
  hf = {**CONFIGS[name]().to_dict(), **change}
  with pytest.raises(ValueError, match=f"unsupported {hf['model_type']}"):
    config_from_hf(hf)


def test_layers_read_lazily_equal_the_full_load(tmp_path):
  _torch_model(_llama_config(seed=5, queries_per_kv_head=2)).save_pretrained(tmp_path)
  _, params = load_hf(tmp_path, dtype="float32")
  weights = HFWeights(tmp_path, dtype="float32")
  n = weights.cfg.num_layers
  for a, b in [(0, 1), (1, n), (0, n)]:
    for got, want in zip(jax.tree.leaves(weights.layers(a, b)), jax.tree.leaves(params["layers"])):
      np.testing.assert_array_equal(got, want[a:b])
  for got, want in zip(jax.tree.leaves(weights.outer()), jax.tree.leaves(params["outer"])):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=f"outside the model's {n}"):
    weights.layers(0, n + 1)


def _lie_about_sizes(data: bytes) -> bytes:
  """The file with its header's first tensor claiming twice its rows, the offsets left as they were."""
  length = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + length])
  first = next(name for name in header if name != "__metadata__")
  header[first]["shape"][0] *= 2
  text = json.dumps(header).encode()
  return len(text).to_bytes(8, "little") + text + data[8 + length:]


DAMAGES = {  # how a file is damaged
    "random-bytes": lambda data: np.random.default_rng(0).bytes(len(data)),
    "cut-in-half": lambda data: data[:len(data) // 2],
    "last-byte-missing": lambda data: data[:-1],
    "empty": lambda data: b"",
    "header-lies-about-sizes": _lie_about_sizes,
}


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
  """A tiny LLaMA saved by transformers in shards: (directory, its shard files)."""
  path = tmp_path_factory.mktemp("hf")
  _torch_model(CONFIGS["llama-gqa2"]()).save_pretrained(path, max_shard_size="8KB")
  return path, sorted(p.name for p in path.glob("*.safetensors"))


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_safetensors_file_is_refused_when_the_directory_is_opened(tmp_path, sharded_llama, damage):
  source, shards = sharded_llama
  damaged = tmp_path / "hf"
  shutil.copytree(source, damaged)
  victim = damaged / shards[len(shards) // 2]  # a middle shard: each one is checked, not only the first
  victim.write_bytes(DAMAGES[damage](victim.read_bytes()))
  with pytest.raises(ValueError) as info:
    HFWeights(damaged)
  message = str(info.value)
  assert message.startswith(f"{victim} is not a readable safetensors file, or is truncated (")
  assert "\n" not in message


def test_a_tensor_of_the_wrong_shape_or_a_missing_shard_is_refused_when_opened(tmp_path, sharded_llama):
  source, shards = sharded_llama
  shutil.copytree(source, tmp_path / "hf")
  victim = next(p for p in sorted((tmp_path / "hf").glob("*.safetensors")) if "model.layers.1.mlp.up_proj.weight"
                in load_file(p))
  tensors = load_file(victim)
  want = tensors["model.layers.1.mlp.up_proj.weight"].shape
  tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
  save_file(tensors, victim, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=re.escape(f"model.layers.1.mlp.up_proj.weight has shape "
                                                 f"{(want[0] - 1, want[1])}, the config implies {want}")):
    HFWeights(tmp_path / "hf")
  victim.unlink()
  with pytest.raises(ValueError, match=f"lacks 1 of the {len(shards)} files its index names: {victim.name}"):
    HFWeights(tmp_path / "hf")
  (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama",')
  with pytest.raises(ValueError, match="config.json is not valid JSON"):
    HFWeights(tmp_path / "hf")
