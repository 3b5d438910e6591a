"""What growing XLA's pinned host pool costs, and what growing it once before the first step leaves for the steps.

  python -m benchmarks.pinned_pool --out=benchmarks/results/pinned_pool_h200.json   # one GPU
  python -m benchmarks.pinned_pool --smoke --out=/tmp/pinned_pool_smoke.json       # tiny sizes, any machine

XLA's GPU client keeps each device's pinned host buffers in a pool that pins a new region (twice the last one's size)
whenever its free chunks cannot hold a buffer, and never shrinks (sljax.memory.grow_pinned_pools). Each part runs in
a fresh process, so that it starts with an empty pool:
  growth        a pinned buffer of each of --sizes_gib in turn, made on the device and copied out (jitted zeros),
                timed the first time (the pool pins a region for it) and again after it is freed (the region is
                there): `growth_s` is the difference, the pinning alone
  grown_first   sljax.memory.grow_pinned_pools to --grow_gib (what train.py does before its first step), timed; then
                the largest of --sizes_gib made as in `growth`, twice: the first no slower than the second when the
                pool grown at start holds it
Each part records the process's resident host memory (pinned pages are resident) before and after.
"""

import json
import subprocess
import sys
import time

import jax
from absl import app, flags

from benchmarks.common import define_flags, provenance, write_results
from sljax.machines import GIB, configure_process
from sljax.memory import grow_pinned_pools, pinned_buffer_maker, resident_bytes

define_flags("MiB instead of GiB: checks the code paths on any machine in seconds.")
flags.DEFINE_list("sizes_gib", ["1", "8", "32"], "Pinned buffers to make, in turn, in the growth part (GiB).")
flags.DEFINE_float("grow_gib", 64, "What grown_first grows the pool to before its buffer (GiB).")
flags.DEFINE_enum("part", "", ["", "growth", "grown_first"], "Internal: run one part in this process, print its JSON.")
FLAGS = flags.FLAGS


def unit() -> int:
  return 2**20 if FLAGS.smoke else GIB


def made(nbytes: int) -> float:
  """Seconds to make a pinned buffer of `nbytes` on the first device (then freed)."""
  make = pinned_buffer_maker(jax.devices()[0], nbytes)  # compiled first: the compile is not the allocation
  start = time.perf_counter()
  buffer = make()
  buffer.block_until_ready()
  seconds = time.perf_counter() - start
  buffer.delete()
  return seconds


def growth() -> dict:
  rows = []
  for size in FLAGS.sizes_gib:
    nbytes = int(float(size) * unit())
    first, again = made(nbytes), made(nbytes)
    rows.append({"bytes": nbytes, "first_s": first, "again_s": again, "growth_s": first - again,
                 "growth_s_per_gib": (first - again) / (nbytes / GIB), "resident_bytes": resident_bytes()})
    print(f"{nbytes / unit():g} {'MiB' if FLAGS.smoke else 'GiB'}: first {first:.2f} s, again {again:.2f} s",
          file=sys.stderr, flush=True)
  return {"growth": rows}


def grown_first() -> dict:
  before = resident_bytes()
  start = time.perf_counter()
  held = grow_pinned_pools(jax.devices()[:1], int(FLAGS.grow_gib * unit()), chunk=unit())
  seconds = time.perf_counter() - start
  nbytes = int(max(float(s) for s in FLAGS.sizes_gib) * unit())
  first, again = made(nbytes), made(nbytes)
  print(f"grown to {held / unit():g} in {seconds:.2f} s; then {nbytes / unit():g}: first {first:.2f} s, again "
        f"{again:.2f} s", file=sys.stderr, flush=True)
  return {"grown_first": {"asked_bytes": int(FLAGS.grow_gib * unit()), "held_bytes": held, "grow_s": seconds,
                          "grow_s_per_gib": seconds / (held / GIB) if held else None, "buffer_bytes": nbytes,
                          "first_s": first, "again_s": again, "resident_bytes_before": before,
                          "resident_bytes_after": resident_bytes()}}


def main(argv):
  del argv
  configure_process()
  if FLAGS.part:
    result = growth() if FLAGS.part == "growth" else grown_first()
    print(json.dumps({**result, "device": jax.devices()[0].device_kind}), flush=True)
    return
  args = [a for a in sys.argv[1:] if not a.startswith("--out")]
  results = {}  # this process starts no backend: it would take the GPU's memory from the parts
  for part in ("growth", "grown_first"):
    run = subprocess.run([sys.executable, "-m", "benchmarks.pinned_pool", f"--part={part}", *args],
                         capture_output=True, text=True, check=False)
    if run.returncode:
      raise RuntimeError(f"part {part} failed:\n{run.stderr[-3000:]}")
    results.update(json.loads(run.stdout.strip().splitlines()[-1]))
  device = results.pop("device")
  write_results(FLAGS.out, {**provenance(device), "unit_bytes": unit(), **results})
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  app.run(main)
