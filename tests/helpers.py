"""What several test files share, in one place: no test file imports another (test_suite.py checks it). Imported as
`helpers` (conftest.py puts tests/ on sys.path; tests/test_mesh.py's worker process finds it beside itself)."""

import functools
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- trees and batches -------------------------------------------------------------------------------------------

def flat(tree) -> np.ndarray:
  """Every leaf of a tree, raveled into one float64 vector."""
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def rel_error(got, want) -> float:
  got, want = flat(got), flat(want)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def make_batch(rng, rows, seq=8):
  tokens = rng.integers(0, 256, (rows, seq + 1)).astype(np.int32)
  weights = (rng.random((rows, seq)) > 0.25).astype(np.float32)  # some tokens masked: the mean is over the rest
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


# ---- the plain full-batch step, what the engines are held to -----------------------------------------------------

@functools.cache
def _value_and_grad(model):
  return jax.jit(jax.value_and_grad(model.loss))


@functools.cache
def _init(model):
  return jax.jit(model.init)


def init_params(model, seed: int):
  """model.init, jitted with an rbg key: XLA:CPU compiles it in a third of threefry's time (or of init op by op)."""
  return _init(model)(jax.random.key(seed, impl="rbg"))


@functools.cache
def optimizer_step(optimizer, clip: float = 0.0):
  """(init, step) of `optimizer` (clipped to a global norm of `clip`, if > 0), jitted once per optimizer object:
  step(grads, opt_state, params) -> (params, opt_state)."""
  tx = optax.chain(optax.clip_by_global_norm(clip), optimizer) if clip else optimizer

  def step(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(tx.init), jax.jit(step)


def reference_steps(model, optimizer, clip, params, batches):
  """Plain full-batch training: jax.grad over the whole model, then optax, each jitted. Op by op, the optimizer
  compiled a kernel per operation and leaf shape: 150 for AdamW on a tiny model, 4 s of CPU per model where the
  jitted update takes 1 (and a new optimizer or clipping norm of a known model a few tenths)."""
  init, step = optimizer_step(optimizer, clip)
  opt_state = init(params)
  losses = []
  for batch in batches:
    loss, grads = _value_and_grad(model)(params, batch)
    params, opt_state = step(grads, opt_state, params)
    losses.append(float(loss))
  return losses, params


# ---- LoRA checkpoints in the layout of layer groups (format 1) ------------------------------------------------------

def in_layer_groups(state: dict, group_layers: list[int]) -> dict:
  """A LoRA engine's state (its adapters and their optimizer state stacked over all layers) as the engine held it
  before the stacks, and as format-1 checkpoints hold it: every subtree laid out as the adapters (their optimizer
  state's per-parameter ones) a list of layer groups of `group_layers` layers each, numpy."""
  adapters = jax.tree.structure(state["adapters"])
  bounds = np.cumsum([0, *group_layers])
  split = lambda tree: [jax.tree.map(lambda x: np.asarray(x)[a:b], tree) for a, b in zip(bounds[:-1], bounds[1:])]
  return jax.tree.map(lambda x: split(x) if jax.tree.structure(x) == adapters else np.asarray(x), state,
                      is_leaf=lambda x: jax.tree.structure(x) == adapters)


def rewrite_in_layer_groups(workdir: str, optimizer, group_layers: list[int]) -> str:
  """The newest checkpoint of a LoRA run in `workdir` rewritten in format 1 (in_layer_groups; its metadata without
  lora.format), as an older sljax wrote it; its step directory."""
  from flax import traverse_util

  from sljax.checkpoint import Checkpointer, newest_checkpoint, path_key, read_arrays

  step_dir, meta = newest_checkpoint(workdir)
  arrays = read_arrays(step_dir)
  adapters = traverse_util.unflatten_dict({path[1:]: value for path, value in arrays.items() if path[0] == "adapters"})
  shapes = {"step": arrays[("step",)], "adapters": adapters, "opt": jax.eval_shape(optimizer.init, adapters)}
  paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  state = jax.tree.unflatten(treedef, [arrays[tuple(map(path_key, path))] for path, _ in paths])
  meta["lora"] = {name: value for name, value in meta["lora"].items() if name != "format"}
  shutil.rmtree(step_dir)
  checkpointer = Checkpointer(os.path.dirname(step_dir), save_every=0)
  checkpointer.save(int(os.path.basename(step_dir)), in_layer_groups(state, group_layers), meta, force=True)
  checkpointer.close()
  return step_dir


# ---- train.py and generate.py, as their command lines run them ---------------------------------------------------

TINY = ["--set=num_layers=2", "--set=hidden_size=64", "--set=intermediate_size=128", "--set=num_heads=2",
        "--set=num_kv_heads=1", "--seq_len=32", "--batch_size=4", "--max_tokens=200000", "--warmup_steps=1",
        "--log_every=1"]


def run_train(*args) -> dict[int, float]:
  """train.py's run() in this process, on flags parsed as its command line `args` would be."""
  from absl import flags

  from sljax.cli import train  # defines train.py's flags: only the files that run it load it
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train.py", *args])
  return train.run()


def train_in_process(workdir, *args) -> dict[int, float]:
  """A tiny model's train.py run in `workdir`."""
  return run_train(f"--workdir={workdir}", *TINY, *args)


def tensorboard_scalars(workdir) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of a run's TensorBoard event files (TFRecord framing: length, its CRC, event, its CRC)."""
  import struct

  from tensorboardX.proto.event_pb2 import Event

  scalars = {}
  for path in glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*")):
    data, i = open(path, "rb").read(), 0
    while i < len(data):
      (length,) = struct.unpack("<Q", data[i:i + 8])
      event = Event.FromString(data[i + 12:i + 12 + length])
      i += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
  return scalars


# Runs generate.run() once per case in one process, since each CLI run would pay for its own jax start (and
# generate.py's flags clash with train.py's in the test process).
GENERATE_CASES = """
import json, sys
from absl import flags
from sljax.cli import generate
results = []
for args in json.loads(sys.argv[1]):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["generate.py", *args])
  try:
    results.append({"records": generate.run()})
  except SystemExit as exit:
    results.append({"exit": str(exit)})
print(json.dumps(results))
"""


def generate_cases(cases: list[list[str]], timeout: int = 300) -> subprocess.CompletedProcess:
  """generate.py's run() on each flag list in `cases`, in one fresh process; its last stdout line holds a JSON list
  of {"records": ...} or {"exit": the SystemExit's message}, one per case."""
  return subprocess.run([sys.executable, "-c", GENERATE_CASES, json.dumps(cases)], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout)


# ---- the order of an engine's calls and copies (tests/test_engine.py, tests/test_lora.py) --------------------------

def record_calls(engine, events: list, labels: dict, when=lambda args: True):
  """Has each of the engine's calls named in `labels` (attribute -> label) append its label to `events` as it is
  called (where when(args))."""
  for name, label in labels.items():
    def call(*args, fn=getattr(engine, name), label=label):
      if when(args):
        events.append(label)
      return fn(*args)
    setattr(engine, name, call)


def inputs_fetched_one_call_ahead(events: list) -> int:
  """Checks that before each "backward" call of `events` its input and the next call's were fetched ("fetch"; the
  k-th fetch is the k-th call's input); returns how many were fetched."""
  fetched = [events[:i].count("fetch") for i, event in enumerate(events) if event == "backward"]
  total = events.count("fetch")
  assert len(fetched) == total and fetched == [min(call + 2, total) for call in range(total)], events
  return total


# ---- the benchmarks' smoke modes (tests/test_benchmarks.py, tests/test_benchmarks_training.py) --------------------

def benchmark_smoke(module: str, tmp_path, *args: str) -> dict:
  """Runs `python -m benchmarks.<module> --smoke --out=... args` from the repository root; its results JSON."""
  out = tmp_path / "result.json"
  done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", f"--out={out}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return json.loads(out.read_text())


def has_provenance(result: dict, module: str) -> bool:
  return (result["command"].startswith(f"python -m benchmarks.{module} --smoke") and result["date"]
          and result["versions"]["jax"] and "XLA_PYTHON_CLIENT_MEM_FRACTION" in result["env"])
