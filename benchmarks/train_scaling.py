"""Weak scaling of the SpeedLoader engine over GPUs: llama13b on one GPU, then data parallel and FSDP over --gpus.

  python -m benchmarks.train_scaling --out=benchmarks/results/train_scaling_h200x2.json   # kind nvidia-h200-x2
  python -m benchmarks.train_scaling --smoke   # tiny model on 8 fake CPU devices: checks the code paths

Every case keeps the per-GPU work of the one-GPU case (same rows per GPU, same plan: sub-batches, live layers,
activation placement), so tokens/s per GPU over the one-GPU case's is the weak-scaling efficiency (goal >= 0.9):
  one_gpu         mesh 1 x 1
  data_parallel   mesh data:G    state replicated: every GPU's host holds a full copy; gradient all-reduce per group
  fsdp            mesh fsdp:G    state split over the GPUs: each group costs 1/G of the device memory, so G times as
                                 many groups keep their state on the device (--fsdp_device_state_groups)
Each case runs in its own process (--process_per_case): XLA's pinned-host pool keeps what an earlier case grew it to.
Recorded per case: tokens/s (total, per GPU), MFU per GPU, step times, losses, bytes per step between GPUs (ring
collectives, sljax.memory) and over PCIe (total and per GPU), peak device memory per GPU.
"""

import os
import sys

if "--smoke" in sys.argv:  # before jax starts: 8 CPU devices stand in for GPUs
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.common import (REPO, batch_of, define_flags, provenance, timed,  # noqa: E402
                               write_results)
from models.presets import build, get_config  # noqa: E402
from sljax import machines, metrics  # noqa: E402
from sljax import plan as planner  # noqa: E402
from sljax.memory import Placement  # noqa: E402
from sljax.mesh import make_mesh  # noqa: E402
from sljax.schedule import Engine  # noqa: E402

define_flags("Tiny model on CPU devices: checks every code path in a few minutes.",
             out="Write the results JSON here (rewritten after every case).")
flags.DEFINE_bool("process_per_case", True, "Run each case in a fresh process. XLA's pinned-host pool never shrinks, "
                  "so a case run after another starts with the first one's pool on top of its own.")
flags.DEFINE_list("cases", "one_gpu,data_parallel,fsdp", "Which cases to run, in order.")
flags.DEFINE_integer("gpus", 2, "GPUs of the data-parallel and FSDP cases.")
flags.DEFINE_string("model", "llama13b", "Model preset.")
flags.DEFINE_integer("rows_per_gpu", 32, "Sequences per GPU per step.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
flags.DEFINE_integer("steps", 3, "Timed steps per case (after one warm-up step).")
flags.DEFINE_float("host_memory_gib", 85, "Pinned host memory per GPU the plan may use.")
flags.DEFINE_integer("fsdp_device_state_groups", -1, "Groups keeping their state on the device under FSDP "
                     "(-1: the plan's choice for a 1/gpus share of the state).")
FLAGS = flags.FLAGS

RESULTS = []
FACTS = {}


def run_case(name, model, engine_cfg, place, rows_per_gpu, seq, steps):
  """Init, one warm-up step, `steps` timed steps (each waited for at its end); the bytes each step moves."""
  gpus = place.mesh.size
  batch = batch_of(rows_per_gpu * gpus, seq, model.cfg.vocab_size)
  engine = Engine(model, optax.adamw(1e-4, weight_decay=0.1), engine_cfg, place)
  start = time.perf_counter()
  state = jax.block_until_ready(engine.init(jax.random.key(0)))
  print(f"{name}: mesh {dict(place.mesh.shape)}, initialized in {time.perf_counter() - start:.0f} s", flush=True)
  before = dict(place.moved)
  seconds, times, losses, state = timed(engine.step, state, batch, steps)
  moved = {kind: (place.moved[kind] - before[kind]) // (steps + 1) for kind in before}  # every step moves the same
  del state
  gc.collect()

  tokens_per_s = rows_per_gpu * gpus * seq / seconds
  flops = metrics.training_flops(model.cfg, seq, engine.groups[-1][0])  # every group's layers but the last group's
  utilization = lambda flops_per_token: metrics.utilization(tokens_per_s, flops_per_token, gpus,
                                                            place.mesh.devices.flat[0])
  result = {
      "case": name, "mesh": dict(place.mesh.shape), "gpus": gpus, "rows": rows_per_gpu * gpus, "seq_len": seq,
      "engine": dataclasses.asdict(engine_cfg), "tokens_per_s": tokens_per_s,
      "tokens_per_s_per_gpu": tokens_per_s / gpus,
      "mfu_per_gpu": utilization(flops.model), "hfu_per_gpu": utilization(flops.hardware),
      "step_seconds": seconds, "step_seconds_all": times, "losses": losses,
      "bytes_per_step": moved, "bytes_per_step_per_gpu": {kind: count / gpus for kind, count in moved.items()},
      "peak_device_bytes_per_gpu": [(d.memory_stats() or {}).get("peak_bytes_in_use")
                                    for d in place.mesh.devices.flat],
  }
  print(f"{name:14s} {tokens_per_s:10.0f} tok/s  {tokens_per_s / gpus:10.0f} per GPU  step {seconds:.2f} s  "
        f"between GPUs {moved['between_devices'] / gpus / 1e9:.1f} GB/GPU  PCIe in "
        f"{moved['host_to_device'] / gpus / 1e9:.1f} GB/GPU", flush=True)
  return result


def keep(result, facts=None):
  """Records a case, adds weak-scaling efficiencies, and rewrites the JSON (a crash later keeps what ran). `facts`:
  the device facts of the process that ran the case (default: this one's)."""
  RESULTS.append(result)
  one = next((r for r in RESULTS if r["case"] == "one_gpu" and "tokens_per_s_per_gpu" in r), None)
  for r in RESULTS:
    if one and "tokens_per_s_per_gpu" in r:
      r["weak_scaling_efficiency"] = r["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
  if facts is None:
    facts = {**provenance(), "devices": len(jax.devices())}
  FACTS.update(facts)
  write_results(FLAGS.out, {**provenance(device=None), **FACTS, "model": FLAGS.model, "results": RESULTS})


def run_in_child(name):
  """Runs one case in a fresh process (this script with --cases=name); (its result, or a failure record with the
  child's exit status and last output lines; the child's device facts, or {} when it failed)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, f"{name}.json")
    argv = [sys.executable, "-m", "benchmarks.train_scaling",
            *[a for a in sys.argv[1:] if not a.startswith(("--cases=", "--out="))], f"--cases={name}", f"--out={out}"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
      sys.stdout.write(line)
      tail = (tail + [line.rstrip()] if line.strip() else tail)[-5:]
    if proc.wait() == 0 and os.path.exists(out):
      with open(out) as f:
        child = json.load(f)
      return child["results"][0], {k: child[k] for k in ("date", "device", "devices", "versions", "env")}
  print(f"{name}: failed with exit status {proc.returncode}", flush=True)
  return {"case": name, "status": "failed", "exit_status": proc.returncode, "output_tail": tail}, {}


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.cases) - {"one_gpu", "data_parallel", "fsdp"})
  if unknown:
    raise app.UsageError(f"unknown case(s) {', '.join(unknown)}: choose from one_gpu, data_parallel, fsdp")
  if FLAGS.process_per_case and len(FLAGS.cases) > 1:  # this process never starts a backend: the children own the GPUs
    for name in FLAGS.cases:
      keep(*run_in_child(name))
    return
  # Data parallel keeps a full copy of the host-resident state per GPU: cap each GPU's pinned pool just above the
  # plan's per-GPU budget, or two pools doubling past their buffers take more than the machine has.
  machines.configure_process(FLAGS.host_memory_gib * machines.local_gpu_count())
  gpus, seq, rows = FLAGS.gpus, FLAGS.seq_len, FLAGS.rows_per_gpu
  overrides = {"remat": False}  # the engine's backward recomputes each group: no per-layer remat on top
  if FLAGS.smoke:
    overrides.update(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4,
                     vocab_size=256)
    seq, rows = 32, 4
  model = build(get_config(FLAGS.model, overrides))
  budget = dataclasses.replace(machines.default_budget(), host_bytes=int(FLAGS.host_memory_gib * machines.GIB))
  plan = planner.make_plan(model, seq, rows, budget)  # one GPU's work: every case keeps it per GPU
  print(plan.describe(), flush=True)
  engine_cfg = plan.engine
  if FLAGS.smoke:  # the tiny model fits anywhere: stream through the host anyway, so every path runs
    engine_cfg = dataclasses.replace(engine_cfg, sub_batches=2, activations_on_host=True, device_state_groups=1)
  fsdp_groups = FLAGS.fsdp_device_state_groups
  if fsdp_groups < 0 and FLAGS.smoke:  # keep streaming state through the host, as the one-GPU smoke case does
    fsdp_groups = engine_cfg.device_state_groups
  elif fsdp_groups < 0:  # the plan for this GPU's 1/gpus share of the state (the rest of the split as one GPU's)
    fsdp_plan = planner.make_plan(model, seq, rows, budget, engine_cfg.sub_batches, engine_cfg.live_layers, fsdp=gpus)
    print(fsdp_plan.describe(), flush=True)
    fsdp_groups = fsdp_plan.engine.device_state_groups
  cases = {
      "one_gpu": ({"data": 1, "fsdp": 1}, engine_cfg),
      "data_parallel": ({"data": gpus, "fsdp": 1}, engine_cfg),
      "fsdp": ({"data": 1, "fsdp": gpus}, dataclasses.replace(engine_cfg, device_state_groups=fsdp_groups)),
  }
  for name in FLAGS.cases:
    shape, case_cfg = cases[name]
    mesh = make_mesh(shape, jax.devices()[:shape["data"] * shape["fsdp"]])
    result = run_case(name, model, case_cfg, Placement(mesh), rows, seq, FLAGS.steps)
    result["plan"] = plan.describe()
    keep(result)


if __name__ == "__main__":
  app.run(main)
