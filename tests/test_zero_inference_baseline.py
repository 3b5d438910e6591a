"""benchmarks.baselines.zero_inference_generate: the arithmetic that decides which ZeRO-Inference configurations fit
the H200 machine, the smoke run without DeepSpeed (CI has none) and, where DeepSpeed is installed
(benchmarks/baselines/install_deepspeed.sh), the real path on tiny models on the CPU."""

import importlib.util
import json
import subprocess
import sys

import pytest

from models.presets import get_config

from helpers import REPO

MODULE = "benchmarks.baselines.zero_inference_generate"
GIB = 2**30


def run(tmp_path, *args: str, timeout: int = 60) -> dict:
  """Runs the baseline as a module from the repository root; its results JSON."""
  out = tmp_path / "result.json"
  done = subprocess.run([sys.executable, "-m", MODULE, f"--out={out}", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return json.loads(out.read_text())


def by_bits(result: dict) -> dict:
  return {w["weight_bits"]: w for w in result["weight_formats"]}


@pytest.mark.slow
def test_plan_keeps_only_int4_weights_within_the_h200_machines_128_gib(tmp_path):
  """ZeRO-3 param offload pins every parameter on the host: the 16-bit models (138 and 131 GB) cannot fit, so their
  configurations are never started; int4 (about 0.56 bytes per quantized weight) can, and so can an offloaded KV
  cache until its power-of-two pinned blocks outgrow the RAM."""
  plan = run(tmp_path, "--plan_only", "--kv_offload_batches=64,256")
  assert plan["status"] == "plan only" and plan["host_memory_bytes"] == 128 * GIB
  models = {r["model"]: r for r in plan["results"]}
  for name in ("llama70b", "opt-66b"):
    exact, int4 = by_bits(models[name])[16], by_bits(models[name])[4]
    assert exact["host_partition_bytes"] == 2 * get_config(name).param_count()
    assert not exact["feasible"] and exact["host_needed_bytes"] > 128 * GIB and "pinned host memory" in exact["reason"]
    assert int4["feasible"] and 0.28 < int4["host_partition_bytes"] / exact["host_partition_bytes"] < 0.30
    assert int4["host_partition_bytes"] <= int4["host_pinned_bytes"] < int4["host_needed_bytes"] < 64 * GIB
    for entry in (e for e in models[name]["sweep"] if not e["kv_offload"]):
      assert entry["status"].startswith("infeasible") == (entry["weight_bits"] == 16), entry
  offloaded = {e["batch"]: e for e in models["llama70b"]["sweep"] if e["weight_bits"] == 4 and e["kv_offload"]}
  assert offloaded[64]["status"] == "plan only" and offloaded[256]["status"].startswith("infeasible: host memory")
  # 256 rows x 8 KV heads x 128 x 2 bytes per position: 256 MiB blocks for the prompt's 512, 512 MiB after that
  assert offloaded[256]["host_kv_pinned_bytes"] == 80 * 2 * (256 + 512) * 2**20


@pytest.mark.slow
def test_smoke_without_deepspeed_writes_the_plan_and_says_generation_was_not_run(tmp_path):
  if importlib.util.find_spec("deepspeed"):
    pytest.skip("DeepSpeed is importable here: test_smoke_runs_zero_inference_on_tiny_models runs the real path")
  result = run(tmp_path, "--smoke")
  assert result["status"].startswith("not run: deepspeed is not importable") and result["smoke"]
  assert result["command"].startswith(f"python -m {MODULE} ")
  for model in result["results"]:
    assert all(w["feasible"] for w in model["weight_formats"])
    assert {e["status"] for e in model["sweep"]} == {result["status"]}


@pytest.mark.slow
def test_smoke_runs_zero_inference_on_tiny_models(tmp_path):
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only where install_deepspeed.sh ran (not in CI)")
  result = run(tmp_path, "--smoke", timeout=600)
  assert result["versions"]["deepspeed"]
  for model in result["results"]:
    planned = by_bits(model)
    for process in model["processes"]:  # the arithmetic counts what DeepSpeed partitions, tensor for tensor
      assert process["status"] == "done" and process["ended"] is None, process
      assert process["build"]["host_partition_bytes"] == planned[process["weight_bits"]]["host_partition_bytes"]
      assert process["build"]["quantized_tensors"] == planned[process["weight_bits"]]["quantized_tensors"]
    for entry in model["sweep"]:
      if entry["kv_offload"]:  # transformers' offloaded cache needs CUDA
        assert entry["status"].startswith("not run"), entry
      else:
        assert entry["status"] == "ok" and entry["generated_shape"] == [entry["batch"], 16 + 4], entry
        assert entry["generation_tokens_per_s"] > 0
    assert model["best_exact"]["weight_bits"] == 16 and model["best_compressed"]["weight_bits"] == 4
    assert sum(bool(e.get("best_compressed")) for e in model["sweep"]) == 1
