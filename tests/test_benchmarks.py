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
