import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from sljax import metrics
from sljax.checkpoint import newest_checkpoint

from helpers import REPO, TINY, run_train, tensorboard_scalars, train_in_process


@pytest.mark.slow
def test_loss_falls_and_checkpoint_and_tensorboard_are_written(tmp_path):
  history = train_in_process(tmp_path, "--steps=40", "--checkpoint_every=25", "--learning_rate=1e-2")
  assert sorted(history) == list(range(1, 41))
  losses = np.array(list(history.values()))
  assert np.isfinite(losses).all()
  assert losses[:3].mean() > 5.0 and losses[-5:].mean() < 3.6, losses
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["25", "40"]
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


@pytest.mark.slow
def test_resumed_run_continues_the_step_count_and_matches_an_uninterrupted_run(tmp_path):
  schedule = ["--decay_steps=6", "--checkpoint_every=2"]
  uninterrupted = train_in_process(tmp_path / "one", "--steps=6", *schedule)
  first = train_in_process(tmp_path / "two", "--steps=3", *schedule)
  assert sorted(first) == [1, 2, 3]
  # As if the first run had died before its final save: resume from step 2, saved while the run went on.
  shutil.rmtree(tmp_path / "two" / "checkpoints" / "3")
  second = train_in_process(tmp_path / "two", "--steps=6", *schedule)
  assert sorted(second) == [3, 4, 5, 6]
  np.testing.assert_allclose([second[n] for n in (3, 4, 5, 6)], [uninterrupted[n] for n in (3, 4, 5, 6)],
                             rtol=1e-6)
  assert train_in_process(tmp_path / "two", "--steps=6", *schedule) == {}  # already done


def resume_from_step_2(uninterrupted, workdir):
  """`workdir`: the uninterrupted run's, as a run of its flags that stopped after step 2 left it (its schedule is
  --decay_steps', whatever --steps): its step-2 checkpoint the newest. Saves training those 2 steps again."""
  shutil.copytree(uninterrupted, workdir)
  for step in os.listdir(workdir / "checkpoints"):
    if step.isdigit() and int(step) > 2:
      shutil.rmtree(workdir / "checkpoints" / step)
  assert newest_checkpoint(str(workdir))[0].endswith(os.sep + "2")


@pytest.mark.slow
def test_a_checkpoint_fixes_no_placement_a_resume_runs_the_engine_its_own_request_and_plan_choose(tmp_path):
  """A checkpoint holds the model's master weights and optimizer state per layer (sljax.checkpoint_layout): the
  offload engine's, in layer groups of 1 and a tail of 1, resumes on the device engine that the auto engine chooses
  for this tiny model now, and that one's on the offload engine with a tail of both layers; the saved bf16 first
  moment is kept where the request leaves it open. In fp32: in bf16 the two engines' own runs differ by more."""
  schedule = ["--decay_steps=6", "--checkpoint_every=2", "--set=dtype=float32"]
  chosen = ["--engine=offload", "--sub_batches=2", "--live_layers=1", "--tail_layers=1", "--moments_dtype=bfloat16"]
  uninterrupted = train_in_process(tmp_path / "one", "--steps=6", "--keep_checkpoints=3", *schedule, *chosen)
  resume_from_step_2(tmp_path / "one", tmp_path / "two")
  on_device = train_in_process(tmp_path / "two", "--steps=4", *schedule)
  assert newest_checkpoint(str(tmp_path / "two"))[1]["optim"]["moments_dtype"] == "bfloat16"
  offloaded = train_in_process(tmp_path / "two", "--steps=6", *schedule, "--engine=offload", "--tail_layers=2")
  assert sorted(on_device) == [3, 4] and sorted(offloaded) == [5, 6]
  # Another engine sums in other orders: the same run to float rounding.
  np.testing.assert_allclose([on_device[3], on_device[4], offloaded[5], offloaded[6]],
                             [uninterrupted[n] for n in (3, 4, 5, 6)], rtol=1e-5)


@pytest.mark.slow
def test_a_resume_keeps_its_state_where_its_own_plan_puts_it(tmp_path, capsys):
  """Saved with every group's state on the device, a run resumed on a device with room for fewer keeps the state of
  as many as its own plan puts there (host groups get their compute copy rebuilt from the master weights), and
  continues the run."""
  steps = ["--set=num_layers=6", "--sub_batches=2", "--decay_steps=4", "--checkpoint_every=2", "--engine=offload",
           "--live_layers=1", "--tail_layers=1"]
  small = "--device_memory_gib=0.0042"  # the tiny model's state of 2 of its 6 groups on the device, by the plan
  uninterrupted = train_in_process(tmp_path / "one", "--steps=4", *steps)
  resume_from_step_2(tmp_path / "one", tmp_path / "two")
  capsys.readouterr()
  resumed = train_in_process(tmp_path / "two", "--steps=4", *steps, small)
  out = capsys.readouterr().out
  assert "2 group(s) keep master weights + optimizer state on the device" in out, out
  assert sorted(resumed) == [3, 4]
  np.testing.assert_allclose([resumed[3], resumed[4]], [uninterrupted[3], uninterrupted[4]], rtol=1e-6)


def test_a_run_shorter_than_the_warmup_trains(tmp_path, capsys):
  history = run_train(f"--workdir={tmp_path}", *[f for f in TINY if not f.startswith("--warmup_steps")], "--steps=5")
  assert sorted(history) == [1, 2, 3, 4, 5] and np.isfinite(list(history.values())).all()
  out = capsys.readouterr().out
  assert "note: --steps=5 ends within the 20 warmup steps" in out
  assert "recipe of llama-tiny (sljax's CPU recipe, flags applied): AdamW lr 0.003, 20 warmup, then constant" in out


# Parts of a plan's device tier that its compiled calls give (the GPU's, or on CPU an estimate of them, corrected
# by sljax.plan.gpu_peak_from_cpu): compared by their sum.
CALL_PARTS = ("compiled calls' scratch", "last group's residuals", "never together", "never beside")


def device_parts(plan: str) -> tuple[list[str], float]:
  """(The device tier's other parts as printed, the sum of its calls' parts) of a printed plan."""
  parts = next(line for line in plan.splitlines() if line.startswith("device:")).split(" GiB (", 1)[1].rstrip(")")
  named = re.findall(r"(.+?) (-?[\d.]+)(?:, |$)", parts)
  return ([f"{name} {value}" for name, value in named if not any(c in name for c in CALL_PARTS)],
          sum(float(value) for name, value in named if any(c in name for c in CALL_PARTS)))


def test_plan_for_a_target_gpu_made_on_cpu_is_the_gpus_own(capsys):
  """benchmarks/results/train_py_llama13b_plan_h200.json: the same command's --plan on the H200 itself (clipping
  off, fp32 moments, 85 GiB of pinned memory). Made on CPU for the H200, the plan places everything as the H200's
  own does, to the bytes of each tier but the compiled calls' parts, whose CPU estimate is within 0.5 GiB of the
  GPU's and not below it (2026-12-07, both made with the layer of now: 5.2 against 5.2 GiB)."""
  args = ["--model=llama13b", "--batch_size=32", "--seq_len=2048", "--grad_clip_norm=0", "--moments_dtype=float32",
          "--host_memory_gib=85", "--max_tokens=100000", "--plan"]
  assert run_train(*args, "--target=h200") == {}
  out = capsys.readouterr().out
  plan = out.split("plan for llama13b on one h200 (--target), batch 32 x 2048:\n")[1].split("\nstep time bound")[0]
  with open(os.path.join(REPO, "benchmarks", "results", "train_py_llama13b_plan_h200.json")) as f:
    gpu = json.load(f)
  # Made on the GPU itself: no --target in the command, none in the plan's heading.
  assert gpu["command"] == " ".join(["python train.py", *args])
  assert gpu["plan"].startswith("plan for llama13b, batch 32 x 2048:\n")
  gpu_plan = gpu["plan"].split(":\n", 1)[1].split("\nstep time bound")[0]
  others = lambda text: [line for line in text.splitlines() if not line.startswith("device:")]
  assert others(plan) == others(gpu_plan), out  # placement, the pinned host tier, bytes per step
  (here, here_calls), (there, there_calls) = device_parts(plan), device_parts(gpu_plan)
  assert here == there and there_calls <= here_calls <= there_calls + 0.5, out
  assert "replaced, awaiting their free 4.1)" in plan  # one host group's state and compute copy


def test_the_readme_commands_plan_for_a_target_gpu_made_on_cpu_is_the_gpus_own(capsys):
  """With clipping, the backward's compiled peak counts too (it runs beside the parked gradients): each call's peak
  is corrected by its own GPU/CPU ratio. With the last group's ratio for both, this plan kept 26 groups' state on
  the device where the H200's own keeps 27 (the big_clip row of benchmarks/results/train_throughput_h200.json).
  The H200's plan was printed when the last group ran as one call, its residuals in its scratch, and with the layer
  before (2026-12-03, whose compiled peaks were larger): the parts of the last group's calls (scratch, residuals and
  what they and the parked gradients never hold together) are compared by their sum, as in the test above: not below
  the GPU's, within 0.5 GiB of it (3.3 against 2.8 GiB); every other part as printed."""
  assert run_train("--model=llama13b", "--batch_size=32", "--max_tokens=100000", "--plan", "--target=h200") == {}
  out = capsys.readouterr().out
  # The H200's own plan of the README command, as it printed it (benchmarks.plan_vs_peak).
  with open(os.path.join(REPO, "benchmarks", "results", "plan_vs_peak_h200.json")) as f:
    gpu = next(case for case in json.load(f)["results"] if case["case"] == "llama13b_readme")["plan"]
  placement = [line for line in out.splitlines() if line.startswith("sub-batches")]
  here, here_calls = device_parts(out)
  there, there_calls = device_parts(f"device: x GiB ({gpu['device']['parts']})")
  assert "27 group(s)" in placement[0] and here == there and there_calls <= here_calls <= there_calls + 0.5 + 1e-9, out


@pytest.mark.slow
def test_profile_writes_a_trace(tmp_path):
  # The resumed runs' schedule (a schedule is compiled into the step): their compiled step serves this run too.
  train_in_process(tmp_path, "--steps=3", "--decay_steps=6", "--profile")
  assert glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)


BAD_REQUESTS = {
    "unknown model 'llama-nope'": ["--model=llama-nope"],
    "unknown model field 'num_wings'": ["--set=num_wings=2"],
    "override num_layers wants a int": ["--set=num_layers=two"],
    "batch_size must be positive": ["--batch_size=0"],
    "seq_len 4096 exceeds the model's max_positions 512": ["--seq_len=4096"],
    "GiB of device memory is needed": ["--model=llama70b"],  # too big even for the offload engine here
    "batch_size 6 is not divisible by 4 sub-batches": ["--engine=offload", "--batch_size=6", "--sub_batches=4"],
    "tokenizer file '/nonexistent/tokenizer.model' does not exist": ["--tokenizer=/nonexistent/tokenizer.model"],
    "TFDS dataset 'no_such_corpus' is not prepared": ["--data=no_such_corpus"],
    "workdir /dev/null/run cannot be created: /dev/null is not a directory": ["--workdir=/dev/null/run"],
    "/nonexistent is not a Hugging Face model directory: it has no config.json": ["--hf_dir=/nonexistent"],
    "give --model or --hf_dir (whose config.json names the model), not both": ["--model=llama7b", "--hf_dir=x"],
    "learning_rate must be positive and finite, got nan": ["--learning_rate=nan"],  # every bad number: test_recipes
    "--host_memory_gib must be a number of GiB >= 0 (0: the default), got -1.0": ["--host_memory_gib=-1"],
}


@pytest.mark.parametrize("message", BAD_REQUESTS)
def test_bad_requests_are_one_line_and_write_nothing(tmp_path, message):
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as info:  # and no other exception: the CLI prints this line alone, no traceback
    run_train(f"--workdir={workdir}", *BAD_REQUESTS[message])
  line = str(info.value)
  assert line.startswith("sljax: ") and message in line and "\n" not in line, line
  assert not workdir.exists()


# What the command line adds, the same for every refusal (a process each, 5 s on 2 cores): main() and absl make the
# SystemExit one stderr line and a non-zero exit. A refusal of main's own checks, before any device, and one of the
# plan's.
@pytest.mark.slow
@pytest.mark.parametrize("message", ["unknown model 'llama-nope'", "GiB of device memory is needed"])
def test_bad_requests_exit_the_cli_with_one_line_and_write_nothing(tmp_path, message):
  workdir = tmp_path / "run"
  result = subprocess.run([sys.executable, "train.py", f"--workdir={workdir}", *BAD_REQUESTS[message]], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("sljax:")]
  assert len(errors) == 1 and message in errors[0], result.stderr
  assert "Traceback" not in result.stderr
  assert not workdir.exists()


def test_a_missing_tensorboard_writer_is_refused_before_the_run(tmp_path, monkeypatch):
  find_spec = metrics.importlib.util.find_spec
  monkeypatch.setattr(metrics.importlib.util, "find_spec",
                      lambda name, *args: None if name == "tensorboardX" else find_spec(name, *args))
  with pytest.raises(SystemExit, match="^sljax: tensorboardX is not installed"):
    train_in_process(tmp_path / "run")
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("engine", [["--engine=device"], ["--engine=offload", "--sub_batches=2", "--live_layers=1"]],
                         ids=["device", "offload"])
def test_training_starts_from_hugging_face_weights(tmp_path, engine):
  import torch
  import transformers

  from models.hf import load_hf
  from models.presets import build
  from sljax.data import DataConfig, make_source

  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
  model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():  # far from a fresh init, whose loss is about ln(256) whatever its draw
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(tmp_path / "hf")
  history = run_train(f"--workdir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}", "--set=dtype=float32",
                      "--seq_len=32", "--batch_size=4", "--max_tokens=200000", "--log_every=1", "--steps=2",
                      "--warmup_steps=1", *engine)

  cfg, params = load_hf(tmp_path / "hf", dtype="float32")
  source = make_source(DataConfig(seq_len=32, batch_size=4, max_tokens=200000), cfg.max_positions, cfg.vocab_size)
  want = float(build(cfg).loss(params, source.batch(0)))
  assert abs(want - np.log(256)) > 0.1
  np.testing.assert_allclose(history[1], want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,local", [("data:1", 1), ("data:2", 2), ("data:2,fsdp:2", 4)])
def test_host_budget_is_split_among_the_process_devices(tmp_path, capsys, mesh, local):
  # Every device keeps its own share of the host-resident state (a whole copy under data parallel): one process's
  # --host_memory_gib must not be promised to each of its devices.
  # 8 rows per device: every mesh plans the same per-device step, compiled once (sljax.plan caches its peak).
  train_in_process(tmp_path, "--plan", "--engine=offload", f"--batch_size={8 * local}", f"--mesh={mesh}",
                   "--host_memory_gib=6")
  host_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pinned host:")]
  assert len(host_lines) == 1 and f" of {6 / local:.1f} GiB" in host_lines[0], host_lines


# ---- held-out evaluation: --eval_every, --eval_batches -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("engine", [[], ["--engine=offload", "--sub_batches=2", "--live_layers=1"]],
                         ids=["device", "offload-clipped"])
def test_eval_lines_are_the_models_loss_on_the_held_out_batches_of_the_saved_params(tmp_path, capsys, engine):
  """Every 2 steps (not at step 0) the mean loss of the same 2 held-out batches, in the loss log (lines marked
  "eval"), TensorBoard and the progress line; each equals model.loss on those batches of the params saved at that
  step (the offload engine clips: its parked updates are applied first)."""
  from models.presets import build, get_config
  from sljax.checkpoint import read_params
  from sljax.data import DataConfig, make_source

  workdir, log = tmp_path / "run", tmp_path / "losses.jsonl"
  history = train_in_process(workdir, "--steps=4", "--eval_every=2", "--eval_batches=2", "--checkpoint_every=2",
                             "--set=dtype=float32", f"--loss_log={log}", *engine)
  assert sorted(history) == [1, 2, 3, 4]
  rows = [json.loads(line) for line in open(log)]
  assert sorted(row["step"] for row in rows if "loss" in row) == [1, 2, 3, 4]
  evals = {row["step"]: row for row in rows if row.get("eval")}
  assert sorted(evals) == [2, 4] and all(np.isclose(row["eval_perplexity"], np.exp(row["eval_loss"]))
                                         for row in evals.values())
  scalars = tensorboard_scalars(workdir)
  assert scalars["eval_loss"] == pytest.approx({n: row["eval_loss"] for n, row in evals.items()}, rel=1e-6)
  assert set(scalars["eval_perplexity"]) == set(scalars["eval_seconds_per_batch"]) == {2, 4}
  assert f"| eval {evals[4]['eval_loss']:.3f}" in capsys.readouterr().err

  model = build(get_config("llama-tiny", [flag[len("--set="):] for flag in TINY if flag.startswith("--set=")]
                           + ["dtype=float32"]))
  batches = make_source(DataConfig(seq_len=32, batch_size=4, max_tokens=200000), model.cfg.max_positions,
                        held_out=True).eval_batches(2)
  for step in (4, 2):  # the newest checkpoint, then the one before it
    reader = read_params(str(workdir))
    params = {"outer": reader.outer(), "layers": reader.layers(0, reader.num_layers)}
    want = np.mean([float(model.loss(params, batch)) for batch in batches])
    np.testing.assert_allclose(evals[step]["eval_loss"], want, rtol=1e-6)
    shutil.rmtree(workdir / "checkpoints" / str(step))
  assert evals[4]["eval_loss"] != evals[2]["eval_loss"]


@pytest.mark.parametrize("flags,message", [
    (["--eval_every=-1"], "eval_every must be >= 0 (0: no evaluation), got -1"),
    (["--eval_every=2", "--eval_batches=0"], "eval_batches must be positive, got 0"),
    (["--eval_every=2", "--eval_batches=9000", "--eval_tokens=1000"],
     "--eval_batches=9000 of 4 x 32 tokens need 1152001 tokens of held-out text; stdlib's held-out slice has 1000"),
])
def test_bad_eval_requests_are_one_line_and_write_nothing(tmp_path, flags, message):
  with pytest.raises(SystemExit) as info:
    train_in_process(tmp_path / "run", *flags)
  assert str(info.value).startswith(f"sljax: {message}") and "\n" not in str(info.value), str(info.value)
  assert not (tmp_path / "run").exists()
