"""The compiled sizes behind sljax.plan's GPU_PEAK_BYTES and GPU_BACKWARD_PEAK_BYTES (what corrects a plan made on a
CPU for a GPU, sljax.plan.gpu_peak_from_cpu), as this process's backend compiles the engine's calls.

  python -m benchmarks.gpu_peak_calibration --out=benchmarks/results/gpu_peak_calibration_h200.json   # on the GPU
  python -m benchmarks.gpu_peak_calibration --smoke --out=/tmp/peaks.json       # llama-tiny at 2 x 64, on a CPU

For the reference (sljax.plan.GPU_PEAK_MODEL without remat, one layer a group, a sub-batch of GPU_PEAK_ROWS x
GPU_PEAK_SEQ): XLA's (temp, output) bytes of each of the last group's calls (one layer's forward keeping its
residuals, the head, one layer's backward) and of another group's backward; one layer's residuals; and the two
figures the constants hold: the last group's calls as the one call they replace (its outputs, the residuals, the
largest scratch) and the backward's temp + output bytes. Nothing is allocated: the calls are only compiled.
"""

import dataclasses

from absl import app, flags

from benchmarks.common import define_flags, provenance, write_results
from models.presets import build, get_config
from sljax import plan
from sljax.machines import GIB

define_flags("llama-tiny at 2 x 64 rows (a CPU checks the code path)")
FLAGS = flags.FLAGS


def calibration(model_name: str, rows: int, seq: int) -> dict:
  reference = build(dataclasses.replace(get_config(model_name), remat=False))
  return {"model": model_name, "rows": rows, "seq": seq, **plan.peak_calibration(reference, rows, seq)}


def main(_):
  args = ("llama-tiny", 2, 64) if FLAGS.smoke else (plan.GPU_PEAK_MODEL, plan.GPU_PEAK_ROWS, plan.GPU_PEAK_SEQ)
  results = {**provenance(), "benchmark": "compiled sizes behind sljax.plan.GPU_PEAK_BYTES", **calibration(*args)}
  write_results(FLAGS.out, results)
  print({key: round(value / GIB, 3) if isinstance(value, int) and key.endswith("bytes_equivalent") else value
         for key, value in results.items() if key not in ("env", "versions")})


if __name__ == "__main__":
  app.run(main)
