"""Offloaded generation must equal the plain all-on-device loop, and its prompt logits Hugging Face's."""

import collections
import functools
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.hf import HFWeights, load_hf
from models.presets import build, get_config
from sljax import generate as gen
from sljax import quant
from sljax.checkpoint import Checkpointer, restore_params
from sljax.generate import OffloadConfig, OffloadedGenerator, SamplingConfig, generate_on_device
from sljax import generate_plan as gen_plan
from sljax.generate_plan import layout_footprint, plan
from sljax.machines import GIB
from sljax.memory import HOST, tree_bytes

from helpers import REPO, generate_cases

TINY = {
    "llama": dict(family="llama", num_layers=4, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                  max_positions=64, dtype="float32", attention="xla"),
    "opt": dict(family="opt", num_layers=4, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=4,
                max_positions=64, dtype="float32", attention="xla"),
}


@functools.cache
def _setup(family: str):
  """(model, params, prompts of 1..9 tokens for 4 rows) of a tiny fp32 model, built once."""
  model = build(get_config("llama-tiny", TINY[family]))
  params = jax.jit(model.init)(jax.random.key(0, impl="rbg"))  # rbg: XLA:CPU compiles it faster than threefry
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(1, 256, n)) for n in (5, 1, 9, 3)]  # uneven: rows are left-padded
  return model, params, prompts


@functools.cache
def _reference(family: str, sampling: SamplingConfig) -> np.ndarray:
  model, params, prompts = _setup(family)
  return generate_on_device(model, params, prompts, sampling).tokens


@st.composite
def offloads(draw):
  num_layers = TINY["llama"]["num_layers"]
  return OffloadConfig(sub_batches=draw(st.sampled_from([1, 2, 4])), live_layers=draw(st.integers(1, num_layers)),
                       resident_layers=draw(st.integers(0, num_layers)), kv_on_host=draw(st.booleans()))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "opt"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offload=offloads())
def test_offloaded_greedy_tokens_equal_the_on_device_loop(family, offload):
  model, params, prompts = _setup(family)
  sampling = SamplingConfig(max_new_tokens=5)
  generator = OffloadedGenerator(model, offload)
  got = generator.generate(generator.load(params), prompts, sampling)
  np.testing.assert_array_equal(got.tokens, _reference(family, sampling))
  assert list(got.lengths) == [5] * 4


def test_sampling_and_stop_tokens_equal_the_on_device_loop():
  model, params, prompts = _setup("llama")
  generator = OffloadedGenerator(model, OffloadConfig(sub_batches=2, live_layers=3, resident_layers=1))
  weights = generator.load(params)
  sampled = SamplingConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=7)
  np.testing.assert_array_equal(generator.generate(weights, prompts, sampled).tokens, _reference("llama", sampled))

  greedy = _reference("llama", SamplingConfig(max_new_tokens=6))
  stop = int(greedy[0, 2])  # row 0 stops at its third token; other rows at their first `stop`, if any
  stopping = SamplingConfig(max_new_tokens=6, stop_tokens=(stop,), pad_token=-1)
  got = generator.generate(weights, prompts, stopping)
  np.testing.assert_array_equal(got.tokens, generate_on_device(model, params, prompts, stopping).tokens)
  for row, length in enumerate(got.lengths):
    hits = np.flatnonzero(greedy[row] == stop)
    assert length == (hits[0] + 1 if len(hits) else 6)
    np.testing.assert_array_equal(got.tokens[row, :length], greedy[row, :length])
    assert (got.tokens[row, length:] == -1).all()


@pytest.mark.slow
def test_a_batch_of_uneven_prompts_equals_each_prompt_alone():
  model, params, prompts = _setup("opt")
  sampling = SamplingConfig(max_new_tokens=4)
  batched = _reference("opt", sampling)
  for row, prompt in enumerate(prompts):
    np.testing.assert_array_equal(generate_on_device(model, params, [prompt], sampling).tokens[0], batched[row])


@pytest.mark.slow
def test_init_equals_load_of_model_init():
  model, _, _ = _setup("opt")
  generator = OffloadedGenerator(model, OffloadConfig(live_layers=3, resident_layers=1))
  key = jax.random.key(3)  # threefry: rbg's bits may change with the shape of a vmapped draw
  made, loaded = generator.init(key), generator.load(jax.jit(model.init)(key))
  for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(loaded)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@settings(max_examples=50, deadline=None)
@given(layers=st.integers(1, 90), resident=st.data(), live=st.integers(1, 4))
def test_resident_groups_are_spread_among_the_streamed_ones(layers, resident, live):
  r = resident.draw(st.integers(0, layers))
  groups, flags = gen.layer_groups(layers, r, live)
  assert [a for a, _ in groups] == [0] + [b for _, b in groups[:-1]] and groups[-1][1] == layers  # in order, all
  assert all(0 < b - a <= live for a, b in groups)
  assert sum(b - a for (a, b), flag in zip(groups, flags) if flag) == r
  n, k = len(flags), sum(flags)
  for prefix in range(n + 1):  # every prefix holds its share of the resident groups, to within one
    assert abs(sum(flags[:prefix]) - prefix * k / n) < 1


def test_weights_and_kv_cache_live_where_the_config_says():
  model, params, prompts = _setup("llama")
  kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
  for kv_on_host, cache_kind in ((True, HOST), (False, "device")):
    generator = OffloadedGenerator(model, OffloadConfig(sub_batches=2, live_layers=2, resident_layers=2,
                                                        kv_on_host=kv_on_host))
    weights = generator.load(params)
    assert [kinds(group) for group in weights["groups"]] == [{HOST}, {"device"}]
    assert kinds(weights["outer"]) == {"device"}
    tokens_BxP, start_B = gen.left_pad(prompts, pad_token=0)
    passes = gen._OffloadedPasses(generator, weights, start_B, max_len=16)
    passes(tokens_BxP, 0)
    assert kinds(passes.caches) == {cache_kind}
    k_LxBxTxKxH = passes.caches[0][1][0]  # group 0, sub-batch 1: one contiguous array for its rows
    assert k_LxBxTxKxH.shape == (2, 2, 16, 2, 8)


def _hf_model(family: str, seed: int):
  torch.manual_seed(seed)
  if family == "llama":
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.OPTConfig(
        vocab_size=96, hidden_size=32, ffn_dim=40, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, attn_implementation="eager")
    model = transformers.OPTForCausalLM(config)
  with torch.no_grad():
    for p in model.parameters():  # nonzero biases and non-unit norms, so a mis-mapped tensor cannot hide
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_prompt_logits_match_transformers(tmp_path, family):
  torch_model = _hf_model(family, seed=2)
  torch_model.save_pretrained(tmp_path)
  cfg, params = load_hf(tmp_path, dtype="float32", param_dtype="float32", attention="xla")
  model = build(cfg)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, cfg.vocab_size, n) for n in (7, 2, 11, 4)]
  with torch.no_grad():  # each prompt alone, unpadded
    want_BxV = np.stack([torch_model(torch.from_numpy(p)[None]).logits[0, -1].numpy() for p in prompts])

  generator = OffloadedGenerator(model, OffloadConfig(sub_batches=2, live_layers=2, resident_layers=1))
  np.testing.assert_allclose(generator.prompt_logits(generator.load(params), prompts), want_BxV, rtol=0, atol=1e-4)

  # Read lazily, one group at a time, the same weights land in the same places.
  reader, asked = HFWeights(tmp_path, dtype="float32", param_dtype="float32", attention="xla"), []
  layers = reader.layers
  reader.layers = lambda a, b: asked.append((a, b)) or layers(a, b)
  lazily, eagerly = generator.load(reader), generator.load(params)
  assert asked == generator.groups
  for got, want in zip(jax.tree.leaves(lazily), jax.tree.leaves(eagerly)):
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  # Every position of the prompt's pass through the cache, as the model sees it.
  tokens_BxS = np.stack([p[:2] for p in prompts])
  start_B = np.zeros(4, np.int32)
  h_BxSxD, _ = model.layers_cached(params["layers"], model.embed(params["outer"], tokens_BxS),
                                   model.init_cache(cfg.num_layers, 4, 5), 0, start_B)
  with torch.no_grad():
    want_BxSxV = torch_model(torch.from_numpy(tokens_BxS)).logits.numpy()
  np.testing.assert_allclose(model.logits(params["outer"], h_BxSxD), want_BxSxV, rtol=0, atol=1e-4)


def test_sample_keeps_only_the_top_p_nucleus():
  logits_BxV = np.log(np.array([[0.1, 0.6, 0.2, 0.1]] * 256, np.float32))
  key = jax.random.key(0)
  assert set(np.asarray(gen.sample(logits_BxV, key, 1.0, 0.5))) == {1}
  assert set(np.asarray(gen.sample(logits_BxV, key, 1.0, 0.75))) == {1, 2}
  assert set(np.asarray(gen.sample(logits_BxV, key, 1.0, 1.0))) == {0, 1, 2, 3}
  assert set(np.asarray(gen.sample(logits_BxV, key, 0.0, 1.0))) == {1}


def test_plan_fits_the_budgets_and_streams_what_does_not_fit():
  cfg = get_config("llama70b", dict(dtype="bfloat16", param_dtype="bfloat16"))
  device, host = 120 * GIB, 100 * GIB
  chosen = plan(cfg, 512, 32, device, host)
  o = chosen.offload
  assert chosen.device_bytes <= device and chosen.host_bytes <= host
  assert layout_footprint(cfg, o, chosen.batch, 512, 544) == chosen.footprint
  assert 0 < o.resident_layers < cfg.num_layers  # 138 GB of weights: some layers must stream
  assert chosen.batch % o.sub_batches == 0
  layer_bytes = cfg.layer_param_count() * 2
  cache_bytes = cfg.num_layers * chosen.batch * 544 * 2 * cfg.kv_heads * cfg.head_dim * 2
  assert chosen.decode.host_to_device == (cfg.num_layers - o.resident_layers) * layer_bytes + o.kv_on_host * cache_bytes
  assert "streamed from pinned host" in chosen.describe(cfg)

  fixed = plan(cfg, 512, 32, device, host, batch=32, sub_batches=2, kv_on_host=True)
  assert (fixed.batch, fixed.offload.sub_batches, fixed.offload.kv_on_host) == (32, 2, True)
  # A model that fits leaves everything on the device and moves nothing.
  tiny = plan(get_config("llama-tiny"), 16, 8, GIB, GIB, batch=4)
  assert tiny.offload.resident_layers == 4 and tiny.decode_bytes_per_token == 0


@pytest.mark.parametrize("streamed_bits", [4, 16])
def test_fixing_the_batch_a_free_search_chose_gives_its_layout(streamed_bits):
  """generate.py searches batches up to its prompts; a benchmark at the batch it chose must plan the same layout (a
  3% tie-break over every batch's layouts at once once picked 16 sub-batches there and 8 here: 5% slower on the
  H200)."""
  from sljax.machines import MACHINES
  h200, cfg = MACHINES["h200"], get_config("llama70b", dict(dtype="bfloat16"))
  free = plan(cfg, 511, 32, *gen_plan.memory_budgets(h200), max_batch=128, streamed_bits=streamed_bits, target=h200)
  fixed = plan(cfg, 511, 32, *gen_plan.memory_budgets(h200), batch=free.batch, streamed_bits=streamed_bits,
               target=h200)
  assert fixed.offload == free.offload and fixed.batch == free.batch


PLAN_ERRORS = {
    r"does not fit: .* needs [\d.]+ GiB of device memory \(16.00 available\) and [\d.]+ GiB of pinned host":
        dict(device_budget=16 * GIB, host_budget=8 * GIB),
    "batch 6 does not split into 4 equal sub-batches": dict(batch=6, sub_batches=4),
    "exceed the model's 4096 positions": dict(new_tokens=4000),
    "resident_layers must be in 0..80": dict(resident_layers=81),
    "streamed_bits must be one of 16, 8, 4, got 3": dict(streamed_bits=3),
}


@pytest.mark.parametrize("message", PLAN_ERRORS)
def test_plan_refuses_what_cannot_run(message):
  args = dict(model=get_config("llama70b", dict(dtype="bfloat16")), prompt_len=512, new_tokens=32,
              device_budget=120 * GIB, host_budget=100 * GIB)
  with pytest.raises(ValueError, match=message):
    plan(**{**args, **PLAN_ERRORS[message]})


def test_generator_refuses_bad_requests():
  model, params, prompts = _setup("llama")
  with pytest.raises(ValueError, match="resident_layers 5 exceeds the model's 4 layers"):
    OffloadedGenerator(model, OffloadConfig(resident_layers=5))
  generator = OffloadedGenerator(model, OffloadConfig(sub_batches=3))
  with pytest.raises(ValueError, match="4 prompts do not split into 3 equal sub-batches"):
    generator.generate(generator.load(params), prompts, SamplingConfig(max_new_tokens=2))
  with pytest.raises(ValueError, match="the model takes at most 64 positions"):
    generate_on_device(model, params, prompts, SamplingConfig(max_new_tokens=60))
  with pytest.raises(ValueError, match="every prompt needs at least one token"):
    generate_on_device(model, params, [[1], []], SamplingConfig())
  with pytest.raises(ValueError, match="top_p must be in"):
    SamplingConfig(top_p=0.0)


def test_params_restore_from_both_training_states(tmp_path):
  model, params, _ = _setup("opt")
  two_groups = [jax.tree.map(lambda x: x[a:b], params["layers"]) for a, b in ((0, 3), (3, 4))]
  states = {"device": {"params": params, "opt_state": {"mu": params}},
            "offload": {"outer": params["outer"], "groups": [{"master": g, "opt": g} for g in two_groups]}}
  for name, state in states.items():
    checkpointer = Checkpointer(str(tmp_path / name / "checkpoints"), save_every=1)
    checkpointer.save(1, state, {"model": "tiny"})
    checkpointer.close()
    restored = restore_params(str(tmp_path / name))
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
      assert isinstance(a, np.ndarray)
      np.testing.assert_array_equal(a, np.asarray(b))


TRAINING = ("sljax.plan", "sljax.schedule", "sljax.trainer", "sljax.optim", "sljax.launch", "sljax.request",
            "sljax.resume", "sljax.steps", "sljax.lora.engine", "sljax.lora.plan", "sljax.cli.train")
# generate.py loaded as `python generate.py` loads it, short of running main; and the export.
INFERENCE = ("import runpy, sys, sljax.export; runpy.run_path('generate.py', run_name='not_main'); "
             "print(' '.join(sys.modules))")


def test_inference_imports_nothing_of_training():
  """generate.py (the generator, its planner, the readers of checkpoints and of LoRA adapters, the merge) and
  sljax.export stand on their own: in a fresh process they load no training module."""
  loaded = set(subprocess.run([sys.executable, "-c", INFERENCE], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.split())
  assert {"sljax.generate_launch", "sljax.generate_plan", "sljax.lora.checkpoint", "sljax.export"} <= loaded
  assert not set(TRAINING) & loaded, sorted(set(TRAINING) & loaded)


def _cli(*args):
  return subprocess.run([sys.executable, "generate.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_generates_one_json_line_per_prompt_and_plans(tmp_path):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("def fib(n):\n\nHello, world\nimport os\n")  # the blank line is skipped
  tiny = ["--set=num_layers=2", "--set=hidden_size=32", "--set=intermediate_size=48", "--set=num_heads=2",
          "--set=num_kv_heads=1", "--set=dtype=float32"]
  result = _cli("--random_weights", *tiny, f"--prompt_file={prompts}", "--max_new_tokens=4", "--batch=2",
                "--sub_batches=2", "--resident_layers=1", "--kv_on_host")
  assert result.returncode == 0, result.stderr
  records = [json.loads(line) for line in result.stdout.splitlines()]
  assert [r["prompt"] for r in records] == ["def fib(n):", "Hello, world", "import os"]
  assert all(len(r["tokens"]) == 4 and isinstance(r["completion"], str) for r in records)

  result = _cli("--model=llama70b", "--set=dtype=bfloat16", "--prompt_len=512", "--plan", "--device_memory_gib=120",
                "--host_memory_gib=100")
  assert result.returncode == 0, result.stderr
  assert "streamed from pinned host" in result.stdout and "per generated token" in result.stdout


@pytest.mark.slow
def test_cli_reads_hf_weights_and_matches_the_on_device_loop(tmp_path):
  torch.manual_seed(4)
  config = transformers.LlamaConfig(  # the CLI's default tokenizer is bytes: 256 tokens
      vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
  transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
  prompts = ["Hi there", "abc", "The end", "0123"]
  (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
  result = _cli(f"--hf_dir={tmp_path / 'hf'}", "--set=dtype=float32", f"--prompt_file={tmp_path / 'prompts.txt'}",
                "--max_new_tokens=3", "--batch=4", "--sub_batches=2", "--resident_layers=1", "--live_layers=1")
  assert result.returncode == 0, result.stderr
  got = [json.loads(line)["tokens"] for line in result.stdout.splitlines()]

  cfg, params = load_hf(tmp_path / "hf", dtype="float32", param_dtype="float32")
  want = generate_on_device(build(cfg), params, [list(p.encode()) for p in prompts], SamplingConfig(max_new_tokens=3))
  assert got == want.tokens.tolist()


CLI_ERRORS = {
    "give --prompt_file": [],
    "give one weight source, not --hf_dir and --random_weights": ["--random_weights", "--hf_dir=x", "--plan",
                                                                    "--prompt_len=8"],
    "needs 0.0": ["--plan", "--prompt_len=8", "--device_memory_gib=0.00001"],
    "unknown model field 'num_wings'": ["--set=num_wings=2"],
}


@pytest.mark.slow
def test_bad_requests_are_one_line_each():
  result = generate_cases(list(CLI_ERRORS.values()))  # one process for all: a process each costs 5 s on 2 cores
  assert result.returncode == 0, result.stderr
  for message, outcome in zip(CLI_ERRORS, json.loads(result.stdout.splitlines()[-1]), strict=True):
    line = outcome.get("exit", "")
    assert line.startswith("sljax: ") and message in line and "\n" not in line, (message, outcome)


@pytest.mark.slow
def test_cli_bad_requests_exit_with_one_line():
  """What the command line adds to a refusal, the same for every one: main() and absl make it one stderr line and
  a non-zero exit."""
  message = "give --prompt_file"
  result = _cli(*CLI_ERRORS[message])
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("sljax:")]
  assert len(errors) == 1 and message in errors[0], result.stderr
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize("bits", [8, 4])
def test_compressed_streamed_weights_cross_fewer_bytes_and_stay_close_to_the_exact_logits(bits):
  model, params, prompts = _setup("llama")
  layout = dict(sub_batches=2, live_layers=1, resident_layers=1)
  exact, packed = (OffloadedGenerator(model, OffloadConfig(**layout, streamed_bits=b)) for b in (16, bits))
  want = exact.prompt_logits(exact.load(params), prompts)
  weights = packed.load(params)
  resident = [g for g, flag in enumerate(packed.resident) if flag]
  for g in resident:  # resident_bits stays 16: those layers are the exact ones
    for a, b in zip(jax.tree.leaves(weights["groups"][g]), jax.tree.leaves(exact.load(params)["groups"][g])):
      np.testing.assert_array_equal(a, b)
  before = {engine: dict(engine.place.moved) for engine in (exact, packed)}
  got = packed.prompt_logits(weights, prompts)
  exact.prompt_logits(exact.load(params), prompts)
  crossed = {e: e.place.moved["host_to_device"] - before[e]["host_to_device"] for e in (exact, packed)}
  # Streamed kernels: bits / 32 of the fp32 bytes plus a float16 scale per column of each 32- or 48-row group.
  assert crossed[packed] < (0.31 if bits == 8 else 0.19) * crossed[exact]
  error = np.max(np.abs(got - want))
  assert 0 < error < (0.02 if bits == 8 else 0.3) * np.max(np.abs(want))


@pytest.mark.slow
def test_compressed_generation_is_the_exact_generation_of_the_dequantized_weights(monkeypatch):
  """Compression changes the weights and nothing else: a generator keeping int4 / int8 kernels (dequantized once per
  pass for all sub-batches) gives bit for bit the logits of the exact generator on the dequantized weights."""
  model, params, prompts = _setup("opt")
  calls = []
  monkeypatch.setattr(gen, "_dequantize", lambda tree, dtype, dequantize=gen._dequantize: calls.append(1) or
                      dequantize(tree, dtype))
  layout = dict(sub_batches=2, live_layers=1, resident_layers=1, streamed_bits=4, resident_bits=8,
                weight_group_size=16)
  packed = OffloadedGenerator(model, OffloadConfig(**layout))
  weights = packed.load(params)
  dequantized = [quant.dequantize_layers(group, model.cfg.dtype) for group in weights["groups"]]
  exact = OffloadedGenerator(model, OffloadConfig(**dict(layout, streamed_bits=16, resident_bits=16)))
  plain = exact.load({"outer": params["outer"], "layers": jax.tree.map(lambda *xs: np.concatenate(xs), *dequantized)})
  np.testing.assert_array_equal(packed.prompt_logits(weights, prompts), exact.prompt_logits(plain, prompts))
  assert len(calls) == len(packed.groups)  # once per group for the pass, not once per sub-batch
  calls.clear()
  one_part = OffloadedGenerator(model, OffloadConfig(**dict(layout, sub_batches=1)))
  np.testing.assert_array_equal(one_part.prompt_logits(weights, prompts), exact.prompt_logits(plain, prompts))
  assert len(calls) == len(packed.groups)  # a prompt's pass of one call per group dequantizes apart too


@pytest.mark.parametrize("streamed_bits", [16, 4])
def test_decoding_with_the_cache_on_the_device_runs_all_rows_in_one_call_per_group(monkeypatch, streamed_bits):
  """The prompt's pass runs in sub-batches; then their caches are joined and each decode pass makes one call per
  group for every row, compressed kernels dequantized inside it, with the logits of the cache kept per sub-batch."""
  model, params, prompts = _setup("llama")
  calls = collections.Counter()
  for name in ("_dequantize", "_layers"):
    monkeypatch.setattr(gen, name, lambda *args, name=name, real=getattr(gen, name): calls.update([name]) or
                        real(*args))
  layout = dict(sub_batches=2, live_layers=1, resident_layers=2, streamed_bits=streamed_bits, weight_group_size=16)
  joined, apart = (OffloadedGenerator(model, OffloadConfig(**layout, kv_on_host=on_host)) for on_host in (False, True))
  weights = joined.load(params)
  tokens_BxP, start_B = gen.left_pad(prompts, pad_token=0)
  logits = {}
  for generator in (joined, apart):
    passes = gen._OffloadedPasses(generator, weights, start_B, max_len=12)
    first = passes(tokens_BxP, 0)
    calls.clear()
    logits[generator] = [first, passes(np.argmax(first, axis=-1)[:, None].astype(np.int32), 9)]
    if generator is joined:
      assert calls == {"_layers": len(generator.groups)}  # one call per group, no separate dequantize
      assert [len(parts) for parts in passes.caches] == [1] * len(generator.groups)
      assert passes.caches[0][0][0].shape == (1, 4, 12, 2, 8)  # [L, B, T, K, H]: all four rows
    else:
      assert calls["_layers"] == 2 * len(generator.groups)
      assert calls["_dequantize"] == (4 - 2 if streamed_bits < 16 else 0)  # the streamed groups, once each
  for a, b in zip(logits[joined], logits[apart]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compressed_init_equals_compressed_load_of_model_init():
  model, _, _ = _setup("opt")
  generator = OffloadedGenerator(model, OffloadConfig(live_layers=2, resident_layers=1, streamed_bits=4,
                                                      resident_bits=8))
  key = jax.random.key(3)
  made, loaded = generator.init(key), generator.load(jax.jit(model.init)(key))
  assert jax.tree.structure(made) == jax.tree.structure(loaded)
  for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(loaded)):
    assert a.dtype == b.dtype and a.sharding.memory_kind == b.sharding.memory_kind
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-3, atol=1e-3)


def test_weight_bits_other_than_16_8_4_are_refused():
  with pytest.raises(ValueError, match="streamed_bits must be one of 16, 8, 4, got 2"):
    OffloadConfig(streamed_bits=2)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_plan_counts_compressed_layers_at_the_bytes_the_generator_stores(bits):
  model, params, _ = _setup("llama")
  cfg = model.cfg
  offload = OffloadConfig(live_layers=1, resident_layers=1, streamed_bits=bits, resident_bits=8)
  weights = OffloadedGenerator(model, offload).load(params)
  streamed = [tree_bytes(group) for group, flag in zip(weights["groups"], gen.layer_groups(4, 1, 1)[1]) if not flag]
  assert streamed == [gen_plan.stored_layer_bytes(cfg, bits, 128)] * 3
  resident = tree_bytes(weights["groups"][gen.layer_groups(4, 1, 1)[1].index(True)])
  assert resident == gen_plan.stored_layer_bytes(cfg, 8, 128) < gen_plan.stored_layer_bytes(cfg, 16, 128)
  exact = OffloadConfig(live_layers=1, resident_layers=1)
  held = lambda o: layout_footprint(cfg, o, 4, 8, 16).host_bytes
  assert held(offload) == held(exact) - 3 * (
      gen_plan.stored_layer_bytes(cfg, 16, 128) - streamed[0])
  llama70b = get_config("llama70b", {"dtype": "bfloat16"})
  kept = {b: plan(llama70b, 512, 32, 130 * GIB, 94 * GIB, streamed_bits=b, resident_bits=b).offload.resident_layers
          for b in (16, bits)}
  assert kept[bits] > kept[16]  # smaller resident layers: more of them fit on the device


@pytest.mark.parametrize("name", ["llama70b", "opt-350m"])
def test_generation_sizes_from_shapes_are_the_presets_own_numbers(name):
  """Read from the params' shapes and one traced layer, a preset's sizes are its config's: its plans are what they
  were when the planner read the config's fields (grouped-query attention; OPT-350m's narrower embeddings)."""
  cfg = get_config(name, dict(dtype="bfloat16"))
  sizes = gen_plan.generation_sizes(cfg)
  assert (sizes.layer_params, sizes.layer_bytes, sizes.outer_bytes, sizes.kv_bytes_per_token) == (
      cfg.layer_param_count(), 2 * cfg.layer_param_count(), 2 * cfg.outer_param_count(),
      2 * cfg.kv_heads * cfg.head_dim * 2)
  assert (sizes.hidden, sizes.heads, sizes.ffn, sizes.head_flops_per_token) == (
      cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, 2 * cfg.vocab_size * cfg.embed_dim)


@pytest.mark.parametrize("offload", [
    OffloadConfig(sub_batches=2, live_layers=1, resident_layers=4),  # every layer on the device, and the cache
    OffloadConfig(sub_batches=2, live_layers=1, resident_layers=1, kv_on_host=True),  # streamed, the cache on host
    pytest.param(OffloadConfig(sub_batches=2, live_layers=2, resident_layers=0, streamed_bits=4, weight_group_size=16),
                 marks=pytest.mark.slow),
])
def test_live_bytes_after_every_dispatch_stay_within_the_plan(monkeypatch, offload):
  """What a generation holds, per memory kind, after each of its calls and transfers, against what its plan says
  (less the compiled calls' scratch, which no live array shows, and the GPU margin, which a CPU plan leaves none of)."""
  from sljax import footprint as core
  model, params, prompts = _setup("llama")
  sampling = SamplingConfig(max_new_tokens=6)
  prompt_len = max(map(len, prompts))
  chosen = plan(model, prompt_len, sampling.max_new_tokens, GIB, GIB, batch=len(prompts),
                sub_batches=offload.sub_batches, live_layers=offload.live_layers,
                resident_layers=offload.resident_layers, kv_on_host=offload.kv_on_host,
                streamed_bits=offload.streamed_bits, weight_group_size=offload.weight_group_size)
  assert chosen.offload == offload and chosen.footprint.device[core.MARGIN] == 0
  params = jax.tree.map(np.array, params)  # owned by numpy: on CPU a jax array's numpy view keeps the array alive
  earlier = {id(x) for x in jax.live_arrays()}
  peaks = {"device": 0, HOST: 0}

  def observe():
    live = [x for x in jax.live_arrays() if not x.is_deleted() and id(x) not in earlier]
    for kind in peaks:
      # Bytes as stored (int4 codes: two to a byte), not x.nbytes (one per int4 element).
      peaks[kind] = max(peaks[kind], tree_bytes([x for x in live if x.sharding.memory_kind == kind]))

  def observed(fn):
    def call(*args, **kwargs):
      out = fn(*args, **kwargs)
      observe()
      return out
    return call

  for name in ("_embed", "_layers", "_dequantize", "_concat_rows", "_last_logits", "_next_tokens"):
    monkeypatch.setattr(gen, name, observed(getattr(gen, name)))
  generator = OffloadedGenerator(model, offload)
  object.__setattr__(generator.place, "_put", observed(generator.place._put))  # every transfer
  weights = generator.load(params)
  generator.generate(weights, prompts, sampling)
  unseen = chosen.footprint.device[core.SCRATCH]
  assert 0 < peaks["device"] <= chosen.device_bytes - unseen, (peaks, chosen.footprint)
  assert peaks[HOST] <= chosen.host_bytes, (peaks, chosen.footprint)


def test_a_plan_for_a_gpu_leaves_the_cores_margin_and_takes_its_rates():
  """--target: the target's budget and rates (sljax.footprint), the one GPU margin unplanned; a CPU plan none."""
  from sljax import footprint as core
  from sljax.machines import MACHINES, target_budget
  cfg = get_config("llama70b", dict(dtype="bfloat16"))
  h200, a100 = MACHINES["h200"], MACHINES["a100-80gb"]
  here = plan(cfg, 512, 32, 120 * GIB, 100 * GIB, batch=8)
  there = plan(cfg, 512, 32, *gen_plan.memory_budgets(h200), batch=8, target=h200)
  slow = plan(cfg, 512, 32, *gen_plan.memory_budgets(h200), batch=8, target=a100, resident_layers=40)
  assert here.footprint.device[core.MARGIN] == 0
  assert there.footprint.device[core.MARGIN] == core.GPU_MARGIN_BYTES
  assert there.budget.device_bytes == target_budget(h200).device_bytes
  assert there.device_bytes <= there.budget.device_bytes
  same = plan(cfg, 512, 32, *gen_plan.memory_budgets(h200), batch=8, target=h200, resident_layers=40)
  assert slow.decode.seconds > same.decode.seconds  # the A100 copies at half the H200's rate
