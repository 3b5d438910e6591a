"""Generation throughput on one GPU: sljax's offloaded generator on models whose weights and cache exceed the GPU.

  python -m benchmarks.generate_throughput --models=llama70b --out=benchmarks/results/generate_llama70b_h200.json
  python -m benchmarks.generate_throughput --models=opt-30b --out=benchmarks/results/generate_opt30b_h200.json
  python -m benchmarks.generate_throughput --smoke --out=/tmp/generate_smoke.json   # tiny shapes, any machine

Per model: random bf16 weights, made one layer group at a time straight into their place (device or pinned host);
random prompts of --prompt_len tokens; the plan's batch and layout unless flags fix them; one warm-up generation
(2 new tokens, same shapes: it compiles everything), then one timed greedy generation of --new_tokens. Recorded:
tokens/s for the prompt pass, for decoding and overall; bytes moved per generated token (planned and counted); the
measured pinned host<->device bandwidth and the decode throughput it bounds; the plan's own estimates.
Same workload through transformers + accelerate: benchmarks.baselines.hf_accelerate_generate.
"""

import gc
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import GENERATION_SMOKE, define_flags, provenance, write_results
from models.presets import build, get_config
from sljax.flags import define
from sljax.generate import OffloadConfig, OffloadedGenerator, SamplingConfig
from sljax.generate_plan import memory_budgets, plan
from sljax.machines import GIB, configure_process
from sljax.memory import Placement

flags.DEFINE_list("models", ["llama70b", "opt-30b"], "Presets to run, in order.")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 32, "Generated tokens per row.")
flags.DEFINE_integer("batch", 0, "Rows (0: the plan's choice).")
# The layout's knobs, one flag per OffloadConfig field; those the plan searches are its choice unless given.
OFFLOAD = define(OffloadConfig, unset={name: "the plan's choice" for name in ("sub_batches", "resident_layers",
                                                                             "kv_on_host")},
                 help={"resident_bits": "The same for the resident layers.",
                       "weight_group_size": "Rows per scale of compressed kernels."})
flags.DEFINE_float("device_memory_gib", 0, "Device memory the plan may use (0: the allocator's limit less a margin).")
# Its default and its XLA settings are generate.py's: the same flags plan the same layout.
flags.DEFINE_float("host_memory_gib", 0, "Pinned host memory the plan may use (0: the default host budget, as "
                   "generate.py's).")
flags.DEFINE_integer("host_buffers", 0, "Distinct pinned-host weight groups per group size (0: one per streamed "
                     "group); fewer are reused for the rest when the model exceeds host RAM.")
flags.DEFINE_integer("retries", 2, "On running out of device memory, retry with a 10% smaller device budget.")
flags.DEFINE_float("bandwidth_gib", 2, "Size of the buffer timed for the host<->device bandwidth.")
define_flags("Tiny shapes, a streamed layout: checks every code path on any machine.",
             out="Write the results JSON here (rewritten after every model).")
FLAGS = flags.FLAGS


def measure_bandwidth(nbytes: int, reps: int = 5) -> dict:
  """Median bytes/s of pinned host -> device, device -> pinned host, and both at once (total)."""
  place = Placement.single()
  elements = nbytes // 2
  on_host = jax.jit(lambda: jnp.zeros(elements, jnp.bfloat16), out_shardings=place.host())()
  on_device = jax.jit(lambda: jnp.ones(elements, jnp.bfloat16), out_shardings=place.device())()

  def rate(copies):
    jax.block_until_ready(copies())  # warm-up
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      jax.block_until_ready(copies())
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  to_device = lambda: jax.device_put(on_host, place.device())
  to_host = lambda: jax.device_put(on_device, place.host())
  return {"host_to_device": nbytes / rate(to_device), "device_to_host": nbytes / rate(to_host),
          "both_directions": 2 * nbytes / rate(lambda: (to_device(), to_host())), "buffer_bytes": nbytes}


def model_config(name: str):
  overrides = dict(dtype="bfloat16", param_dtype="bfloat16")
  if FLAGS.smoke:
    overrides.update(GENERATION_SMOKE[get_config(name).family])
  return get_config(name, overrides)


def is_out_of_memory(error: Exception) -> bool:
  text = str(error).lower()
  return "resource_exhausted" in text or "out of memory" in text


def run_model(name: str, bandwidth: dict) -> dict:
  cfg = model_config(name)
  prompt_len, new_tokens = (16, 4) if FLAGS.smoke else (FLAGS.prompt_len, FLAGS.new_tokens)
  device_budget, host_budget = memory_budgets()
  device_budget = int(FLAGS.device_memory_gib * GIB) or device_budget
  host_budget = int(FLAGS.host_memory_gib * GIB) or host_budget
  fixed = dict(OFFLOAD.given(), batch=FLAGS.batch or None)
  if FLAGS.smoke:
    fixed = dict(fixed, batch=fixed["batch"] or 4, sub_batches=fixed.get("sub_batches", 2), resident_layers=1,
                 kv_on_host=fixed.get("kv_on_host", True))
  failures = []
  for _ in range(FLAGS.retries + 1):
    chosen = plan(cfg, prompt_len, new_tokens, device_budget, host_budget, **fixed)
    print(f"{name}: plan\n{chosen.describe(cfg)}", flush=True)
    try:
      return {"model": name, **measure(cfg, chosen, prompt_len, new_tokens, bandwidth), "oom_retries": failures}
    except Exception as error:  # noqa: BLE001 -- only running out of device memory is retried
      if not is_out_of_memory(error):
        raise
      failures.append({"device_budget_bytes": device_budget, "error": str(error).splitlines()[0][:300]})
      print(f"{name}: out of device memory at a {device_budget / GIB:.1f} GiB budget; retrying 10% lower", flush=True)
    device_budget = int(0.9 * device_budget)
    gc.collect()  # out here, the error's traceback no longer holds the failed attempt's arrays
  return {"model": name, "error": "out of device memory at every budget tried", "oom_retries": failures}


def measure(cfg, chosen, prompt_len: int, new_tokens: int, bandwidth: dict) -> dict:
  batch, offload = chosen.batch, chosen.offload
  generator = OffloadedGenerator(build(cfg), offload)
  start = time.perf_counter()
  weights = jax.block_until_ready(generator.init(jax.random.key(0), host_buffers=FLAGS.host_buffers or None))
  init_seconds = time.perf_counter() - start
  streamed = [id(group) for group, resident in zip(weights["groups"], generator.resident) if not resident]
  distinct = len(set(streamed))
  kinds = {f"{what} int{bits} kernels" for what, bits in (("streamed", offload.streamed_bits),
                                                          ("resident", offload.resident_bits)) if bits < 16}
  weights_note = (f"random bf16{' (' + ', '.join(sorted(kinds)) + ')' if kinds else ''}, {distinct} distinct "
                  f"pinned-host buffers for {len(streamed)} streamed groups")
  if distinct < len(streamed):
    weights_note += " (reused: the same bytes cross PCIe and the same FLOPs run, but the weights repeat)"

  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len))
  max_len = prompt_len + new_tokens
  start = time.perf_counter()
  generator.generate(weights, prompts, SamplingConfig(max_new_tokens=min(2, new_tokens)), max_len=max_len)
  warmup_seconds = time.perf_counter() - start
  before = dict(generator.place.moved)
  result = generator.generate(weights, prompts, SamplingConfig(max_new_tokens=new_tokens))
  moved = {k: generator.place.moved[k] - before[k] for k in before}

  decode_passes = new_tokens - 1
  decode_in, decode_out = chosen.decode.host_to_device, chosen.decode.device_to_host
  io_seconds = max(decode_in / bandwidth["host_to_device"], decode_out / bandwidth["device_to_host"],
                   (decode_in + decode_out) / bandwidth["both_directions"])
  decode_tokens_per_s = batch * decode_passes / result.decode_seconds if decode_passes else None
  bound = batch / io_seconds if io_seconds else None  # None: nothing crosses PCIe while decoding
  figures = {
      "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
      "prefill_tokens_per_s": batch * prompt_len / result.prefill_seconds,
      "decode_tokens_per_s": decode_tokens_per_s,
      "generation_tokens_per_s": batch * new_tokens / (result.prefill_seconds + result.decode_seconds),
      "decode_pass_seconds": result.decode_seconds / decode_passes if decode_passes else None,
      "planned_bytes_per_decode_pass": {"host_to_device": decode_in, "device_to_host": decode_out},
      "planned_bytes_per_decode_token": (decode_in + decode_out) / batch,
      "planned_bytes_per_prefill_token": (chosen.prefill.host_to_device + chosen.prefill.device_to_host) / (
          batch * prompt_len),
      "counted_bytes_moved": moved, "counted_bytes_per_generated_token": sum(moved.values()) / (batch * new_tokens),
      "decode_io_seconds_per_pass_at_measured_bandwidth": io_seconds,
      "decode_bandwidth_bound_tokens_per_s": bound,
      "decode_fraction_of_bandwidth_bound": decode_tokens_per_s / bound if bound else None,
      # Near 1: the copies alone take the whole pass (I/O-bound); near 0: compute or dispatch bound.
      "decode_io_share_of_pass": io_seconds * decode_passes / result.decode_seconds if decode_passes else None,
      "estimated_tokens_per_s": chosen.tokens_per_s, "estimated_prefill_seconds": chosen.prefill.seconds,
      "estimated_decode_pass_seconds": chosen.decode.seconds,
      "init_seconds": init_seconds, "warmup_seconds": warmup_seconds, "weights": weights_note,
      "peak_device_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
      "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      "config": {"model": cfg.__dict__, "plan": chosen.as_dict(), "plan_text": chosen.describe(cfg)},
      "first_tokens": result.tokens[:2].tolist(),
  }
  print(f"prefill {figures['prefill_tokens_per_s']:.0f} tok/s, decode {decode_tokens_per_s or 0:.1f} tok/s "
        f"(bandwidth bound {bound or float('inf'):.1f}), overall {figures['generation_tokens_per_s']:.1f} tok/s",
        flush=True)
  return figures


def write(results: list, bandwidth: dict):
  write_results(FLAGS.out, {**provenance(), "platform": jax.devices()[0].platform, "smoke": FLAGS.smoke,
                            "bandwidth_bytes_per_s": bandwidth, "results": results})


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments {' '.join(argv[1:])}")
  try:  # the layout flags' own checks and XLA's limits, before anything is allocated
    OFFLOAD.build()
    configure_process(FLAGS.host_memory_gib)
  except ValueError as error:
    raise SystemExit(f"sljax: {error}")
  bandwidth = measure_bandwidth(int((0.01 if FLAGS.smoke else FLAGS.bandwidth_gib) * GIB))
  print("bandwidth GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bandwidth.items() if k != "buffer_bytes"),
        flush=True)
  results = []
  for name in FLAGS.models:
    results.append(run_model(name, bandwidth))
    write(results, bandwidth)
    gc.collect()


if __name__ == "__main__":
  app.run(main)
