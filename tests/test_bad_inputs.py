"""Bad input to train.py and generate.py is one `sljax:` line before anything is written: damaged tokenizer,
safetensors and checkpoint files, unwritable logs, contradicting flags. The checks are tested where they live
(test_data, test_hf); here, that the CLIs make one line of each."""

import json
import os
import re
import shutil

import pytest
import torch
import transformers

from sljax import metrics
from sljax.checkpoint import newest_checkpoint

from helpers import REPO, generate_cases, run_train

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
def test_generate_reads_relative_checkpoint_paths_and_refuses_bad_inputs_with_one_line(tmp_path, files):
  train_in_process(f"--workdir={tmp_path / 'run'}", "--steps=2")
  step_dirs = {}
  for damage in ("truncated", "half-written"):  # the newest step's largest file cut in half, or not there at all
    shutil.copytree(tmp_path / "run", tmp_path / damage)
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
  relative = os.path.relpath(tmp_path / "run", REPO)  # the docstring's `--checkpoint runs/llama-tiny`
  cases = {  # (flags, the start of the one line; None: it generates)
      "relative checkpoint": ([f"--checkpoint={relative}", prompts, short], None),
      "truncated": ([f"--checkpoint={tmp_path / 'truncated'}", prompts, short],
                    f"sljax: checkpoint {step_dirs['truncated']} cannot be read ("),
      "half-written": ([f"--checkpoint={tmp_path / 'half-written'}", prompts, short],
                       f"sljax: checkpoint {step_dirs['half-written']} cannot be read ("),
      "no checkpoint": ([f"--checkpoint={tmp_path / 'empty'}", prompts], f"sljax: {tmp_path / 'empty'} holds no "),
      "model and hf_dir": (["--model=llama-tiny", f"--hf_dir={files['hf']}", prompts],
                           "sljax: give --model or --hf_dir (whose config.json names the model), not both"),
      "model and checkpoint": (["--model=llama-tiny", f"--checkpoint={tmp_path / 'run'}", prompts],
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
