"""LoRA from the command line: train.py --lora_rank fine-tunes adapters on a frozen Hugging Face base, checkpoints
only them (and where the base is), resumes bit for bit and refuses to resume on another base; generate.py
--lora_checkpoint generates from the merged model; sljax.export writes it for transformers."""

import json
import os
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models.hf import HFWeights, load_hf
from models.presets import build
import sljax.metrics
from sljax.checkpoint import newest_checkpoint, read_manifest
from sljax.generate import SamplingConfig, generate_on_device
from sljax.lora.checkpoint import open_checkpoint, read_adapters
from sljax.lora.engine import lora_flops_per_token
from sljax.lora.model import LoraModel, join_adapters, merge
from sljax.export import ExportConfig, export
from sljax.optim import OptimConfig, make_optimizer

from helpers import generate_cases, rewrite_in_layer_groups, run_train, tensorboard_scalars

LORA = ["--set=dtype=float32", "--seq_len=16", "--batch_size=4", "--max_tokens=20000", "--warmup_steps=1",
        "--decay_steps=4", "--log_every=1", "--checkpoint_every=1", "--learning_rate=1e-2", "--lora_rank=4",
        "--lora_targets=q_proj,v_proj", "--lora_targets=down_proj",  # a comma list and a repeated flag
        "--live_layers=1", "--tail_layers=1"]  # one layer a group, the last too: the first layer is recomputed
PEAK_FLOPS = 1e9  # the trained fixture's device peak, so that the CPU run logs MFU and HFU


class Trained(NamedTuple):
  hf_dir: str
  workdir: str
  history: dict


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
  """A tiny transformers LLaMA as the base, and two LoRA steps on it (checkpoints at steps 1 and 2)."""
  root = tmp_path_factory.mktemp("lora")
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
  model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():  # far from a fresh init, so that a mis-read base cannot pass for it
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(root / "hf")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sljax.metrics, "peak_flops", lambda device=None: PEAK_FLOPS)
    history = run_train(f"--hf_dir={root / 'hf'}", f"--workdir={root / 'run'}", *LORA, "--steps=2")
  return Trained(str(root / "hf"), str(root / "run"), history)


def files_under(directory) -> dict[str, int]:
  return {os.path.join(d, name): os.path.getsize(os.path.join(d, name))
          for d, _, names in os.walk(directory) for name in names}


@pytest.mark.slow
def test_lora_run_trains_only_the_adapters_and_resumes_bit_for_bit(tmp_path, trained):
  uninterrupted = run_train(f"--hf_dir={trained.hf_dir}", f"--workdir={tmp_path / 'one'}", *LORA, "--steps=4")
  assert uninterrupted[4] < uninterrupted[1] - 0.05, uninterrupted
  shutil.copytree(trained.workdir, tmp_path / "two")
  resumed = run_train(f"--hf_dir={trained.hf_dir}", f"--workdir={tmp_path / 'two'}", *LORA, "--steps=4")
  assert sorted(resumed) == [3, 4]
  assert [trained.history[n] for n in (1, 2)] + [resumed[n] for n in (3, 4)] == [uninterrupted[n] for n in range(1, 5)]
  one, two = (open_checkpoint(str(tmp_path / name)) for name in ("one", "two"))
  for a, b in zip(*(sorted(read_adapters(c).items()) for c in (one, two))):
    for leaf in ("lora_a", "lora_b"):
      np.testing.assert_array_equal(a[1][leaf], b[1][leaf])
  assert sorted(read_adapters(one)) == ["down_proj", "q_proj", "v_proj"]

  # The checkpoint holds the adapters, their optimizer state and the step; the base only as a pointer.
  state = read_manifest(os.path.join(one.step_dir, "state"))
  assert {entry["path"][0] for entry in state["arrays"]} == {"step", "adapters", "opt"}
  assert one.meta["lora"] == {"rank": 4, "alpha": 16.0, "targets": ["q_proj", "v_proj", "down_proj"],
                              "base_bits": 0, "base": {"hf_dir": os.path.abspath(trained.hf_dir)}, "format": 2}


@pytest.mark.slow
def test_tensorboard_has_mfu_without_the_recompute_and_hfu_with_it(trained):
  """One layer a group: the first of the base's two layers recomputes its forward in the backward, the last does not.
  Each log window's mfu is its tokens/s x lora_flops_per_token's model FLOPs over the peak, hfu with hardware FLOPs."""
  cfg, _ = load_hf(trained.hf_dir, dtype="float32")
  flops = lora_flops_per_token(LoraModel(build(cfg), open_checkpoint(trained.workdir).lora), 16, recomputed_layers=1)
  scalars = tensorboard_scalars(trained.workdir)
  assert sorted(scalars["tokens_per_s"]) == [1, 2]
  for step, tokens_per_s in scalars["tokens_per_s"].items():
    assert scalars["mfu"][step] == pytest.approx(tokens_per_s * flops.model / PEAK_FLOPS, rel=1e-5)
    assert scalars["hfu"][step] == pytest.approx(tokens_per_s * flops.hardware / PEAK_FLOPS, rel=1e-5)
  assert flops.hardware > flops.model


@pytest.mark.slow
def test_lora_over_a_data_mesh_trains_as_on_one_device_and_resumes(tmp_path, trained):
  """--mesh=data:2: each device holds the whole base and adapters and takes half of each batch's rows. Its losses
  are the one-device run's (the fixture's; fp32, 1e-5); its checkpoint resumes on the mesh, and so does the one-device
  run's, to the same next step."""
  mesh = [f"--hf_dir={trained.hf_dir}", *LORA, "--mesh=data:2"]
  history = run_train(f"--workdir={tmp_path / 'mesh'}", *mesh, "--steps=2")
  np.testing.assert_allclose([history[n] for n in (1, 2)], [trained.history[n] for n in (1, 2)], rtol=1e-5)
  resumed = run_train(f"--workdir={tmp_path / 'mesh'}", *mesh, "--steps=3")
  shutil.copytree(trained.workdir, tmp_path / "one")
  from_one_device = run_train(f"--workdir={tmp_path / 'one'}", *mesh, "--steps=3")
  assert sorted(resumed) == sorted(from_one_device) == [3]
  assert from_one_device[3] == pytest.approx(resumed[3], rel=1e-5)
  for a, b in zip(*(sorted(read_adapters(open_checkpoint(str(tmp_path / name))).items()) for name in ("mesh", "one"))):
    for leaf in ("lora_a", "lora_b"):
      # Within 1e-5 of the leaf's largest: the two step-2 states differ by fp32 rounding, which the third step's Adam
      # update amplifies most in the smallest elements (on an AVX-512 CPU: 7.7e-7 in an element of 0.024, the leaf's
      # largest 0.18), past an absolute 1e-7.
      np.testing.assert_allclose(a[1][leaf], b[1][leaf], rtol=1e-5, atol=1e-5 * np.max(np.abs(b[1][leaf])))


@pytest.mark.slow
def test_a_checkpoint_of_adapters_in_layer_groups_resumes_under_other_groups_as_a_stacked_one(tmp_path, trained):
  """Format 1 (no lora.format in the metadata): the fixture's newest checkpoint as an older sljax wrote it, its
  adapters and their optimizer state a list of layer groups of one layer. It exports the adapters saved, and resumes
  under other groups (a tail of both layers) as the stacked checkpoint does, bit for bit, into stacked checkpoints."""
  stacked, grouped = tmp_path / "stacked", tmp_path / "grouped"
  for workdir in (stacked, grouped):
    shutil.copytree(trained.workdir, workdir)
  optim = OptimConfig(**newest_checkpoint(str(stacked))[1]["optim"])
  step_dir = rewrite_in_layer_groups(str(grouped), make_optimizer(optim), [1, 1])
  assert {tuple(entry["path"][:2]) for entry in read_manifest(os.path.join(step_dir, "state"))["arrays"]
          if entry["path"][0] == "adapters"} == {("adapters", 0), ("adapters", 1)}
  assert open_checkpoint(str(grouped)).format == 1 and open_checkpoint(str(stacked)).format == 2
  saved = [read_adapters(open_checkpoint(str(workdir))) for workdir in (stacked, grouped)]
  jax.tree.map(np.testing.assert_array_equal, *saved)
  other_groups = [*(flag for flag in LORA if not flag.startswith(("--live_layers", "--tail_layers"))),
                  "--tail_layers=2"]
  runs = [run_train(f"--hf_dir={trained.hf_dir}", f"--workdir={workdir}", *other_groups, "--steps=3")
          for workdir in (stacked, grouped)]
  assert sorted(runs[0]) == [3] and runs[1] == runs[0]
  resumed = [open_checkpoint(str(workdir)) for workdir in (stacked, grouped)]
  assert resumed[1].format == 2
  jax.tree.map(np.testing.assert_array_equal, *(read_adapters(checkpoint) for checkpoint in resumed))


@pytest.mark.slow
def test_an_unknown_adapter_layout_is_refused_in_one_line_before_anything_is_written(tmp_path, trained):
  """A resume and an export (generate.py opens the checkpoint as the export does) refuse a checkpoint whose
  lora.format this sljax does not read."""
  workdir = tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
  step_dir, meta = newest_checkpoint(str(workdir))
  meta["lora"]["format"] = 3
  with open(os.path.join(step_dir, "meta", "metadata"), "w") as f:
    json.dump(meta, f)
  before = files_under(workdir)
  line = (f"checkpoint {step_dir} holds LoRA adapters in layout 3 (its metadata's lora.format), which this sljax does "
          f"not read (it reads 1 and 2): read it with the sljax that wrote it, or train afresh in another --workdir")
  with pytest.raises(SystemExit) as info:
    run_train(f"--hf_dir={trained.hf_dir}", f"--workdir={workdir}", *LORA, "--steps=3")
  assert str(info.value) == f"sljax: {line}"
  with pytest.raises(ValueError) as info:
    export(ExportConfig(checkpoint=str(workdir), out=str(tmp_path / "merged")))
  assert str(info.value) == line
  assert files_under(workdir) == before and not (tmp_path / "merged").exists()


@pytest.mark.slow
def test_a_resume_on_another_base_or_lora_config_is_refused_before_anything_is_written(tmp_path, trained):
  shutil.copytree(trained.hf_dir, tmp_path / "copy")
  step_dir, _ = newest_checkpoint(trained.workdir)
  before = files_under(trained.workdir)
  lora = [flag for flag in LORA if not flag.startswith("--lora_rank")]
  refusals = {  # flags -> the start of the one line
      (f"--hf_dir={tmp_path / 'copy'}", *LORA):
          f"sljax: checkpoint {step_dir} holds LoRA adapters of another base or config than this run's (base "
          f"{os.path.abspath(trained.hf_dir)} saved, {tmp_path / 'copy'} asked): resume with the saved ones",
      ("--set=num_layers=2", *LORA):
          f"sljax: checkpoint {step_dir} holds LoRA adapters of another base or config than this run's (base "
          f"{os.path.abspath(trained.hf_dir)} saved, a random base of seed 0 asked)",
      (f"--hf_dir={trained.hf_dir}", *lora, "--lora_rank=8"):
          f"sljax: checkpoint {step_dir} holds LoRA adapters of another base or config than this run's (rank 4 "
          f"saved, 8 asked)",
      (f"--hf_dir={trained.hf_dir}", *LORA, "--base_bits=4"):
          f"sljax: checkpoint {step_dir} holds LoRA adapters of another base or config than this run's (base_bits "
          f"unquantized saved, int4 asked)",
      (f"--hf_dir={trained.hf_dir}", *[flag for flag in lora
                                        if not flag.startswith(("--lora", "--live_layers", "--tail_layers"))]):
          f"sljax: checkpoint {step_dir} holds another training state than this run's",
  }
  for args, line in refusals.items():
    with pytest.raises(SystemExit) as info:
      run_train(f"--workdir={trained.workdir}", *args, "--steps=3")
    assert str(info.value).startswith(line) and "\n" not in str(info.value), info.value
  assert files_under(trained.workdir) == before


BAD_FLAGS = {  # flags -> the one line's message
    "LoRA rank must be >= 1, got 0": ["--lora_rank=0"],
    "no Dense module of the layers is named query (LoRA targets q_proj, query): the layers' are ":
        ["--lora_rank=4", "--lora_targets=q_proj,query"],
    "--lora_alpha shape LoRA fine-tuning: add --lora_rank": ["--lora_alpha=8"],
    "--base_bits shape LoRA fine-tuning: add --lora_rank": ["--base_bits=4"],
    "--base_bits must be 8 or 4 (0: the base unquantized), got 16": ["--lora_rank=4", "--base_bits=16"],
    "--engine=offload shape full training; --lora_rank fine-tunes through the LoRA engine": ["--lora_rank=4",
                                                                                          "--engine=offload"],
    "--mesh=data:2,fsdp:2 shape full training; --lora_rank fine-tunes through the LoRA engine, on one device or data "
    "parallel (--mesh=data:N, the whole frozen base on every device)": ["--lora_rank=4", "--mesh=data:2,fsdp:2"],
    "--parked_grads_dtype=bfloat16 shape full training": ["--lora_rank=4", "--parked_grads_dtype=bfloat16"],
}


@pytest.mark.parametrize("message", BAD_FLAGS)
def test_bad_lora_flags_exit_with_one_line_before_the_workdir_exists(tmp_path, message):
  with pytest.raises(SystemExit) as info:
    run_train(f"--workdir={tmp_path / 'run'}", "--seq_len=16", "--batch_size=2", "--max_tokens=2000",
                     *BAD_FLAGS[message])
  assert str(info.value).startswith(f"sljax: {message}") and "\n" not in str(info.value), info.value
  assert not (tmp_path / "run").exists()


# generate.py's flags clash with train.py's in one process: its cases run in one other process (generate_cases).


def merged_params(trained: Trained):
  """(model config, the base's params with the newest checkpoint's adapters merged, the base's params)."""
  checkpoint = open_checkpoint(trained.workdir)
  cfg, base = load_hf(trained.hf_dir, dtype="float32")
  layers = merge(checkpoint.lora, join_adapters(base["layers"], read_adapters(checkpoint)))
  return cfg, {"outer": base["outer"], "layers": layers}, base


@pytest.mark.slow
def test_generate_with_the_lora_checkpoint_is_generating_from_the_merged_params(tmp_path, trained):
  prompts = ["Hi there", "abc", "The end"]
  (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
  (tmp_path / "empty").mkdir()
  shutil.copytree(trained.hf_dir, tmp_path / "moved")
  args = [f"--prompt_file={tmp_path / 'prompts.txt'}", "--max_new_tokens=4", "--batch=3", "--live_layers=1",
          "--resident_layers=1"]
  cases = [[f"--lora_checkpoint={trained.workdir}", *args],
           [f"--lora_checkpoint={trained.workdir}", f"--hf_dir={tmp_path / 'moved'}", *args],
           [f"--lora_checkpoint={trained.workdir}", "--random_weights", *args],
           [f"--lora_checkpoint={tmp_path / 'empty'}", *args]]
  result = generate_cases(cases)
  assert result.returncode == 0, result.stderr
  named, moved, two_sources, empty = json.loads(result.stdout.splitlines()[-1])

  cfg, params, base = merged_params(trained)
  assert np.abs(params["layers"]["q_proj"]["kernel"] - base["layers"]["q_proj"]["kernel"]).max() > 1e-3
  want = generate_on_device(build(cfg), params, [list(p.encode()) for p in prompts], SamplingConfig(max_new_tokens=4))
  assert [r["tokens"] for r in named["records"]] == want.tokens.tolist()
  assert moved == named
  assert two_sources["exit"] == "sljax: give one weight source, not --random_weights and --lora_checkpoint"
  assert empty["exit"] == f"sljax: {tmp_path / 'empty'} holds no checkpoint"


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_lora_models_logits(tmp_path, trained):
  # One layer per shard (the model is tiny): written a shard at a time, read back through the index.
  cfg = export(ExportConfig(checkpoint=trained.workdir, out=str(tmp_path / "merged"), shard_gib=1e-9))
  with open(tmp_path / "merged" / "model.safetensors.index.json") as f:
    shards = set(json.load(f)["weight_map"].values())
  assert len(shards) == cfg.num_layers + 1 and shards == {p.name for p in (tmp_path / "merged").glob("*.safetensors")}
  assert HFWeights(str(tmp_path / "merged")).cfg == HFWeights(trained.hf_dir).cfg  # the base's architecture
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
  tokens_BxS = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
  with torch.no_grad():
    got_BxSxV = reloaded.eval()(torch.from_numpy(tokens_BxS)).logits.numpy()

  checkpoint = open_checkpoint(trained.workdir)
  _, base = load_hf(trained.hf_dir, dtype="float32")
  model = LoraModel(build(cfg), checkpoint.lora)  # the adapters applied as they were trained, not merged
  outer, layers = base["outer"], join_adapters(base["layers"], read_adapters(checkpoint))
  want_BxSxV = model.logits(outer, model.layers(layers, model.embed(outer, jnp.asarray(tokens_BxS, jnp.int32))))
  np.testing.assert_allclose(got_BxSxV, want_BxSxV, rtol=0, atol=1e-4)
  with pytest.raises(ValueError, match="exists and is not an empty directory"):
    export(ExportConfig(checkpoint=trained.workdir, out=str(tmp_path / "merged")))
