"""sljax.export: any train.py run, full or LoRA, written as a Hugging Face directory that transformers loads with the
run's logits (fp32, 1e-4); read and written a shard of layers at a time in bounded host memory; bad input one line
before anything is written, and an export cut short leaves nothing behind."""

import dataclasses
import json
import os
import subprocess
import sys
import tracemalloc
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import SafetensorError, safe_open

import models.hf
from models.config import ModelConfig
from models.presets import build
from sljax.checkpoint import Checkpointer, SavedParams, read_params
from sljax.export import ExportConfig, export
from sljax.lora.checkpoint import RandomBase, open_checkpoint, random_base_key, read_adapters
from sljax.lora.model import LoraModel, join_adapters

from helpers import REPO, train_in_process

ONE_DEVICE = "--mesh=data:1,fsdp:1"  # conftest's eight would only slow the compile
# A model whose layers outweigh the rest: 4 MiB a layer in fp32, 0.5 MiB of outer params.
WIDE = ModelConfig(family="llama", vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=6,
                   num_heads=4, num_kv_heads=4, max_positions=64)


class Saved(NamedTuple):
  workdir: str
  params: dict  # numpy


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory) -> Saved:
  """A full run's checkpoint of WIDE laid out by layer groups (of 2, an optimizer state beside each, in parts of
  4 MiB), as the offload engine's format-1 checkpoints were, of random params: read_params reads it, and each shard
  of one layer cuts a group. Only read."""
  workdir = tmp_path_factory.mktemp("wide") / "run"
  rng = np.random.default_rng(0)  # numpy, not the model's init: XLA:CPU compiles that for 20 s
  params = jax.tree.map(lambda x: rng.normal(0, 0.1, x.shape).astype(x.dtype),
                        jax.eval_shape(build(WIDE).init, jax.random.key(0)))
  groups = [jax.tree.map(lambda x, a=a: x[a:a + 2], params["layers"]) for a in range(0, WIDE.num_layers, 2)]
  state = {"step": np.int32(1), "outer": params["outer"], "outer_opt": {"mu": params["outer"]},
           "groups": [{"master": g, "opt": {"mu": g}} for g in groups]}
  checkpointer = Checkpointer(str(workdir / "checkpoints"), save_every=1, staging_bytes=16 * 2**20)
  checkpointer.save(1, jax.tree.map(jnp.asarray, state), {"model_config": dataclasses.asdict(WIDE)})
  checkpointer.close()
  return Saved(str(workdir), params)


def model_logits(cfg: ModelConfig, params: dict, tokens_BxS: np.ndarray) -> np.ndarray:
  model = build(dataclasses.replace(cfg, dtype="float32"))
  outer = params["outer"]
  return np.asarray(model.logits(outer, model.layers(params["layers"], model.embed(outer, jnp.asarray(tokens_BxS)))))


def transformers_logits(directory, tokens_BxS: np.ndarray) -> np.ndarray:
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
  assert reloaded.dtype == torch.float32
  with torch.no_grad():
    return reloaded.eval()(torch.from_numpy(tokens_BxS)).logits.numpy()


def shard_files(directory) -> set[str]:
  with open(os.path.join(directory, "model.safetensors.index.json")) as f:
    shards = set(json.load(f)["weight_map"].values())
  assert shards == {name for name in os.listdir(directory) if name.endswith(".safetensors")}
  return shards


def files_under(directory) -> dict[str, int]:
  return {os.path.join(d, name): os.path.getsize(os.path.join(d, name))
          for d, _, names in os.walk(directory) for name in names}


FULL_RUNS = {  # a run of each engine, each family
    "llama-offload": ["--engine=offload", "--live_layers=1", "--set=num_layers=3"],
    "opt-device": ["--engine=device", "--model=opt-125m", "--set=vocab_size=256", "--set=max_positions=64"],
}


@pytest.mark.slow
@pytest.mark.parametrize("run", FULL_RUNS)
def test_a_full_run_loads_in_transformers_with_the_models_logits_on_its_saved_params(tmp_path, run):
  pytest.importorskip("torch")
  train_in_process(tmp_path / "run", ONE_DEVICE, "--steps=2", "--checkpoint_every=2", "--learning_rate=1e-2",
                   *FULL_RUNS[run])
  # One layer per shard (the model is tiny): written a shard at a time, read back through the index.
  cfg = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "hf"), shard_gib=1e-9))
  assert len(shard_files(tmp_path / "hf")) == cfg.num_layers + 1 and cfg.param_dtype == "float32"
  saved = read_params(str(tmp_path / "run"))
  assert cfg == ModelConfig(**saved.meta["model_config"])
  tokens_BxS = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
  want_BxSxV = model_logits(cfg, {"outer": saved.outer(), "layers": saved.layers(0, cfg.num_layers)}, tokens_BxS)
  np.testing.assert_allclose(transformers_logits(tmp_path / "hf", tokens_BxS), want_BxSxV, rtol=0, atol=1e-4)


LORA = ["--set=dtype=float32", "--warmup_steps=1", "--checkpoint_every=2", "--learning_rate=1e-2", "--lora_rank=4",
        "--lora_targets=q_proj,down_proj"]


@pytest.mark.slow
def test_a_lora_run_exports_through_the_command_line_with_the_lora_models_logits(tmp_path):
  """A LoRA run on a random base, exported by `python -m sljax.export`: its adapters merged into the base give
  transformers the logits of the LoRA model (the adapters applied unmerged); a second export into the same --out is
  one `sljax:` line and writes nothing. The run trains on an int4 base (--base_bits=4), which its checkpoint
  records; the adapters merge into the base unquantized, as any run's (tests/test_lora_cli.py exports one trained on
  a Hugging Face base as it is)."""
  pytest.importorskip("torch")
  train_in_process(tmp_path / "run", ONE_DEVICE, "--steps=2", *LORA, "--base_bits=4")
  command = [sys.executable, "-m", "sljax.export", f"--checkpoint={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}",
             "--shard_gib=1e-9"]
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == f"wrote {tmp_path / 'hf'}: llama, 2 layers, 0.1 M params, float32", done.stdout
  checkpoint = open_checkpoint(str(tmp_path / "run"))
  assert checkpoint.meta["lora"]["base_bits"] == 4 and checkpoint.lora.base_bits == 4
  cfg = ModelConfig(**checkpoint.meta["model_config"])
  assert len(shard_files(tmp_path / "hf")) == cfg.num_layers + 1
  base = RandomBase(build(cfg), random_base_key(checkpoint.base["random_seed"]))  # unquantized, fp32
  model = LoraModel(build(cfg), checkpoint.lora)
  adapters = read_adapters(checkpoint)
  assert np.abs(adapters["q_proj"]["lora_b"]).max() > 1e-3  # trained: the merge moves the kernels
  outer, layers = base.outer(), join_adapters(base.layers(0, cfg.num_layers), adapters)
  tokens_BxS = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
  want_BxSxV = model.logits(outer, model.layers(layers, model.embed(outer, jnp.asarray(tokens_BxS, jnp.int32))))
  np.testing.assert_allclose(transformers_logits(tmp_path / "hf", tokens_BxS), want_BxSxV, rtol=0, atol=1e-4)

  before = files_under(tmp_path)
  again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert again.returncode == 1 and again.stdout == ""
  assert again.stderr.strip() == f"sljax: --out {tmp_path / 'hf'} exists and is not an empty directory", again.stderr
  assert files_under(tmp_path) == before


def test_host_memory_holds_one_shard_and_the_outer_params_not_the_model(tmp_path, monkeypatch, wide_run):
  """Six 4 MiB layers exported a layer a shard: what export allocates at its peak (tracemalloc: numpy's arrays,
  not the orbax part being read, which the checkpoint bounds) is about one shard and the outer params, and no call
  reads more than a shard's layers; the same model written as one shard takes the model's bytes (the measure sees
  what it bounds). The written tensors are the saved params, in bf16 with --set=param_dtype=bfloat16."""
  layer_bytes, outer_bytes = WIDE.layer_param_count() * 4, WIDE.outer_param_count() * 4
  asked, original = [], SavedParams.layers
  monkeypatch.setattr(SavedParams, "layers",
                      lambda self, start, stop: asked.append(stop - start) or original(self, start, stop))

  def peak(shard_bytes: float, out: str, *overrides: str) -> int:
    tracemalloc.start()
    try:
      export(ExportConfig(checkpoint=wide_run.workdir, out=str(tmp_path / out), shard_gib=shard_bytes / 2**30,
                          overrides=overrides))
      return tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()

  one_layer = peak(1.1 * layer_bytes, "sharded")
  assert asked == [1] * WIDE.num_layers
  # + 2 MiB: the checkpoint's parts here are 0.8 MiB, and its readers go ahead of the part being cut, about one part
  # more than when they waited for it (measured 5.85 MiB, 5.12 before; layer 4.0 + outer 0.5); the model is 24 MiB.
  assert one_layer < layer_bytes + outer_bytes + 2 * 2**20, (one_layer / 2**20, layer_bytes / 2**20)
  whole = peak(10 * layer_bytes, "whole")
  assert whole > WIDE.num_layers * layer_bytes, whole / 2**20

  # Read in fp32, written in bf16: the shard is the fp32 layers, each array let go as it is cast.
  assert peak(1.1 * layer_bytes, "bf16", "param_dtype=bfloat16") < layer_bytes + outer_bytes + 2 * 2**20
  assert asked == [1] * WIDE.num_layers + [WIDE.num_layers] + [1] * WIDE.num_layers
  for name, dtype in (("sharded", np.float32), ("bf16", jnp.bfloat16)):
    written = models.hf.load_hf(str(tmp_path / name), param_dtype="float32")[1]
    assert json.load(open(tmp_path / name / "config.json"))["dtype"] == np.dtype(dtype).name
    for got, want in zip(jax.tree.leaves(written), jax.tree.leaves(wide_run.params)):
      np.testing.assert_array_equal(got, want.astype(dtype).astype(np.float32))
  for name in shard_files(tmp_path / "bf16"):
    with safe_open(str(tmp_path / "bf16" / name), framework="np") as f:
      assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}, name


def test_bad_input_is_one_line_before_anything_is_written(tmp_path, monkeypatch, wide_run):
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  (tmp_path / "a_file").write_text("")
  (tmp_path / "empty").mkdir()
  run = wide_run.workdir
  refusals = {  # ExportConfig's fields -> the one line
      (str(tmp_path / "nothing"), str(tmp_path / "out")): f"{tmp_path / 'nothing'} holds no checkpoint",
      (run, str(tmp_path / "full")): f"--out {tmp_path / 'full'} exists and is not an empty directory",
      (run, str(tmp_path / "a_file")): f"--out {tmp_path / 'a_file'} exists and is not an empty directory",
      (run, str(tmp_path / "a_file" / "out")):
          f"--out {tmp_path / 'a_file' / 'out'} cannot be written: {tmp_path / 'a_file'} is not a directory",
      (run, str(tmp_path / "out"), "", ("num_layers=1",)):
          "--set num_layers: an export writes the model the run trained, in another param_dtype at most",
      (run, str(tmp_path / "out"), "", ("hidden_size=8", "param_dtype=bfloat16")): "--set hidden_size: ",
      (run, str(tmp_path / "out"), "", ("dtype=int8",)): "--set dtype: ",
      (run, str(tmp_path / "out"), "", ("param_dtype=int8",)): "param_dtype must be a float dtype",
      (run, str(tmp_path / "out"), str(tmp_path / "empty")):
          f"--hf_dir names a LoRA run's base; checkpoint {os.path.join(run, 'checkpoints', '1')} is a full run's",
      (run, ""): "give --out",
  }
  before = files_under(tmp_path)
  for fields, line in refusals.items():
    with pytest.raises(ValueError) as error:
      export(ExportConfig(*fields))
    assert str(error.value).startswith(line) and "\n" not in str(error.value), (fields, str(error.value))
  if os.geteuid() != 0:  # root may write anywhere
    (tmp_path / "read_only").mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot be written: Permission denied"):
      export(ExportConfig(run, str(tmp_path / "read_only" / "out")))
  monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(free=WIDE.param_count() * 4 - 1))
  with pytest.raises(ValueError, match=f"^--out {tmp_path / 'out'}: the model takes 25.7 MB, 25.7 MB is free there$"):
    export(ExportConfig(run, str(tmp_path / "out")))
  assert files_under(tmp_path) == before and sorted(os.listdir(tmp_path)) == [
      "a_file", "empty", "full"] + (["read_only"] if os.geteuid() != 0 else [])


def test_a_disk_that_fills_during_the_export_leaves_nothing_at_out_or_beside_it(tmp_path, monkeypatch, wide_run):
  (tmp_path / "out").mkdir()  # an empty --out stays as it was
  written = []
  save_file = models.hf.save_file

  def fills(tensors, path, metadata):  # what safetensors raises when the disk fills (checked on a 1 MiB tmpfs)
    if written:
      raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    written.append(path)
    save_file(tensors, path, metadata=metadata)

  monkeypatch.setattr(models.hf, "save_file", fills)
  with pytest.raises(ValueError) as error:
    export(ExportConfig(wide_run.workdir, str(tmp_path / "out"), shard_gib=1e-9))
  assert str(error.value).startswith(f"writing {tmp_path / 'out'} failed (Error while serializing: I/O error: No "
                                     f"space left on device (os error 28); ") and "\n" not in str(error.value)
  assert str(error.value).endswith(" free there, the model takes 25.7 MB): nothing was left")
  assert written and sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(tmp_path / "out") == []
  monkeypatch.setattr(models.hf, "save_file", save_file)
  export(ExportConfig(wide_run.workdir, str(tmp_path / "out")))  # the rerun goes through
  umask = os.umask(0)
  os.umask(umask)
  assert len(shard_files(tmp_path / "out")) == 2 and os.stat(tmp_path / "out").st_mode & 0o777 == 0o777 & ~umask
  assert {os.stat(tmp_path / "out" / name).st_mode & 0o777 for name in os.listdir(tmp_path / "out")} == {
      0o666 & ~umask}  # as open() makes files, not private to this user
