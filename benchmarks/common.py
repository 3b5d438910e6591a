"""What the benchmarks share: random token batches, the timed loop, and the results file that says how, when and on
what a result was made."""

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import numpy as np
from absl import flags, logging

from sljax.machines import xla_memory_env
from sljax.memory import resident_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")
# --smoke of the training benchmarks (train_throughput, kernel_ceiling): a preset's family at CPU size, one row of 32
# tokens (the batch the plan chooses for it as train.py would: every smoke case then runs the same compiled calls).
TRAINING_SMOKE = dict(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=256)
TRAINING_SMOKE_ROWS, TRAINING_SMOKE_SEQ = 1, 32
# --smoke of the generation benchmark and its baseline: the same families at CPU sizes.
GENERATION_SMOKE = {
    "llama": dict(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=512),
    "opt": dict(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=512,
                max_positions=128),
}


def define_flags(smoke: str, out: str = "Write the results JSON here."):
  """The flags every absl benchmark takes: --out (where its results go) and --smoke (`smoke`: what it then runs)."""
  flags.DEFINE_string("out", "", out)
  flags.DEFINE_bool("smoke", False, smoke)


def batch_of(rows: int, seq: int, vocab: int, seed: int | np.random.Generator = 0) -> dict:
  """A training batch of uniform random tokens ({"inputs", "targets", "weights"}: [rows, seq]); `seed` may be a
  generator, which successive batches then share."""
  tokens = np.random.default_rng(seed).integers(0, vocab, (rows, seq + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((rows, seq), np.float32)}


def timed(step, state, batch, steps: int):
  """(median seconds per step, each step's seconds, losses, state) of `steps` steps after one warm-up step; waits
  for the device only at the end of each step, which it logs with the time of day (to lay beside a trace or the
  allocator's log) and the process's resident host memory, whose pinned pools grow in it."""
  state, loss = step(state, batch)
  jax.block_until_ready(loss)
  times, losses = [], []
  for _ in range(steps):
    start = time.perf_counter()
    state, loss = step(state, batch)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - start)
    logging.info("timed step %d of %d: %.3f s; host RSS %.1f GiB", len(times), steps, times[-1],
                 resident_bytes() / 2**30)
  return statistics.median(times), times, losses, state


def command() -> str:
  """This run's command line as typed from the repository root (`python -m benchmarks.<name> ...`)."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
  return " ".join(shlex.quote(a) for a in head + sys.argv[1:])


def versions(*extra: str) -> dict:
  """Python's version and the installed versions of the JAX stack (and of `extra` distributions); None if absent."""
  found = {"python": platform.python_version()}
  for name in PACKAGES + extra:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def provenance(device: str | None = "", *extra_packages: str) -> dict:
  """The fields every results file starts with: command, UTC date, device, versions, XLA's memory settings.
  device "": this process's first JAX device (starts the backend); None: not known here."""
  return {"command": command(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": jax.devices()[0].device_kind if device == "" else device, "versions": versions(*extra_packages),
          "env": xla_memory_env()}


def write_results(path: str, results: dict):
  """Writes `results` as JSON to `path` (nothing when path is ""), whole or not at all: a run killed mid-write keeps
  the previous file."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=1, default=str)
  os.replace(path + ".tmp", path)
