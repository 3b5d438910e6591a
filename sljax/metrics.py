"""Throughput and MFU, TensorBoard scalars, and the progress-bar line."""

import importlib.util
import os

import jax

from sljax.machines import machine_of


def peak_flops(device: jax.Device | None = None) -> float | None:
  """Dense bf16 peak FLOP/s of `device` (default: the first one) from sljax.machines; None when unknown (CPU, other
  GPUs)."""
  machine = machine_of((device or jax.devices()[0]).device_kind)
  return machine.peak_flops if machine else None


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, device: jax.Device | None = None
        ) -> float | None:
  """Model FLOPs utilization: model FLOP/s over `num_devices` devices' peak; None when the peak is unknown."""
  peak = peak_flops(device)
  if peak is None:
    return None
  return tokens_per_s * flops_per_token / (num_devices * peak)


def progress_description(loss: float, tokens_per_s: float, utilization: float | None) -> str:
  mfu_text = "n/a" if utilization is None else f"{100 * utilization:.1f}%"
  return f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | MFU {mfu_text}"


def check_logger():
  """Raises ValueError when the TensorBoard writer is missing (checked before a run allocates anything: the Logger
  imports it only when training starts)."""
  if importlib.util.find_spec("tensorboardX") is None:
    raise ValueError("tensorboardX is not installed, and training logs to TensorBoard: pip install -r requirements.txt")


class Logger:
  """Scalars per step into TensorBoard event files under `workdir/tb`."""

  def __init__(self, workdir: str, enabled: bool = True):
    """`enabled=False` (every process but the first, on several hosts) writes nothing."""
    self.writer = None
    if enabled:
      from tensorboardX import SummaryWriter  # here, not at the top: it imports torch when present, >1 s

      self.writer = SummaryWriter(os.path.join(workdir, "tb"))

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
