"""The FlexGen baseline: its sweep points, the memory it plans them by, and (where flexgen is installed, as on the GPU
machine through install_flexgen.sh) its smoke run of FlexGen's generation on the CPU."""

import json
import math
import subprocess
import sys

import pytest

from benchmarks.baselines import flexgen_generate as flexgen
from sljax.machines import GIB

from helpers import REPO

OPT_66B = flexgen.model_config("opt-66b", smoke=False)


def test_points_are_named_by_their_policy():
  point = flexgen.SweepPoint.parse("w85-c100-8x2")
  assert (point.weights_gpu_percent, point.cache_gpu_percent, point.batch, point.cpu_attention) == (85, 100, 16, False)
  assert flexgen.SweepPoint.parse("w100-c0-16x4-cpu_attention").cpu_attention
  for name in ["w100-c100-8x1", "w65-c100-10x4", "w100-c0-16x4-cpu_attention"]:
    assert flexgen.SweepPoint.parse(name).name == name
  for bad in ["w101-c100-8x1", "w100-c100-0x1", "w100-8x1", "w100-c100-8x1-disk"]:
    with pytest.raises(ValueError):
      flexgen.SweepPoint.parse(bad)


def test_only_flexgens_opt_shapes_are_accepted():
  with pytest.raises(ValueError, match="opt-350m"):
    flexgen.model_config("opt-350m", smoke=False)
  with pytest.raises(ValueError):
    flexgen.model_config("llama7b", smoke=False)
  assert flexgen.flexgen_fields(OPT_66B) == dict(num_hidden_layers=64, hidden_size=9216, input_dim=9216, n_head=72,
                                                 ffn_embed_dim=4 * 9216, vocab_size=50272, max_seq_len=2048)


def test_flexgens_own_opt_configs_are_sljaxs_presets():
  opt_config = pytest.importorskip("flexgen.opt_config", reason="FlexGen is installed only on the GPU machine")
  for name in ["opt-1.3b", "opt-66b"]:
    fields = flexgen.flexgen_fields(flexgen.model_config(name, smoke=False))
    assert {field: getattr(opt_config.get_opt_config(name), field) for field in fields} == fields


def test_weights_move_to_the_gpu_in_twelfths_of_a_decoder_layer():
  """Four equal attention matrices and two MLP ones, each placed by its midpoint: w85 leaves only the query projection
  on the CPU."""
  attention, mlp = flexgen.weight_shapes(OPT_66B)[1:3]
  assert flexgen.on_gpu(attention, 85)[::2][:4] == [False, True, True, True]
  assert flexgen.on_gpu(mlp, 85)[::2] == [True, True, True]
  layers = 2 * OPT_66B.num_layers * OPT_66B.layer_param_count()
  for percent, twelfths in [(100, 12), (90, 12), (85, 11), (65, 7), (50, 6), (0, 0)]:
    needed = flexgen.memory(OPT_66B, flexgen.SweepPoint(percent, 100, 1, 1), 512, 32)
    assert needed["weights_gpu_bytes"] + needed["weights_cpu_bytes"] == 2 * (
        OPT_66B.param_count() + OPT_66B.vocab_size * OPT_66B.hidden_size)  # its own copy of the output embedding
    embeddings = needed["weights_gpu_bytes"] + needed["weights_cpu_bytes"] - layers
    assert math.isclose(needed["weights_cpu_bytes"], layers * (12 - twelfths) / 12, rel_tol=1e-3,
                        abs_tol=embeddings)


def test_memory_counts_the_kv_cache_per_row_and_pinned_weights_as_allocated():
  per_row = 64 * 2 * (512 + 32 - 1) * 9216 * 2  # FlexGen's cache: prompt + new - 1 positions
  assert flexgen.memory(OPT_66B, flexgen.SweepPoint.parse("w100-c100-8x1"), 512, 32)["kv_cache_gpu_bytes"] == (
      8 * per_row)
  on_cpu = flexgen.memory(OPT_66B, flexgen.SweepPoint.parse("w100-c0-16x4-cpu_attention"), 512, 32)
  assert on_cpu["kv_cache_gpu_bytes"] == 0 and on_cpu["kv_cache_cpu_bytes"] == 64 * per_row
  # w85: the CPU keeps the 64 query projections (162 MiB each, in 256 MiB pinned blocks) and the final LayerNorm.
  w85 = flexgen.memory(OPT_66B, flexgen.SweepPoint.parse("w85-c100-8x2"), 512, 32)
  assert w85["weights_cpu_bytes"] == 64 * 9216 * 9216 * 2 + 2 * 9216 * 2
  assert w85["weights_pinned_bytes"] == 64 * 256 * 2**20 + 2 * 32 * 2**10
  assert w85["host_bytes"] == w85["weights_pinned_bytes"] + 4 * 2 * GIB  # and FlexGen's four copy threads' buffers


def test_the_default_opt66b_sweep_fits_the_h200_and_larger_points_are_refused():
  for name in flexgen.DEFAULT_SWEEPS["opt-66b"]:
    needed = flexgen.memory(OPT_66B, flexgen.SweepPoint.parse(name), 512, 32)
    assert not flexgen.over_budget(needed, 135 * GIB, 100 * GIB), name
  too_many_rows = flexgen.memory(OPT_66B, flexgen.SweepPoint.parse("w100-c100-16x1"), 512, 32)
  assert flexgen.over_budget(too_many_rows, 135 * GIB, 100 * GIB).startswith("GPU needs")
  half_on_cpu = flexgen.memory(OPT_66B, flexgen.SweepPoint.parse("w40-c100-4x1"), 512, 32)
  assert flexgen.over_budget(half_on_cpu, 135 * GIB, 100 * GIB).startswith("host needs")


def test_a_point_that_wrote_no_result_is_recorded_by_why():
  assert flexgen.failure(1, "torch.OutOfMemoryError: CUDA out of memory. Tried")["status"] == "out_of_memory"
  assert flexgen.failure(-9, "")["status"] == "killed"
  failed = flexgen.failure(1, "Traceback\n  ...\nKeyError: 'x'\n")
  assert failed["status"] == "failed" and failed["error"] == "KeyError: 'x'"


def test_smoke_runs_flexgens_generation_on_the_cpu(tmp_path):
  pytest.importorskip("flexgen", reason="FlexGen is installed only on the GPU machine (install_flexgen.sh)")
  out = tmp_path / "result.json"
  done = subprocess.run([sys.executable, "-m", "benchmarks.baselines.flexgen_generate", "--smoke", f"--out={out}"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["status"] == "ok" and result["versions"]["flexgen"] == "0.1.8" and result["command"].startswith(
      "python -m benchmarks.baselines.flexgen_generate --smoke")
  points = result["sweep"]
  assert [p["config"] for p in points] == flexgen.SMOKE_SWEEP and all(p["status"] == "ok" for p in points)
  assert [p["config"] for p in points if p["best"]] == [result["best"]] == [result["result"]["config"]]
  for point in points:
    assert point["generation_tokens_per_s"] > 0 and len(point["decode_step_seconds"]) == 3
    # The arithmetic's placement is FlexGen's own.
    assert point["weights_placed_bytes"] == {"gpu": point["estimated"]["weights_gpu_bytes"],
                                             "cpu": point["estimated"]["weights_cpu_bytes"]}
  assert points[1]["weights_placed_bytes"]["cpu"] > 0
  # Where the weights live changes how fast, not what is computed.
  assert points[0]["first_tokens"] == points[1]["first_tokens"]
