"""Bad input to train.py and generate.py is one `sljax:` line before anything is written: damaged tokenizer,
safetensors and checkpoint files, unwritable logs, contradicting flags. The checks are tested where they live
(test_data, test_hf); here, that the CLIs make one line of each."""

import dataclasses
import json
import os
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
import transformers

from models.common import params_reader
from models.config import ModelConfig, saved_model_config
from models.presets import PRESETS, build, get_config
import sljax
from sljax import metrics
from sljax.checkpoint import newest_checkpoint
from sljax.generate import SamplingConfig
from sljax.generate_launch import FiniteWeights, GenerateConfig, NonFiniteWeights, check_layers_and_tokens
from sljax.optim import OptimConfig, make_optimizer

from helpers import REPO, generate_cases, make_batch, run_train

TINY_TRAIN = ["--set=num_layers=2", "--set=hidden_size=32", "--set=intermediate_size=48", "--set=num_heads=2",
              "--set=num_kv_heads=1", "--seq_len=16", "--batch_size=2", "--max_tokens=2000", "--warmup_steps=1",
              "--mesh=data:1,fsdp:1"]  # one device: conftest's eight would only slow the compile


def train_in_process(*args) -> dict[int, float]:
  return run_train(*TINY_TRAIN, *args)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
  """Real files and their damaged copies: a tokenizer, a Hugging Face directory, a directory in place of a file."""
  root = tmp_path_factory.mktemp("inputs")
  (root / "garbage.model").write_bytes(b"\x08\x96\x01 not a sentencepiece ModelProto")
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
      num_key_value_heads=1, max_position_embeddings=64)
  transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
  weights = root / "hf" / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
  (root / "a_directory").mkdir()
  return {name: str(root / name) for name in ("garbage.model", "hf", "a_directory")} | {"root": str(root)}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """The workdir of a 2-step train.py run, which the generate tests read (and copy to damage, never change)."""
  workdir = tmp_path_factory.mktemp("two_steps") / "run"
  train_in_process(f"--workdir={workdir}", "--steps=2")
  return workdir


def test_check_writable_file(tmp_path):
  check = metrics.check_writable_file
  check("")  # no file
  check(str(tmp_path / "new.jsonl"))
  (tmp_path / "old.jsonl").write_text("{}\n")
  check(str(tmp_path / "old.jsonl"))
  check(str(tmp_path / "run" / "loss.jsonl"), workdir=str(tmp_path / "run"))  # the run makes its workdir first
  refusals = {
      "it is a directory": str(tmp_path),
      f"{tmp_path / 'missing'} does not exist": str(tmp_path / "missing" / "loss.jsonl"),
      f"{tmp_path / 'old.jsonl'} is not a directory": str(tmp_path / "old.jsonl" / "loss.jsonl"),
  }
  for reason, path in refusals.items():
    with pytest.raises(ValueError, match=f"^loss_log {path} cannot be (written|created): {reason}$"):
      check(path, what="loss_log", workdir=str(tmp_path / "run"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_check_writable_file_refuses_a_read_only_directory(tmp_path):
  (tmp_path / "ro").mkdir(mode=0o555)
  with pytest.raises(ValueError, match="is read-only here"):
    metrics.check_writable_file(str(tmp_path / "ro" / "loss.jsonl"))


TRAIN_REFUSALS = {  # a flag (its value a key of `files`) -> the start of the one line
    "tokenizer": ("garbage.model", "sljax: tokenizer {} cannot be read (not a sentencepiece model: "),
    "hf_dir": ("hf", "sljax: {}/model.safetensors is not a readable safetensors file, or is truncated ("),
    "loss_log": ("a_directory", "sljax: loss_log {} cannot be written: it is a directory"),
}


@pytest.mark.parametrize("flag", TRAIN_REFUSALS)
def test_train_refuses_with_one_line_before_the_workdir_exists(tmp_path, files, flag):
  name, line = TRAIN_REFUSALS[flag]
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as info:
    train_in_process(f"--workdir={workdir}", f"--{flag}={files[name]}")
  assert str(info.value).startswith(line.format(files[name])) and "\n" not in str(info.value), info.value
  assert not workdir.exists()


@pytest.mark.parametrize("budget", ["--host_memory_gib=inf", "--host_memory_gib=nan", "--device_memory_gib=-1"])
def test_train_refuses_a_budget_that_is_no_number_of_gib_with_one_line(tmp_path, budget):
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as info:
    train_in_process(f"--workdir={workdir}", budget)
  flag, value = budget.split("=")
  assert re.fullmatch(rf"sljax: {flag} must be a number of GiB >= 0 \(0: the default\), got {value}(\.0)?",
                      str(info.value)), info.value
  assert not workdir.exists()


def _stray_errors(stderr: str) -> set[str]:
  """The last lines of the tracebacks in stderr."""
  return {line for line in stderr.splitlines() if re.match(r"[\w.]+(Error|Exception):", line)}


@pytest.mark.slow
def test_generate_reads_relative_checkpoint_paths_and_refuses_bad_inputs_with_one_line(tmp_path, files, two_steps):
  step_dirs = {}
  for damage in ("truncated", "half-written"):  # the newest step's largest file cut in half, or not there at all
    shutil.copytree(two_steps, tmp_path / damage)
    step_dirs[damage], _ = newest_checkpoint(str(tmp_path / damage))
    largest = max((os.path.join(d, f) for d, _, names in os.walk(step_dirs[damage]) for f in names),
                  key=os.path.getsize)
    if damage == "truncated":
      os.truncate(largest, os.path.getsize(largest) // 2)
    else:
      os.remove(largest)
  (tmp_path / "empty").mkdir()
  (tmp_path / "prompts.txt").write_text("def fib(n):\nimport os\n")
  prompts, short = f"--prompt_file={tmp_path / 'prompts.txt'}", "--max_new_tokens=2"
  relative = os.path.relpath(two_steps, REPO)  # the docstring's `--checkpoint runs/llama-tiny`
  cases = {  # (flags, the start of the one line; None: it generates)
      "relative checkpoint": ([f"--checkpoint={relative}", prompts, short], None),
      "truncated": ([f"--checkpoint={tmp_path / 'truncated'}", prompts, short],
                    f"sljax: checkpoint {step_dirs['truncated']} cannot be read ("),
      "half-written": ([f"--checkpoint={tmp_path / 'half-written'}", prompts, short],
                       f"sljax: checkpoint {step_dirs['half-written']} cannot be read ("),
      "no checkpoint": ([f"--checkpoint={tmp_path / 'empty'}", prompts], f"sljax: {tmp_path / 'empty'} holds no "),
      "model and hf_dir": (["--model=llama-tiny", f"--hf_dir={files['hf']}", prompts],
                           "sljax: give --model or --hf_dir (whose config.json names the model), not both"),
      "model and checkpoint": (["--model=llama-tiny", f"--checkpoint={two_steps}", prompts],
                               "sljax: give --model or --checkpoint (whose metadata names it), not both"),
      "truncated safetensors": ([f"--hf_dir={files['hf']}", prompts],
                                f"sljax: {files['hf']}/model.safetensors is not a readable safetensors file, or "),
      "garbage tokenizer": (["--random_weights", f"--tokenizer={files['garbage.model']}", prompts],
                            f"sljax: tokenizer {files['garbage.model']} cannot be read (not a sentencepiece "),
      "negative budget": (["--random_weights", prompts, "--host_memory_gib=-1"],
                          "sljax: --host_memory_gib must be a number of GiB >= 0 (0: the default), got -1.0"),
      "infinite budget": (["--random_weights", prompts, "--host_memory_gib=inf"],
                          "sljax: --host_memory_gib must be a number of GiB >= 0 (0: the default), got inf"),
      "nan budget": (["--random_weights", prompts, "--device_memory_gib=nan"],
                     "sljax: --device_memory_gib must be a number of GiB >= 0 (0: the default), got nan"),
  }
  result = generate_cases([args for args, _ in cases.values()])
  assert result.returncode == 0 and not _stray_errors(result.stderr), result.stderr  # each case ran to its end
  outcomes = json.loads(result.stdout.splitlines()[-1])
  for (case, (_, line)), outcome in zip(cases.items(), outcomes):
    if line is None:
      assert [r["prompt"] for r in outcome["records"]] == ["def fib(n):", "import os"], (case, outcome)
      assert all(len(r["tokens"]) == 2 for r in outcome["records"]), (case, outcome)
    else:
      assert outcome.get("exit", "").startswith(line) and "\n" not in outcome["exit"], (case, outcome)


def test_a_saved_model_keeps_the_fields_that_shape_its_weights():
  saved = dataclasses.asdict(PRESETS["llama-tiny"])
  assert saved_model_config(saved, {"dtype": "float32", "rope_theta": 1e6}, "x").dtype == "float32"
  refusals = {"num_layers=1: x was saved with num_layers=4": {"num_layers": 1},
              "hidden_size=128: x was saved with hidden_size=256": {"hidden_size": 128, "dtype": "float32"},
              "num_heads=2, num_kv_heads=1: x was saved with num_heads=4, num_kv_heads=2": {"num_heads": 2,
                                                                                          "num_kv_heads": 1}}
  for changed, overrides in refusals.items():
    with pytest.raises(ValueError) as refused:
      saved_model_config(saved, overrides, "x")
    assert str(refused.value) == (f"--set {changed}, which shapes its weights; only fields that keep them (dtype, "
                                  f"param_dtype, attention, ...) may be set on a saved model")
  opt = dataclasses.asdict(PRESETS["opt-125m"])
  with pytest.raises(ValueError, match="max_positions=4096: x was saved with max_positions=2048"):
    saved_model_config(opt, {"max_positions": 4096}, "x")  # OPT's position embeddings
  assert saved_model_config(saved, {"max_positions": 4096}, "x").max_positions == 4096  # LLaMA has none


@pytest.mark.parametrize("fields, message", [
    ({"num_layers": 0}, "num_layers must be a whole number >= 1, got 0"),
    ({"num_layers": -2}, "num_layers must be a whole number >= 1, got -2"),
    ({"num_heads": 0}, "num_heads must be a whole number >= 1, got 0"),
    ({"vocab_size": 0}, "vocab_size must be a whole number >= 1, got 0"),
    ({"num_layers": 2.5}, "num_layers must be a whole number >= 1, got 2.5"),
    ({"dtype": "int8"}, "dtype must be a float dtype (float32, bfloat16, float16), got 'int8'"),
    ({"param_dtype": "bool"}, "param_dtype must be a float dtype (float32, bfloat16, float16), got 'bool'"),
    ({"norm_eps": float("nan")}, "norm_eps must be positive and finite, got nan"),
    ({"hidden_size": 6, "num_heads": 2, "num_kv_heads": 1}, "head_dim 3 (hidden_size / num_heads) must be even"),
], ids=lambda x: "" if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_model_fields_are_validated_in_one_line(fields, message):
  with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
    ModelConfig(**fields)


@pytest.mark.parametrize("flags, message", [
    (["--set=num_layers=0"], "sljax: num_layers must be a whole number >= 1, got 0"),
    (["--set=num_heads=0"], "sljax: num_heads must be a whole number >= 1, got 0"),
    (["--set=dtype=int8"], "sljax: dtype must be a float dtype (float32, bfloat16, float16), got 'int8'"),
    (["--engine=offload", "--set=num_layers=0"], "sljax: num_layers must be a whole number >= 1, got 0"),
    (["--engine=offload", "--live_layers=3"], "sljax: --live_layers=3: more than the model's 2 layers"),
    (["--engine=offload", "--tail_layers=3"], "sljax: --tail_layers=3: more than the model's 2 layers"),
])
def test_train_refuses_a_model_no_engine_can_build_before_the_workdir_exists(tmp_path, flags, message):
  with pytest.raises(SystemExit) as info:
    train_in_process(f"--workdir={tmp_path / 'run'}", *flags)
  assert str(info.value) == message
  assert not (tmp_path / "run").exists()


def test_generate_refuses_layers_it_does_not_have_and_stop_tokens_outside_the_vocabulary():
  cfg = PRESETS["llama-tiny"]
  for request, sampling, message in [
      (GenerateConfig(live_layers=5), SamplingConfig(), "--live_layers=5: more than the model's 4 layers"),
      (GenerateConfig(resident_layers=9), SamplingConfig(), "--resident_layers=9: more than the model's 4 layers"),
      (GenerateConfig(), SamplingConfig(stop_tokens=(2, 256)),
       "--stop_token 256: outside the model's vocabulary 0..255"),
      (GenerateConfig(), SamplingConfig(stop_tokens=(-1,)), "--stop_token -1: outside the model's vocabulary 0..255")]:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
      check_layers_and_tokens(request, sampling, cfg)
  check_layers_and_tokens(GenerateConfig(live_layers=4, resident_layers=4), SamplingConfig(stop_tokens=(255,)), cfg)


def test_weights_with_a_nan_are_refused_as_they_are_read():
  params = {"outer": {"embed": np.ones((4, 2), np.float32)},
            "layers": {"kernel": np.ones((3, 2, 2), ml_dtypes.bfloat16)}}
  params["layers"]["kernel"][2, 1, 0] = np.nan
  reader = FiniteWeights(params_reader(params), "--hf_dir x")
  assert reader.outer()["embed"].shape == (4, 2) and reader.layers(0, 2)["kernel"].shape == (2, 2, 2)
  with pytest.raises(NonFiniteWeights, match=r"^--hf_dir x holds a non-finite weight \(nan\) in layer 2, "
                                             r"\['kernel'\]: refusing to generate from it$"):
    reader.layers(2, 3)


@pytest.mark.slow
def test_generate_refuses_reshaped_saved_models_and_weights_with_a_nan_in_one_line(tmp_path, two_steps):
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
      num_key_value_heads=1, max_position_embeddings=64)
  model = transformers.LlamaForCausalLM(config)
  model.save_pretrained(tmp_path / "hf")
  run_train(f"--hf_dir={tmp_path / 'hf'}", f"--workdir={tmp_path / 'lora'}", "--lora_rank=2", "--seq_len=16",
            "--batch_size=2", "--max_tokens=2000", "--warmup_steps=1", "--steps=1", "--checkpoint_every=1")
  with torch.no_grad():
    model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
  model.save_pretrained(tmp_path / "nan")
  (tmp_path / "prompts.txt").write_text("def fib(n):\n")
  run, lora = str(two_steps), str(tmp_path / "lora")
  prompts, short = f"--prompt_file={tmp_path / 'prompts.txt'}", "--max_new_tokens=2"
  cases = {
      "dtype": ([f"--checkpoint={run}", "--set=dtype=float32", prompts, short], None),
      "num_layers": ([f"--checkpoint={run}", "--set=num_layers=1", prompts, short],
                     f"sljax: --set num_layers=1: --checkpoint {run} was saved with num_layers=2, which shapes its "
                     f"weights; only fields that keep them (dtype, param_dtype, attention, ...) may be set on a saved "
                     f"model"),
      "hidden_size": ([f"--checkpoint={run}", "--set=hidden_size=64", prompts, short],
                      f"sljax: --set hidden_size=64: --checkpoint {run} was saved with hidden_size=32, which shapes"),
      "lora num_layers": ([f"--lora_checkpoint={lora}", "--set=num_layers=1", prompts, short],
                          f"sljax: --set num_layers=1: --lora_checkpoint {lora} was saved with num_layers=2, "),
      "lora dtype": ([f"--lora_checkpoint={lora}", "--set=dtype=float32", prompts, short], None),
      "nan": ([f"--hf_dir={tmp_path / 'nan'}", prompts, short],
              f"sljax: --hf_dir {tmp_path / 'nan'} holds a non-finite weight (nan) in layer 1, "),
      "stop token": ([f"--checkpoint={run}", prompts, "--stop_token=256"],
                     "sljax: --stop_token 256: outside the model's vocabulary 0..255"),
  }
  result = generate_cases([args for args, _ in cases.values()])
  assert result.returncode == 0 and not _stray_errors(result.stderr), result.stderr
  for (case, (_, line)), outcome in zip(cases.items(), json.loads(result.stdout.splitlines()[-1])):
    if line is None:
      assert len(outcome["records"]) == 1, (case, outcome)
    else:
      assert outcome.get("exit", "").startswith(line) and "\n" not in outcome["exit"], (case, outcome)


def tiny_model():
  return build(get_config("llama-tiny", {"num_layers": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                                         "num_kv_heads": 1, "dtype": "float32"}))


PER_PARAMETER = {"adamw": optax.adamw(1e-3), "sgd": optax.sgd(0.1), "lion": optax.lion(1e-4),
                 "the recipe's": make_optimizer(OptimConfig(), clip=False),
                 "a chain of per-parameter transforms": optax.chain(optax.clip(1.0), optax.scale_by_adam(),
                                                                    optax.add_decayed_weights(0.1), optax.scale(-1e-3))}
GLOBAL = {"global-norm clipping": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
          "the recipe's with clipping": make_optimizer(OptimConfig()),
          "lamb (a trust ratio per stacked leaf)": optax.lamb(1e-3)}


@pytest.mark.parametrize("name", PER_PARAMETER)
def test_the_engine_takes_per_parameter_optimizers(name):
  sljax.Engine(tiny_model(), PER_PARAMETER[name], sljax.EngineConfig(live_layers=1))


@pytest.mark.parametrize("name", GLOBAL)
def test_the_engine_refuses_an_optimizer_it_cannot_apply_group_by_group_exactly(name):
  with pytest.raises(ValueError, match=r"^the optimizer is not per-parameter: its update of one layer group alone "
                                       r"differs from its update of the whole model .* set EngineConfig.grad_clip_norm "
                                       r"\(train.py --grad_clip_norm\), which the engine computes over all groups$"):
    sljax.Engine(tiny_model(), GLOBAL[name], sljax.EngineConfig(live_layers=1))


@pytest.mark.slow
def test_engine_step_refuses_a_batch_of_the_wrong_keys_or_shapes_naming_the_key():
  engine = sljax.Engine(tiny_model(), optax.sgd(0.1), sljax.EngineConfig(sub_batches=2))
  state = engine.init(jax.random.key(0))
  good = make_batch(np.random.default_rng(0), 4)
  refusals = {
      "the batch has no 'weights' (it needs inputs, targets, weights: [B, S] arrays), got keys 'inputs', 'targets'":
          {key: good[key] for key in ("inputs", "targets")},
      "batch['targets'] has shape (4, 7); every array of a batch is [B, S], the same for inputs, targets, weights "
      "(inputs: (4, 8))": dict(good, targets=good["targets"][:, 1:]),
      "batch['inputs'] has shape (32,); every array": dict(good, inputs=good["inputs"].ravel()),
      "batch['inputs'] has dtype float32; token ids are integers": dict(good, inputs=good["inputs"].astype(np.float32)),
      "batch['targets'] holds token id 300, outside the model's vocabulary 0..255": dict(
          good, targets=np.where(good["targets"] == good["targets"].max(), 300, good["targets"])),
      "batch['weights'] holds -1.0; weights are >= 0": dict(good, weights=good["weights"] - 1),
  }
  for message, batch in refusals.items():
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
      engine.step(state, batch)
  state, loss = engine.step(state, good)  # nothing was consumed by the refusals
  assert np.isfinite(loss)
