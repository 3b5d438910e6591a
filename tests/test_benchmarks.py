"""The benchmarks' smoke modes: each runs its code path on tiny shapes (their numbers come from the GPU), as a module
from the repository root, the way the docstrings say to run them."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(module: str, tmp_path, *args: str) -> dict:
  """Runs `python -m benchmarks.<module> --smoke --out=... args`; its results JSON."""
  out = tmp_path / "result.json"
  done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", f"--out={out}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return json.loads(out.read_text())


def has_provenance(result: dict, module: str) -> bool:
  return (result["command"].startswith(f"python -m benchmarks.{module} --smoke") and result["date"]
          and result["versions"]["jax"] and "XLA_PYTHON_CLIENT_MEM_FRACTION" in result["env"])


def test_train_throughput_smoke_runs_the_per_micro_batch_baseline(tmp_path):
  result = smoke("train_throughput", tmp_path, "--cases=fits", "--fits_cases=per_micro_batch", "--steps=1")
  assert has_provenance(result, "train_throughput") and result["device"] == "cpu"
  (case,) = result["results"]
  assert case["case"] == "fits/per_micro_batch" and case["tokens_per_s"] > 0 and case["losses"][0] > 0


def test_generate_throughput_smoke_streams_and_counts_the_bytes(tmp_path):
  result = smoke("generate_throughput", tmp_path, "--models=llama70b")
  assert has_provenance(result, "generate_throughput")
  (run,) = result["results"]
  assert run["generation_tokens_per_s"] > 0 and run["counted_bytes_moved"]["host_to_device"] > 0
  assert run["config"]["plan"]["offload"]["kv_on_host"]


def test_train_scaling_smoke_runs_fsdp_over_two_devices(tmp_path):
  result = smoke("train_scaling", tmp_path, "--cases=fsdp", "--steps=1")
  assert has_provenance(result, "train_scaling") and result["devices"] == 8
  (case,) = result["results"]
  assert case["mesh"] == {"data": 1, "fsdp": 2} and case["bytes_per_step"]["between_devices"] > 0


def test_trace_overlap_smoke_finds_the_copies_hidden_by_compute_and_the_idle_gaps(tmp_path):
  result = smoke("trace_overlap", tmp_path)
  assert result["copy_hidden_fraction"] == pytest.approx(60 / 80) and result["span_s"] == pytest.approx(400e-6)
  assert result["compute_fraction_of_span"] == pytest.approx(0.5) and result["idle_s"] == pytest.approx(200e-6)
  assert result["idle_gaps_over_100us"] == 1
  assert result["largest_idle_gaps"] == [{"ms": pytest.approx(0.15), "at_ms": pytest.approx(0.2)},
                                         {"ms": pytest.approx(0.05), "at_ms": pytest.approx(0.1)}]


def test_kernel_ceiling_smoke_times_the_three_kernels(tmp_path):
  result = smoke("kernel_ceiling", tmp_path)
  assert has_provenance(result, "kernel_ceiling") and result["model"] == "llama13b"
  assert all(result[f"{kernel}_ms"] > 0 and len(result["ms_all"][kernel]) == result["repeats"]
             for kernel in ("forward", "recompute_backward", "residuals_kept"))
  # Four layers x four sub-batches of each kernel make the step.
  assert result["step_s_full_recompute"] == pytest.approx(
      16e-3 * (result["forward_ms"] + result["recompute_backward_ms"]))
  assert 0 < result["ceiling_mfu_full_recompute"] < result["ceiling_hfu_full_recompute"]
  assert result["ceiling_mfu_full_recompute"] < result["ceiling_mfu_residuals_kept"]  # one forward fewer


def test_checkpoint_scale_smoke_resumes_with_the_uninterrupted_losses(tmp_path):
  result = smoke("checkpoint_scale", tmp_path, f"--workdir={tmp_path / 'checkpoints'}")
  assert result["losses_equal"] and result["first_step_after_restore_equal"] and result["restored_step"] == 3
  assert set(result["peak_host_extra_gib"]) == {"save", "restore"} and result["save_seconds"] > 0


def test_train_py_run_smoke_reads_the_plan_windows_and_every_loss(tmp_path):
  result = smoke("train_py_run", tmp_path)
  assert result["returncode"] == 0 and result["plan"].startswith("plan for llama-tiny")
  assert result["command"].startswith("python train.py --model=llama-tiny") and result["versions"]["jax"]
  assert len(result["losses"]) == 12 and all(loss > 0 for loss in result["losses"])
  assert [w["last_step"] for w in result["windows"]] == [1, 4, 8, 12] and result["tokens_per_s_steady"] > 0
  assert (tmp_path / "result.log").read_text().count("loss ") > 0


def test_deepspeed_baseline_smoke_on_torch_fsdp(tmp_path):
  """The baseline's PyTorch FSDP2 backend needs only the CPU torch of requirements.txt."""
  result = smoke("baselines.deepspeed_zero3", tmp_path, "--backend=fsdp_cpu_offload")
  assert result["status"] == "ok" and len(result["step_s"]) == 2 and result["versions"]["torch"]


def test_deepspeed_baseline_smoke_on_deepspeed(tmp_path):
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only on the GPU machine (install_deepspeed.sh)")
  result = smoke("baselines.deepspeed_zero3", tmp_path)
  assert result["status"] == "ok" and result["backend"] == "deepspeed"


def test_vs_deepspeed_smoke_reports_both_systems_and_their_ratio(tmp_path):
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only on the GPU machine (install_deepspeed.sh)")
  result = smoke("vs_deepspeed", tmp_path, "--models=fits")
  assert result["runs"]["fits"]["ratio_tokens_per_s"] > 0


def test_hf_accelerate_baseline_smoke(tmp_path):
  pytest.importorskip("accelerate", reason="accelerate is not in requirements.txt: the GPU machine's image has it")
  result = smoke("baselines.hf_accelerate_generate", tmp_path)
  assert result["result"]["generation_tokens_per_s"] > 0
