"""The benchmarks' smoke modes: each runs its code path on tiny shapes (their numbers come from the GPU)."""

import json
import subprocess
import sys

from test_train import REPO


def test_checkpoint_scale_smoke_resumes_with_the_uninterrupted_losses(tmp_path):
  out = tmp_path / "result.json"
  subprocess.run([sys.executable, "benchmarks/checkpoint_scale.py", "--smoke", f"--out={out}",
                  f"--workdir={tmp_path / 'checkpoints'}"], cwd=REPO, check=True, capture_output=True)
  result = json.loads(out.read_text())
  assert result["losses_equal"] and result["first_step_after_restore_equal"] and result["restored_step"] == 3
  assert set(result["peak_host_extra_gib"]) == {"save", "restore"} and result["save_seconds"] > 0


def test_train_py_run_smoke_reads_the_plan_windows_and_every_loss(tmp_path):
  out = tmp_path / "result.json"
  subprocess.run([sys.executable, "benchmarks/train_py_run.py", "--smoke", f"--out={out}"], cwd=REPO, check=True,
                 capture_output=True)
  result = json.loads(out.read_text())
  assert result["returncode"] == 0 and result["plan"].startswith("plan for llama-tiny")
  assert len(result["losses"]) == 12 and all(loss > 0 for loss in result["losses"])
  assert [w["last_step"] for w in result["windows"]] == [1, 4, 8, 12] and result["tokens_per_s_steady"] > 0
  assert (out.with_suffix(".log")).read_text().count("loss ") > 0
