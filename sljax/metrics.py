"""Throughput, FLOPs per token and utilization (MFU, HFU), TensorBoard scalars, the progress-bar line, and the checks
that the logs can be written."""

import importlib.util
import os
import sys
from typing import NamedTuple

import jax

from sljax.machines import machine_of


def peak_flops(device: jax.Device | None = None) -> float | None:
  """Dense bf16 peak FLOP/s of `device` (default: the first one) from sljax.machines; None when unknown (CPU, other
  GPUs)."""
  machine = machine_of((device or jax.devices()[0]).device_kind)
  return machine.peak_flops if machine else None


class StepFlops(NamedTuple):
  """FLOPs per token of one training step, counted two ways (full training: training_flops; LoRA:
  sljax.lora.engine.lora_flops_per_token)."""

  model: float  # MFU's: each pass the step's math needs, once: forward, and backward for the gradients it takes
  hardware: float  # HFU's: model FLOPs plus the forwards the backward runs again (recompute)


def step_flops(model_flops: float, layer_forward_flops: float, recomputed_layers: float) -> StepFlops:
  """A step's FLOPs per token from its model FLOPs and one layer's forward FLOPs, when the backward runs the forward
  of `recomputed_layers` layers again (per-layer remat, or a group's recompute in the offload and LoRA engines)."""
  return StepFlops(model=model_flops, hardware=model_flops + recomputed_layers * layer_forward_flops)


def training_flops(cfg, seq_len: int, recomputed_layers: float) -> StepFlops:
  """Full training of a model of `cfg` (models.ModelConfig): model FLOPs cfg.flops_per_token (6 x params + causal
  attention), hardware FLOPs with `recomputed_layers` layers' forward run again."""
  return step_flops(cfg.flops_per_token(seq_len), cfg.layer_forward_flops(seq_len), recomputed_layers)


def utilization(tokens_per_s: float, flops_per_token: float, num_devices: int, device: jax.Device | None = None
                ) -> float | None:
  """FLOP/s over `num_devices` devices' peak: MFU with model FLOPs per token, HFU with hardware FLOPs; None when the
  peak is unknown."""
  peak = peak_flops(device)
  if peak is None:
    return None
  return tokens_per_s * flops_per_token / (num_devices * peak)


def progress_description(loss: float, tokens_per_s: float, mfu: float | None, hfu: float | None,
                         eval_loss: float | None = None) -> str:
  """The progress bar's line: MFU (model FLOPs, no recompute) then HFU (recompute counted); eval_loss: the newest
  held-out loss, None before the first."""
  percent = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
  eval_text = "" if eval_loss is None else f" | eval {eval_loss:.3f}"
  return f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | MFU {percent(mfu)} | HFU {percent(hfu)}{eval_text}"


def check_logger():
  """Raises ValueError when the TensorBoard writer is missing (checked before a run allocates anything: the Logger
  imports it only when training starts)."""
  if importlib.util.find_spec("tensorboardX") is None:
    raise ValueError("tensorboardX is not installed, and training logs to TensorBoard: pip install -r requirements.txt")


def check_writable_file(path: str, what: str = "file", workdir: str = ""):
  """Raises ValueError, before anything is written, when `path` cannot be opened for appending: a directory, a
  read-only file, or a new file whose directory is missing or read-only. A file directly in `workdir` passes while
  the workdir does not exist yet: the run makes it before opening the file. An empty `path` (no file) passes.
  `what` names the file in the message (e.g. the flag that gave it)."""
  if not path:
    return
  if os.path.isdir(path):
    raise ValueError(f"{what} {path} cannot be written: it is a directory")
  if os.path.exists(path):
    if not os.access(path, os.W_OK):
      raise ValueError(f"{what} {path} cannot be written: it is read-only here")
    return
  parent = os.path.dirname(os.path.abspath(path))
  if workdir and parent == os.path.abspath(workdir) and not os.path.exists(parent):
    return
  if not os.path.isdir(parent):
    missing = "is not a directory" if os.path.exists(parent) else "does not exist"
    raise ValueError(f"{what} {path} cannot be created: {parent} {missing}")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f"{what} {path} cannot be created: {parent} is read-only here")


def summary_writer() -> type:
  """tensorboardX's SummaryWriter, imported here rather than at the top, and without torch when torch is not loaded
  yet: tensorboardX imports torch, where installed, only to accept torch tensors (the Logger writes floats), and that
  import cost each train.py start 2 s of CPU."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX catches
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class Logger:
  """Scalars per step into TensorBoard event files under `workdir/tb`."""

  def __init__(self, workdir: str, enabled: bool = True):
    """`enabled=False` (every process but the first, on several hosts) writes nothing."""
    self.writer = None
    if enabled:
      self.writer = summary_writer()(os.path.join(workdir, "tb"))

  def scalars(self, step: int, values: dict[str, float | None]):
    for name, value in values.items():
      if value is not None and self.writer:
        self.writer.add_scalar(name, value, step)

  def flush(self):
    if self.writer:
      self.writer.flush()

  def close(self):
    if self.writer:
      self.writer.close()
