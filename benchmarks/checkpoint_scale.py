"""A checkpoint of host-resident training state at scale: save, restore, and the steps after it, in bounded memory.

  python -m benchmarks.checkpoint_scale --out=benchmarks/results/checkpoint_scale_h200.json   # one H200
  python -m benchmarks.checkpoint_scale --smoke --out=/tmp/checkpoint_smoke.json             # tiny, any machine

A llama13b-shaped model with as many layers as the workdir's disk holds one checkpoint of (at most --max_layers),
one layer per group but the last (--tail_layers); the master weights and optimizer state of a third of its groups on
the device (as the plan keeps most of llama13b's there), the rest in pinned host memory, and the host budget (XLA's
pinned pool, sljax.machines.configure_process) just above what the step keeps there (as the full model fills it on
one H200). One process: 3 steps, a save, 3 more steps (the uninterrupted run); then the state is freed, restored
from the checkpoint and the same 3 steps run again; their losses must equal the uninterrupted ones. Host memory
(RSS, sampled every 5 ms) above its level just before the save / restore is the staging; it must stay within the
checkpointer's budget.

The disk's own rates are measured in the same process and on the same filesystem once the checkpoint is gone: files of
the checkpoint's own sizes, each fsynced as it is closed (as tensorstore's file driver does: file_io_sync), written
and then read back; before every read (the restores' and this one) the files are dropped from the page cache, so that
reads come from the disk, not from RAM.
"""

import dataclasses
import gc
import json
import os
import shutil
import time

import jax
import numpy as np
from absl import app, flags
from etils import epath

import sljax
from benchmarks.common import TRAINING_SMOKE, batch_of, define_flags, provenance, write_results
from models.presets import build, get_config
from sljax.checkpoint import Checkpointer, StateHandler, StateRestore
from sljax.checkpoint_layout import offload_view
from sljax.machines import GIB, PINNED_POOL_ENV, configure_process
from sljax.memory import PeakResident, resident_bytes, tree_bytes
from sljax.optim import OptimConfig, make_optimizer
from sljax.schedule import state_on_device

define_flags("Tiny model on CPU: checks the code path in seconds.")
flags.DEFINE_string("workdir", "/tmp/sljax_checkpoint_scale", "Where the checkpoint is written (removed after).")
flags.DEFINE_integer("max_layers", 12, "At most this many llama13b layers (fewer when the disk holds less).")
flags.DEFINE_integer("rows", 32, "Sequences per step (4 sub-batches).")
flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
flags.DEFINE_float("staging_gib", 4.0, "The checkpointer's staging budget.")
flags.DEFINE_float("pool_margin_gib", 4.0, "The host budget (and so XLA's pinned pool) is this far above what "
                   "the step keeps there.")
flags.DEFINE_list("restore_readers", [], "Restores again with these many parts read at once (the default is what the "
                  "budget holds), each timed with its peak host memory.")
flags.DEFINE_enum("moments_dtype", "bfloat16", ["bfloat16", "int8"], "Adam's moments (the README command's bf16 "
                  "first moment, or 8-bit codes: --moments_dtype=int8).")
flags.DEFINE_integer("tail_layers", 0, "The last group's layers (EngineConfig.tail_layers; 0: one layer like the rest).")
FLAGS = flags.FLAGS

# Checkpoint bytes per parameter: the fp32 master 4 and Adam's moments (a bf16 first 2 and fp32 second 4, or 8-bit
# codes 1 + 1 and their scales, a byte per block of 256 rounded up); a checkpoint holds no weight copy nor parked
# gradient. In pinned memory, with every group's state there, the bf16 weight copy 2 and clipping's parked fp32
# gradient 4 come on top (the README's llama13b command).
DISK_BYTES_PER_PARAM = {"bfloat16": 10, "int8": 6.1}
HOST_EXTRA_BYTES_PER_PARAM = 6


def model_config():
  if FLAGS.smoke:  # the training benchmarks' CPU size: a state of 2 MiB, still many parts of the smoke's 128 KiB
    return get_config("llama-tiny", {**TRAINING_SMOKE, "remat": False, "dtype": "float32"}), 4, 16
  cfg = get_config("llama13b", {"remat": False})
  free = _free_disk(FLAGS.workdir)
  outer = cfg.outer_param_count() * DISK_BYTES_PER_PARAM[FLAGS.moments_dtype]
  layers = int(min(FLAGS.max_layers, (free * 0.9 - outer) // (cfg.layer_param_count() * DISK_BYTES_PER_PARAM[FLAGS.moments_dtype])))
  if layers < 2:
    raise SystemExit(f"sljax: {free / 1e9:.1f} GB free under {FLAGS.workdir} holds no 2-layer checkpoint")
  return get_config("llama13b", {"remat": False, "num_layers": layers}), FLAGS.rows, FLAGS.seq_len


def _free_disk(path: str) -> int:
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return shutil.disk_usage(path).free


def checkpoint_files(directory: str) -> list[str]:
  return [os.path.join(d, f) for d, _, files in os.walk(directory) for f in files]


def drop_from_page_cache(paths: list[str]):
  """The kernel forgets the files' cached pages (written back first), so the next read comes from the disk."""
  for path in paths:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def disk_rates(directory: str, sizes: list[int], chunk: int = 64 * 2**20) -> dict:
  """Sequential write (each file fsynced as it is closed) and read (from the disk, not the page cache) of files of
  `sizes` bytes under `directory`: bytes/s of each, the files removed after."""
  os.makedirs(directory, exist_ok=True)
  block = np.random.default_rng(0).integers(0, 256, chunk, np.uint8).tobytes()  # incompressible, like float state
  paths = [os.path.join(directory, f"file_{i:05d}") for i in range(len(sizes))]
  start = time.perf_counter()
  for path, size in zip(paths, sizes):
    with open(path, "wb", buffering=0) as f:
      for offset in range(0, size, chunk):
        f.write(block[:min(chunk, size - offset)])
      os.fsync(f.fileno())
  write_seconds = time.perf_counter() - start
  drop_from_page_cache(paths)
  buffer = bytearray(chunk)
  start = time.perf_counter()
  for path in paths:
    with open(path, "rb", buffering=0) as f:
      while f.readinto(buffer):
        pass
  read_seconds = time.perf_counter() - start
  shutil.rmtree(directory, ignore_errors=True)
  total = sum(sizes)
  return {"files": len(sizes), "bytes": total, "write_seconds": write_seconds, "read_seconds": read_seconds,
          "write_bytes_per_s": total / write_seconds, "read_bytes_per_s": total / read_seconds}


def restore_with_readers(readers: int, staging: int, abstract, on_disk: int) -> dict:
  """The checkpoint restored again (from the disk) with `readers` parts read at once: seconds, rate, peak extra host
  memory and where the time went."""
  gc.collect()
  drop_from_page_cache(checkpoint_files(FLAGS.workdir))
  handler = StateHandler(staging, readers=readers)
  with PeakResident(0.005) as restoring:
    start = time.perf_counter()
    state = jax.block_until_ready(handler.restore(epath.Path(FLAGS.workdir) / "3" / "state", StateRestore(abstract)))
    seconds = time.perf_counter() - start
  handler.close()
  del state
  return {"readers": readers, "seconds": seconds, "gb_per_s": on_disk / seconds / 1e9,
          "peak_host_extra_gib": restoring.extra / GIB, "seconds_by_work": dict(handler.timings.seconds)}


def engine_config(cfg) -> sljax.EngineConfig:
  layout = sljax.EngineConfig(sub_batches=4, live_layers=1, grad_clip_norm=1.0, tail_layers=FLAGS.tail_layers)
  return dataclasses.replace(layout, device_state_groups=len(layout.bounds(cfg.num_layers)) // 3)


def host_budget_gib(cfg, rows, seq_len) -> int:
  """What the step keeps in pinned memory (state, weight copies, parked gradients, the activation stash) + margin."""
  engine = engine_config(cfg)
  bounds = engine.bounds(cfg.num_layers)
  stash = (len(bounds) - 1) * rows * seq_len * cfg.hidden_size * 2
  host_layers = sum(b - a for (a, b), on_device in zip(bounds, state_on_device(len(bounds), engine.device_state_groups))
                    if not on_device)
  host = host_layers * cfg.layer_param_count() * (
      DISK_BYTES_PER_PARAM[FLAGS.moments_dtype] + HOST_EXTRA_BYTES_PER_PARAM) + stash
  return int(host / GIB + FLAGS.pool_margin_gib + 1)


def main(argv):
  cfg, rows, seq_len = model_config()
  configure_process(host_budget_gib(cfg, rows, seq_len))  # read when the backend starts, below

  model = build(cfg)
  optim_cfg = OptimConfig(learning_rate=3e-4, warmup_steps=1, moments_dtype=FLAGS.moments_dtype,
                          grad_clip_norm=1.0)
  engine = sljax.Engine(model, make_optimizer(optim_cfg, clip=False), engine_config(cfg))
  rng = np.random.default_rng(0)
  batches = [batch_of(rows, seq_len, cfg.vocab_size, rng) for _ in range(6)]

  def steps(state, first, count):
    losses = []
    for n in range(first, first + count):
      state, loss = engine.step(state, batches[n % len(batches)])
      losses.append(float(loss))
    return state, losses

  shutil.rmtree(FLAGS.workdir, ignore_errors=True)
  staging = int(FLAGS.staging_gib * GIB) if not FLAGS.smoke else 2**20
  start = time.perf_counter()
  state = jax.block_until_ready(engine.init(jax.random.key(0)))
  init_seconds = time.perf_counter() - start
  resident = lambda kind: sum(x.nbytes for x in jax.tree.leaves(state) if x.sharding.memory_kind == kind)
  host_resident, device_resident = resident("pinned_host"), resident("device")
  state, first_losses = steps(state, 0, 3)
  state = engine.settle(state)  # the third step's clipped updates, parked for the next forward, applied
  checkpointer = Checkpointer(FLAGS.workdir, save_every=3, keep=1, staging_bytes=staging)
  with PeakResident(0.005) as saving:
    start = time.perf_counter()
    checkpointer.save(3, offload_view(engine, state), {"data_step": 3})  # what train.py saves: per layer
    save_seconds = time.perf_counter() - start
  save_timings = dict(checkpointer.state_handler.timings.seconds)
  gc.collect()
  after_save = resident_bytes()
  sizes = [os.path.getsize(path) for path in checkpoint_files(FLAGS.workdir)]
  on_disk = sum(sizes)
  abstract = offload_view(engine, engine.abstract_state(jax.random.key(0)), True)
  state, uninterrupted = steps(state, 3, 3)
  del state
  gc.collect()
  drop_from_page_cache(checkpoint_files(FLAGS.workdir))
  with PeakResident(0.005) as restoring:
    start = time.perf_counter()
    step, state, meta = checkpointer.restore_latest(abstract)
    jax.block_until_ready(state)
    restore_seconds = time.perf_counter() - start
  restore_timings = dict(checkpointer.state_handler.timings.seconds)
  state, resumed = steps(state, 3, 3)
  # The same steps from a second restore: how far two runs from one bit-identical state differ on this machine
  # (GPU backward kernels may sum in a varying order), against how far the resumed run is from the uninterrupted one.
  del state
  gc.collect()
  drop_from_page_cache(checkpoint_files(FLAGS.workdir))
  _, state, _ = checkpointer.restore_latest(abstract)
  state, resumed_again = steps(state, 3, 3)
  del state
  readers_sweep = [restore_with_readers(int(readers), staging, abstract, on_disk) for readers in FLAGS.restore_readers]
  checkpointer.close()
  shutil.rmtree(FLAGS.workdir, ignore_errors=True)
  disk = disk_rates(FLAGS.workdir + "_disk_rates", sizes)  # the checkpoint's files, on the same filesystem

  streaming = StateHandler(staging)  # the parts and writers the checkpointer's saves and restores use
  streaming.close()
  result = {
      **provenance(), "model": f"llama13b shapes, {cfg.num_layers} layers" if not FLAGS.smoke else "llama-tiny",
      "batch": f"{rows} x {seq_len}, 4 sub-batches, clipping 1.0, bf16 first moment",
      "placement": f"{engine.cfg.device_state_groups} of {len(engine.groups)} groups' state on the device (the last "
                   f"group {engine.groups[-1][1] - engine.groups[-1][0]} layer(s), the others one), the rest on the host",
      "engine": dataclasses.asdict(engine.cfg),
      "state_gib": tree_bytes(engine.abstract_state(jax.random.key(0))) / GIB, "host_resident_state_gib": host_resident / GIB,
      "device_resident_state_gib": device_resident / GIB,
      "pinned_pool_limit_gib": float(os.environ.get(PINNED_POOL_ENV, 0)),
      "staging_budget_gib": staging / GIB, "checkpoint_on_disk_gib": on_disk / GIB,
      "part_mib": streaming.part_bytes / 2**20, "writers": streaming.writers, "readers": streaming.readers,
      "peak_host_extra_gib": {"save": saving.extra / GIB, "restore": restoring.extra / GIB},
      "rss_gib": {"before_save": saving.start / GIB, "after_save": after_save / GIB,
                  "before_restore": restoring.start / GIB},
      "save_seconds": save_seconds, "restore_seconds": restore_seconds, "init_seconds": init_seconds,
      "seconds_by_work": {"save": save_timings, "restore": restore_timings,
                          "note": "summed over the threads doing each (writers, readers): where the time went"},
      "restore_readers_sweep": readers_sweep,
      "save_gb_per_s": on_disk / save_seconds / 1e9, "restore_gb_per_s": on_disk / restore_seconds / 1e9,
      "disk_write_gb_per_s": disk["write_bytes_per_s"] / 1e9, "disk_read_gb_per_s": disk["read_bytes_per_s"] / 1e9,
      "save_fraction_of_disk": on_disk / save_seconds / disk["write_bytes_per_s"],
      "restore_fraction_of_disk": on_disk / restore_seconds / disk["read_bytes_per_s"],
      "disk_rates": {**disk, "policy": "the checkpoint's file sizes; each file fsynced as it is closed; reads after "
                     "dropping the files from the page cache (as before each restore)"},
      "losses": {"steps_1_3": first_losses, "uninterrupted_4_6": uninterrupted, "after_restore_4_6": resumed,
                 "after_second_restore_4_6": resumed_again},
      "losses_equal": uninterrupted == resumed, "restored_step": step,
      "losses_max_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(uninterrupted, resumed)),
      "run_to_run_max_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(resumed, resumed_again)),
      "first_step_after_restore_equal": uninterrupted[0] == resumed[0] == resumed_again[0],
  }
  result["within_budget"] = max(saving.extra, restoring.extra) <= staging
  print(json.dumps(result, indent=1))
  write_results(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
