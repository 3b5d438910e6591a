"""How busy the GPU is in one step and how much of its PCIe traffic hides behind compute, from a jax.profiler
perfetto trace.

  python -m benchmarks.trace_overlap TRACE_DIR_OR_FILE --out=benchmarks/results/overlap.json --png=overlap.png
  python -m benchmarks.trace_overlap --smoke --out=/tmp/overlap_smoke.json   # a made-up trace of a few events

The trace comes from `python -m benchmarks.train_throughput --trace_cases=CASE --trace_dir=DIR` (one traced step;
given DIR, the newest trace in it is read). Prints the step's span, the time the GPU computes (and the gaps in which
it runs no kernel, and those that ended as a copy ended in them; for the longest, the copies in each and
where the thread that dispatches the calls was held),
copies host->device and device->host, and how much copy time runs while it computes; the PNG
(needs matplotlib) draws the three lanes on one time axis. train_throughput calls these functions itself.
"""

import bisect
import collections
import glob
import gzip
import json
import os

from absl import app, flags

from benchmarks.common import define_flags, provenance, write_results

FLAGS = flags.FLAGS
IDLE_GAP_US = 100  # idle gaps at least this long are counted (shorter ones are kernel launch latency)
LARGEST_GAPS = 5  # the summary lists this many of the longest

# XLA's GPU client starts a copy into device memory only after the calls issued before it, so a call that needs the
# copied array can find it still crossing: a gap that ends within this long after a copy ends (a kernel launched on
# the copy's completion) is counted as waiting for that copy, in either direction.
COPY_WAIT_US = 50
HOST_LEVELS = 4  # how many of the innermost events the dispatching thread was in are kept for each largest gap
WINDOWS = 20  # the summary's timeline cuts the span into this many equal windows
MODULES = 8  # the summary names this many of the jitted programs whose kernels take the most time
# The profiler's own overhead: CUPTI flushing its activity buffers (CUPTI_ACTIVITY_OVERHEAD_CUPTI_BUFFER_FLUSH), a host
# event of this name. While it runs, CUDA calls of the dispatching thread wait (seen on the H200: the thread held in
# cuLaunchHostFunc from the flush's first to its last microsecond), so a traced step idles where an untraced one need
# not.
PROFILER_FLUSH = "BUFFER_FLUSH"

# A GPU computing 0-100 (one program), 150-200 and 350-400 us (another), copying in 50-120 us and out 180-190 us (a CPU
# event is left out): 60 us of its 80 us of copies run while it computes; it runs kernels 200 of the 400 us, idle in a
# gap of 50 us and one of 150 us (the one over IDLE_GAP_US, 200 us after the start), through which the thread that
# dispatches the kernels is held in one dispatch, 60 us of it while the profiler flushes its buffers.
SMOKE_TRACE = {"traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
    {"ph": "X", "pid": 2, "tid": 3, "name": "step", "ts": 0, "dur": 400},
    {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(forward)", "ts": 90, "dur": 5},
    {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(layers)", "ts": 210, "dur": 130},
    {"ph": "X", "pid": 2, "tid": 3, "name": "cuLaunchHostFunc", "ts": 220, "dur": 110},
    {"ph": "X", "pid": 1, "tid": 7, "name": "fusion", "ts": 0, "dur": 100, "args": {"hlo_module": "jit_update"}},
    {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 150, "dur": 50, "args": {"hlo_module": "jit_layers"}},
    {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 350, "dur": 50, "args": {"hlo_module": "jit_layers"}},
    {"ph": "X", "pid": 1, "tid": 8, "name": "MemcpyH2D", "ts": 50, "dur": 70},
    {"ph": "X", "pid": 1, "tid": 8, "name": "MemcpyD2H", "ts": 180, "dur": 10},
    {"ph": "X", "pid": 2, "tid": 1, "name": "MemcpyH2D", "ts": 0, "dur": 500},
    {"ph": "X", "pid": 2, "tid": 4, "name": "BUFFER_FLUSH", "ts": 250, "dur": 60},
]}


def _gpu_pids(trace: dict) -> set:
  return {e["pid"] for e in trace["traceEvents"]
          if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"]["name"]}


def _lane(event) -> str | None:
  """Which lane a GPU event is in: a copy's direction, compute for any other kernel, None for memsets and copies on
  the device."""
  lane = {"MemcpyH2D": "host_to_device", "MemcpyD2H": "device_to_host"}.get(event["name"])
  if lane is None and not event["name"].startswith(("Memset", "MemcpyD2D")):
    lane = "compute"
  return lane


def lanes(trace: dict) -> dict[str, list[tuple[float, float]]]:
  """GPU intervals in microseconds: kernels (compute), MemcpyH2D, MemcpyD2H."""
  gpu = _gpu_pids(trace)
  out = {"compute": [], "host_to_device": [], "device_to_host": []}
  for e in trace["traceEvents"]:
    if e.get("ph") == "X" and e["pid"] in gpu and _lane(e):
      out[_lane(e)].append((e["ts"], e["ts"] + e["dur"]))
  return out


def compute_threads(trace: dict) -> dict[str, float]:
  """Seconds of compute per GPU trace line (thread): each should be a stream ("Stream #N(...)"), not a line of
  spans that cover whole programs, which would count their idle gaps as busy."""
  gpu = _gpu_pids(trace)
  names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
           if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu}
  per_thread = {}
  for e in trace["traceEvents"]:
    if e.get("ph") == "X" and e["pid"] in gpu and _lane(e) == "compute":
      per_thread.setdefault(names.get((e["pid"], e.get("tid")), str(e.get("tid"))), []).append(
          (e["ts"], e["ts"] + e["dur"]))
  return {name: sum(end - start for start, end in union(intervals)) / 1e6 for name, intervals in per_thread.items()}


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


def idle_gaps(compute, start: float, end: float) -> dict:
  """Where the GPU runs no kernel between `start` and `end` (us; `compute`: merged kernel intervals): idle seconds,
  how many gaps last IDLE_GAP_US or more, and the LARGEST_GAPS longest (ms, and how long after `start` each began)."""
  edges = [start] + [t for interval in compute for t in interval] + [end]
  gaps = [(a, b - a) for a, b in zip(edges[::2], edges[1::2]) if b > a]  # before each kernel, and after the last
  longest = sorted(gaps, key=lambda gap: -gap[1])[:LARGEST_GAPS]
  return {"idle_s": sum(length for _, length in gaps) / 1e6,
          f"idle_gaps_over_{IDLE_GAP_US}us": sum(length >= IDLE_GAP_US for _, length in gaps),
          "largest_idle_gaps": [{"ms": length / 1e3, "at_ms": (at - start) / 1e3} for at, length in longest]}


def waiting_for_copies(compute, copies, start: float, end: float) -> list[tuple[float, float]]:
  """The idle gaps (start, length in us) between `start` and `end` that ended as a copy (`copies`: merged intervals)
  ended inside them, at most COPY_WAIT_US before: the GPU waited for that copy."""
  edges = [start] + [t for interval in compute for t in interval] + [end]
  copy_ends = sorted(b for _, b in copies)
  waited = []
  for a, b in zip(edges[::2], edges[1::2]):
    i = bisect.bisect_right(copy_ends, b) - 1
    if b > a and i >= 0 and a < copy_ends[i] and b - copy_ends[i] <= COPY_WAIT_US:
      waited.append((a, b - a))
  return waited


def dispatch_thread(trace: dict) -> tuple | None:
  """(pid, tid) of the host thread that dispatched the jitted calls: the one with the most PjitFunction events."""
  counts = collections.Counter((e["pid"], e.get("tid")) for e in trace["traceEvents"]
                               if e.get("ph") == "X" and e["name"].startswith("PjitFunction"))
  return counts.most_common(1)[0][0] if counts else None


def gap_context(trace: dict, merged: dict, gap: dict, start: float, thread: tuple | None) -> dict:
  """What went on in one idle gap (`gap`: an entry of idle_gaps' largest): milliseconds each copy direction was busy
  in it, the innermost HOST_LEVELS events the dispatching thread (`thread`) was in at its middle (outermost first),
  and the HOST_LEVELS events of other host threads that overlap it most (milliseconds each). A GPU with no work left
  while that thread is held in one dispatch ran out of dispatched work; a gap with the thread free waited on a
  copy."""
  at = start + gap["at_ms"] * 1e3
  end, middle = at + gap["ms"] * 1e3, at + gap["ms"] * 500
  copies = {lane: overlap(merged[lane], [[at, end]]) / 1e3 for lane in ("host_to_device", "device_to_host")}
  held = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e.get("tid")) == thread
                 and e["ts"] <= middle <= e["ts"] + e["dur"]), key=lambda e: (e["ts"], -e["dur"]))
  gpu, others = _gpu_pids(trace), collections.Counter()
  for e in trace["traceEvents"]:
    if (e.get("ph") == "X" and e["pid"] not in gpu and (e["pid"], e.get("tid")) != thread and e["ts"] < end
        and e["ts"] + e["dur"] > at):
      others[e["name"]] += (min(e["ts"] + e["dur"], end) - max(e["ts"], at)) / 1e3
  return {"copies_ms": copies, "dispatch_thread_in": [e["name"] for e in held][-HOST_LEVELS:],
          "other_threads_ms": dict(others.most_common(HOST_LEVELS)),
          "profiler_flush_ms": overlap(profiler_flushes(trace), [[at, end]]) / 1e3}


def profiler_flushes(trace: dict) -> list:
  """Merged intervals (us) in which the profiler flushed its buffers (PROFILER_FLUSH events)."""
  return union([(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                if e.get("ph") == "X" and e["name"] == PROFILER_FLUSH])


def kernel_share(summary: dict, step_seconds: float) -> float:
  """A traced step's kernel seconds (`summary`: summarize's) over an untraced step's `step_seconds`: the GPU's busy
  fraction without the profiler's own idle (PROFILER_FLUSH), since tracing leaves the kernels as they are."""
  return min(summary["busy_s"]["compute"] / step_seconds, 1.0)


def compute_by_module(trace: dict) -> dict[str, float]:
  """Kernel seconds per jitted program (the kernels' hlo_module), the MODULES longest, the rest as "other"."""
  gpu, seconds = _gpu_pids(trace), collections.Counter()
  for e in trace["traceEvents"]:
    if e.get("ph") == "X" and e["pid"] in gpu and _lane(e) == "compute":
      seconds[e.get("args", {}).get("hlo_module", "unnamed")] += e["dur"] / 1e6
  top = dict(seconds.most_common(MODULES))
  rest = sum(seconds.values()) - sum(top.values())
  return top | ({"other": rest} if rest > 0 else {})


def timeline(merged: dict, start: float, end: float, windows: int = WINDOWS) -> list[dict]:
  """The span cut into `windows` equal windows, each with the fraction of it each lane was busy: where in the step
  the GPU waited, and whether the copies were running flat out then."""
  width = (end - start) / windows
  cuts = [[start + i * width, start + (i + 1) * width] for i in range(windows)]
  return [{"at_ms": (a - start) / 1e3, **{lane: overlap(m, [[a, b]]) / width for lane, m in merged.items()}}
          for a, b in cuts]


def summarize(trace: dict) -> tuple[dict, dict, float]:
  """(The summary, the merged lanes, the span's start in us). ValueError for a trace without GPU events."""
  merged = {name: union(intervals) for name, intervals in lanes(trace).items()}
  if not any(merged.values()):
    raise ValueError("the trace has no GPU events (taken on a machine without a GPU?)")
  busy = {name: sum(end - start for start, end in m) / 1e6 for name, m in merged.items()}
  start = min(m[0][0] for m in merged.values() if m)
  end = max(m[-1][1] for m in merged.values() if m)
  copies = union(merged["host_to_device"] + merged["device_to_host"])
  copy_seconds = sum(e - s for s, e in copies) / 1e6
  hidden = overlap(copies, merged["compute"]) / 1e6
  gaps = idle_gaps(merged["compute"], start, end)
  flushing = [[max(a, start), min(b, end)] for a, b in profiler_flushes(trace) if b > start and a < end]
  busy_or_flushing = union(merged["compute"] + flushing)
  # Idle time in which the profiler flushed: the trace's own cost (see PROFILER_FLUSH).
  gaps["idle_while_profiler_flushed_s"] = gaps["idle_s"] - idle_gaps(busy_or_flushing, start, end)["idle_s"]
  waited = {lane: waiting_for_copies(merged["compute"], merged[lane], start, end)
            for lane in ("host_to_device", "device_to_host")}
  gaps["idle_waiting_for_copies_s"] = {lane: sum(length for _, length in w) / 1e6 for lane, w in waited.items()}
  gaps["idle_gaps_waiting_for_copies"] = {lane: len(w) for lane, w in waited.items()}
  waited_at = {lane: {round((at - start) / 1e3, 9) for at, _ in w} for lane, w in waited.items()}
  thread = dispatch_thread(trace)
  gaps["largest_idle_gaps"] = [{**gap, **gap_context(trace, merged, gap, start, thread),
                                "waited_for_copy": [lane for lane, at in waited_at.items()
                                                    if round(gap["at_ms"], 9) in at]}
                               for gap in gaps["largest_idle_gaps"]]
  return {"span_s": (end - start) / 1e6, "busy_s": busy, "copy_s": copy_seconds, "copy_hidden_by_compute_s": hidden,
          "copy_hidden_fraction": hidden / copy_seconds if copy_seconds else None,
          "compute_fraction_of_span": busy["compute"] * 1e6 / (end - start),
          **gaps, "compute_threads": compute_threads(trace), "compute_s_by_module": compute_by_module(trace),
          "timeline": timeline(merged, start, end)}, merged, start


def newest_trace(path: str) -> str:
  """`path` if it is a trace file, else the newest perfetto trace that jax.profiler.trace(path,
  create_perfetto_trace=True) wrote under it. ValueError when there is none."""
  if os.path.isfile(path):
    return path
  found = glob.glob(os.path.join(path, "plugins", "profile", "*", "perfetto_trace.json.gz"))
  if not found:
    raise ValueError(f"no perfetto_trace.json.gz under {path}/plugins/profile: trace with create_perfetto_trace=True")
  return max(found, key=os.path.getmtime)


def load(path: str) -> dict:
  with gzip.open(path) as f:
    return json.load(f)


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
  if not FLAGS.smoke and len(argv) != 2:
    raise app.UsageError("give one trace (a TRACE.json.gz, or the directory jax.profiler.trace wrote), or --smoke")
  try:
    path = None if FLAGS.smoke else newest_trace(argv[1])
    summary, merged, start = summarize(SMOKE_TRACE if FLAGS.smoke else load(path))
  except ValueError as error:
    raise app.UsageError(str(error)) from None
  summary["trace"] = path
  print(json.dumps(summary, indent=1))
  write_results(FLAGS.out, {**provenance(device=None), **summary})
  if FLAGS.png:
    draw(merged, start, FLAGS.png)


if __name__ == "__main__":
  # Flags only for the program: train_throughput imports this module, and --out, --smoke are its flags too.
  define_flags("Summarize SMOKE_TRACE instead of a trace file: checks the code path anywhere.",
               out="Write the summary JSON here.")
  flags.DEFINE_string("png", "", "Draw the timeline here (needs matplotlib).")
  app.run(main)
