"""Each preset trains with its paper's recipe; flags replace fields; bad numbers are refused in one line."""

import os

import numpy as np
import pytest
from absl import flags

from models.presets import PRESETS
from sljax import launch
from sljax.cli import train
from sljax.request import LaunchConfig, Request
from sljax.optim import RECIPES, learning_rate_schedule, recipe_for
from sljax.trainer import RunConfig

LLAMA2 = dict(b1=0.9, b2=0.95, eps=1e-5, weight_decay=0.1, grad_clip_norm=1.0, warmup_steps=2000,
              decay_shape="cosine", min_lr_ratio=0.1)
OPT = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0, warmup_steps=2000,
           decay_shape="linear", min_lr_ratio=0.1)
PEAKS = {"llama7b": 3e-4, "llama13b": 3e-4, "llama70b": 1.5e-4, "opt-125m": 6.0e-4, "opt-350m": 3.0e-4,
         "opt-1.3b": 2.0e-4, "opt-2.7b": 1.6e-4, "opt-6.7b": 1.2e-4, "opt-13b": 1.0e-4, "opt-30b": 1.0e-4,
         "opt-66b": 0.8e-4, "opt-175b": 1.2e-4}


def parse(*args):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train.py", *args])
  return train.configs_from_flags()


def test_every_preset_has_a_recipe():
  assert set(RECIPES) == set(PRESETS)


@pytest.mark.parametrize("name", PEAKS)
def test_recipe_is_the_papers(name):
  recipe = RECIPES[name]
  want = LLAMA2 if name.startswith("llama") else OPT
  assert {field: getattr(recipe.optim, field) for field in want} == want
  assert recipe.optim.learning_rate == PEAKS[name] and recipe.optim.moments_dtype == "float32"
  assert recipe.seq_len == 2048 and recipe.batch_size is None  # the plan chooses the batch


def test_llama_tiny_keeps_its_quick_cpu_recipe():
  _, data, optim, run, _ = parse()
  assert (optim.learning_rate, optim.warmup_steps, optim.decay_steps) == (3e-3, 20, run.steps)
  assert (data.seq_len, data.batch_size) == (128, 8)


def test_flags_replace_recipe_fields(capsys):
  _, data, optim, _, _ = parse("--model=llama13b", "--learning_rate=1e-4", "--b2=0.99", "--grad_clip_norm=0",
                               "--decay_shape=linear", "--seq_len=4096", "--batch_size=16", "--steps=5000")
  assert (optim.learning_rate, optim.b2, optim.grad_clip_norm, optim.decay_shape) == (1e-4, 0.99, 0.0, "linear")
  assert (optim.eps, optim.warmup_steps, optim.decay_steps) == (1e-5, 2000, 5000)  # the recipe's, and --steps
  assert (data.seq_len, data.batch_size) == (4096, 16)
  assert capsys.readouterr().out == ""  # nothing adapted, nothing to say


def test_a_short_run_keeps_the_recipes_warmup_and_never_reaches_the_peak(capsys):
  _, _, optim, _, _ = parse("--model=llama13b", "--steps=20")
  assert (optim.warmup_steps, optim.decay_steps) == (2000, 0)  # the ramp only: no decay
  notes = capsys.readouterr().out.splitlines()
  assert notes == ["note: --steps=20 ends within the 2000 warmup steps: the learning rate rises to 2.85e-06 by the "
                   "last step (0.9% of the peak 0.0003) and no decay follows, the first 20 steps of a long run's "
                   "schedule (--warmup_steps, --decay_steps set them)"]
  for steps in (2001, 3999, 4000, 10_000):  # longer than the warmup: the recipe's warmup, then a decay over the rest
    _, _, optim, _, _ = parse("--model=llama13b", f"--steps={steps}")
    assert (optim.warmup_steps, optim.decay_steps) == (2000, steps)
  assert capsys.readouterr().out == ""
  _, _, optim, _, _ = parse("--model=llama13b", "--steps=5", "--warmup_steps=2")  # the user's warmup stands
  assert (optim.warmup_steps, optim.decay_steps) == (2, 5)


@pytest.mark.parametrize("model", ["llama13b", "opt-13b"])
def test_a_short_runs_rates_are_the_first_steps_of_the_long_runs(model, capsys):
  """The smoke run (20 steps) follows the recipe's warmup ramp: each update's rate is that of the same update of a
  100,000-step run, at most 1% of the peak; the old rule (warmup over half the run) reached the peak at update 11."""
  short, long = (learning_rate_schedule(parse(f"--model={model}", f"--steps={steps}")[2]) for steps in (20, 100_000))
  peak = RECIPES[model].optim.learning_rate
  rates = [float(short(n)) for n in range(20)]  # update n + 1 runs at rate(n)
  np.testing.assert_allclose(rates, [float(long(n)) for n in range(20)], rtol=1e-6)
  np.testing.assert_allclose(rates, [peak * n / 2000 for n in range(20)], rtol=1e-4)  # fp32 arithmetic
  assert max(rates) < 0.01 * peak
  long_cfg = parse(f"--model={model}", "--steps=100000")[2]  # a long run: warmup, then the decay to the floor
  assert (long_cfg.warmup_steps, long_cfg.decay_steps) == (2000, 100_000)
  np.testing.assert_allclose([float(long(n)) for n in (1000, 2000, 100_000, 200_000)],
                             [peak / 2, peak, 0.1 * peak, 0.1 * peak], rtol=1e-5)


def test_a_library_request_gets_the_decisions_and_lines_of_its_flags(capsys):
  from_flags = parse("--model=llama13b", "--steps=5", "--b2=0.99", "--seq_len=1024")
  printed = capsys.readouterr().out
  request = Request(LaunchConfig(model="llama13b"), RunConfig(steps=5), data={"seq_len": 1024},
                           optim={"b2": 0.99})
  assert launch.resolve(request) == from_flags and capsys.readouterr().out == printed
  assert "note: --steps=5 ends within the 2000 warmup steps" in printed
  with pytest.raises(ValueError, match=r"^give --model or --hf_dir \(whose config.json names the model\), not both$"):
    LaunchConfig(model="llama7b", hf_dir="Llama-2-7b-hf")
  with pytest.raises(ValueError, match="^--engine must be one of 'auto', 'device', 'offload', got 'gpu'$"):
    LaunchConfig(engine="gpu")


def test_a_model_without_a_preset_takes_its_familys_nearest_recipe():
  assert recipe_for(PRESETS["opt-2.7b"]) == "opt-2.7b" and recipe_for(PRESETS["llama70b"]) == "llama70b"
  assert recipe_for(PRESETS["llama-tiny"]) == "llama-tiny"


BAD_NUMBERS = {
    "learning_rate must be positive and finite, got nan": ["--learning_rate=nan"],
    "learning_rate must be positive and finite, got inf": ["--learning_rate=inf"],
    "learning_rate must be positive and finite, got -0.1": ["--learning_rate=-0.1"],
    "b1 must lie in [0, 1), got 1.0": ["--b1=1"],
    "b2 must lie in [0, 1), got nan": ["--b2=nan"],
    "eps must be finite and >= 0, got -1e-08": ["--eps=-1e-8"],
    "weight_decay must be finite and >= 0, got inf": ["--weight_decay=inf"],
    "grad_clip_norm must be finite and >= 0 (0: off), got nan": ["--grad_clip_norm=nan"],
    "min_lr_ratio must lie in [0, 1], got nan": ["--min_lr_ratio=nan"],
    "--device_memory_gib must be a number of GiB >= 0 (0: the default), got -1.0": ["--device_memory_gib=-1"],
    "--host_memory_gib must be a number of GiB >= 0 (0: the default), got nan": ["--host_memory_gib=nan"],
    "moments_dtype must be float32, bfloat16 (a float dtype) or int8, got 'foo'": ["--moments_dtype=foo"],
    "--sub_batches shape the offload engine's step, but the auto engine chose the on-device step": ["--sub_batches=2"],
    "--live_layers shape the offload engine's step, but --engine=device runs the on-device step": [
        "--engine=device", "--live_layers=1"],
    "--target=h200 plans for a machine this is not: use it with --plan": ["--target=h200"],
    "--parked_grads_dtype=bfloat16 narrows the gradients that wait for clipping's global norm, but --grad_clip_norm=0 "
    "parks none": ["--engine=offload", "--parked_grads_dtype=bfloat16", "--grad_clip_norm=0"],
    "--parked_grads_dtype=bfloat16 shape the offload engine's step, but --engine=device runs the on-device step": [
        "--engine=device", "--parked_grads_dtype=bfloat16"],
}


@pytest.mark.parametrize("message", BAD_NUMBERS)
def test_bad_numbers_are_refused_in_one_line_before_anything_runs(tmp_path, message):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train.py", f"--workdir={tmp_path / 'run'}", "--max_tokens=20000", *BAD_NUMBERS[message]])
  with pytest.raises(SystemExit) as exit_:
    train.run()
  text = str(exit_.value)
  assert text.startswith("sljax: ") and message in text and "\n" not in text, text
  assert not (tmp_path / "run").exists()


def test_host_memory_flag_is_checked_before_the_pinned_pool_is_set(monkeypatch):
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train.py", "--host_memory_gib=-3"])
  with pytest.raises(SystemExit, match="^sljax: --host_memory_gib must be"):
    train.main(["train.py"])
  assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" not in os.environ
