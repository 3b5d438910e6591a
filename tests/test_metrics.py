import glob
import subprocess
import sys
import types

import pytest

from models.presets import get_config
from sljax import metrics

from helpers import REPO


def device(kind):
  return types.SimpleNamespace(device_kind=kind)


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("cpu", None)])
def test_peak_flops_by_device_kind(kind, peak):
  assert metrics.peak_flops(device(kind)) == peak


def test_utilization_divides_flops_by_the_devices_peak():
  assert metrics.utilization(1000.0, 989e9, 1, device("NVIDIA H200")) == pytest.approx(1.0)
  assert metrics.utilization(1000.0, 989e9, 4, device("NVIDIA H200")) == pytest.approx(0.25)
  assert metrics.utilization(1000.0, 989e9, 1, device("cpu")) is None


def test_training_flops_add_a_layer_forward_per_recomputed_layer_to_hardware_flops_only():
  cfg = get_config("llama13b")
  none, all_but_one = metrics.training_flops(cfg, 2048, 0), metrics.training_flops(cfg, 2048, cfg.num_layers - 1)
  assert none.model == none.hardware == all_but_one.model == cfg.flops_per_token(2048)
  # A layer's forward: a third of the layers' training FLOPs (those less the head's 6 x vocab x width), per layer.
  layer_forward = (cfg.flops_per_token(2048) - 6 * cfg.vocab_size * cfg.embed_dim) / 3 / cfg.num_layers
  assert all_but_one.hardware - all_but_one.model == pytest.approx((cfg.num_layers - 1) * layer_forward)


def test_progress_description_names_mfu_and_hfu():
  assert (metrics.progress_description(2.5, 12345.6, 0.4, 0.52)
          == "loss 2.500 | 12,346 tok/s | MFU 40.0% | HFU 52.0%")
  assert metrics.progress_description(2.5, 100.0, None, None).endswith("MFU n/a | HFU n/a")
  assert metrics.progress_description(2.5, 100.0, 0.4, 0.5, eval_loss=2.25).endswith("HFU 50.0% | eval 2.250")


def test_logger_writes_tensorboard_events(tmp_path):
  logger = metrics.Logger(str(tmp_path))
  logger.scalars(1, {"loss": 3.0, "mfu": None})
  logger.close()
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


def test_the_logger_leaves_torch_out_of_a_process_that_has_not_imported_it(tmp_path):
  """tensorboardX imports torch where installed (2 s of each train.py start) only to accept torch tensors."""
  code = ("import importlib.util, sys; from sljax.metrics import Logger; Logger(sys.argv[1]).scalars(1, {'loss': 3.0}); "
          "assert 'torch' not in sys.modules; assert 'tensorboardX' in sys.modules; "
          "assert importlib.util.find_spec('torch') is not None")  # a later `import torch` still finds it
  done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
