"""How much of one step's PCIe traffic hides behind compute, from a jax.profiler perfetto trace.

  python benchmarks/trace_overlap.py TRACE.json.gz --out=benchmarks/results/overlap.json --png=overlap.png

The trace comes from `benchmarks/train_throughput.py --trace_dir=...` (one traced step). Prints the step's span,
the time the GPU computes, copies host->device and device->host, and how much copy time runs while it computes; the
PNG (needs matplotlib) draws the three lanes on one time axis.
"""

import gzip
import json
import sys

from absl import app, flags

flags.DEFINE_string("out", "", "Write the summary JSON here.")
flags.DEFINE_string("png", "", "Draw the timeline here (needs matplotlib).")
FLAGS = flags.FLAGS


def lanes(trace: dict) -> dict[str, list[tuple[float, float]]]:
  """GPU intervals in microseconds: kernels (compute), MemcpyH2D, MemcpyD2H."""
  gpu = {e["pid"] for e in trace["traceEvents"]
         if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"]["name"]}
  out = {"compute": [], "host_to_device": [], "device_to_host": []}
  for e in trace["traceEvents"]:
    if e.get("ph") != "X" or e["pid"] not in gpu:
      continue
    lane = {"MemcpyH2D": "host_to_device", "MemcpyD2H": "device_to_host"}.get(e["name"])
    if lane is None and not e["name"].startswith(("Memset", "MemcpyD2D")):
      lane = "compute"
    if lane:
      out[lane].append((e["ts"], e["ts"] + e["dur"]))
  return out


def union(intervals):
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return merged


def overlap(a, b) -> float:
  """Total length of the intersection of two merged interval lists."""
  total, i, j = 0.0, 0, 0
  while i < len(a) and j < len(b):
    total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def summarize(trace: dict) -> dict:
  merged = {name: union(intervals) for name, intervals in lanes(trace).items()}
  busy = {name: sum(end - start for start, end in m) / 1e6 for name, m in merged.items()}
  start = min(m[0][0] for m in merged.values() if m)
  end = max(m[-1][1] for m in merged.values() if m)
  copies = union(merged["host_to_device"] + merged["device_to_host"])
  copy_seconds = sum(e - s for s, e in copies) / 1e6
  hidden = overlap(copies, merged["compute"]) / 1e6
  return {"span_s": (end - start) / 1e6, "busy_s": busy, "copy_s": copy_seconds, "copy_hidden_by_compute_s": hidden,
          "copy_hidden_fraction": hidden / copy_seconds if copy_seconds else None,
          "compute_fraction_of_span": busy["compute"] * 1e6 / (end - start)}, merged, start


def draw(merged, start, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(14, 2.6))
  colors = {"compute": "tab:green", "host_to_device": "tab:blue", "device_to_host": "tab:orange"}
  for row, (name, intervals) in enumerate(merged.items()):
    ax.broken_barh([((s - start) / 1e3, (e - s) / 1e3) for s, e in intervals], (row - 0.4, 0.8), color=colors[name])
  ax.set_yticks(range(len(merged)), list(merged))
  ax.set_xlabel("ms since the step's first GPU event")
  ax.invert_yaxis()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  with gzip.open(argv[1]) as f:
    summary, merged, start = summarize(json.load(f))
  summary["trace"] = argv[1]
  print(json.dumps(summary, indent=1))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(summary | {"command": " ".join(sys.argv)}, f, indent=1)
  if FLAGS.png:
    draw(merged, start, FLAGS.png)


if __name__ == "__main__":
  app.run(main)
