"""Training throughput on one GPU: the SpeedLoader engine against the plain step and two streaming baselines.

  python -m benchmarks.train_throughput --out=benchmarks/results/train_throughput_h200.json
  python -m benchmarks.train_throughput --smoke   # tiny shapes, any machine: checks the code paths

Cases (each recorded with tokens/s, MFU, hardware FLOPs utilization, peak device / host memory, bytes moved):
  big        llama13b, seq 2048, the plan's placement (its training state fits neither the GPU nor host RAM alone)
  fits/*     a model that fits on the device, same batch:
             device      the plain all-on-device jitted step (scan over layers, remat)
             engine      the engine, placed by the plan (all on the device when it fits)
             streamed    the engine with everything on the host (weights, state, activations)
             per_micro   weights streamed per micro-batch with gradient accumulation (what ZeRO-3 offload does)
             in_jit_scan weights streamed by a lax.scan inside one jit with device_put in its body (JAX's native way)
"""

import dataclasses
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jax import lax

from benchmarks.common import batch_of, define_flags, provenance, set_xla_memory, timed, write_results
from models.presets import build, get_config, parse_overrides
from sljax import plan as planner
from sljax.machines import GIB, default_budget, rates_of
from sljax.memory import Placement, prefetch
from sljax.schedule import Engine

# The pinned pool is capped above the plan's default --host_memory_gib: uncapped, it grows by doubling past what the
# 128 GiB machine has.
set_xla_memory(pinned_pool_gib=96)

define_flags("Tiny shapes: checks every code path on any machine in a minute.")
flags.DEFINE_list("cases", "big,fits", "Which cases to run.")
flags.DEFINE_integer("big_batch", 32, "llama13b effective batch (sequences of --seq_len).")
flags.DEFINE_integer("fits_batch", 16, "Effective batch of the model that fits.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
flags.DEFINE_integer("steps", 3, "Timed steps per case (after one warm-up step).")
flags.DEFINE_string("fits_model", "llama7b", "Preset of the model that fits.")
flags.DEFINE_multi_string("fits_set", ["num_layers=8"], "Overrides of the model that fits.")
flags.DEFINE_list("fits_cases", "device,engine,streamed,per_micro_batch,in_jit_scan", "Which cases of the model that "
                  "fits to run.")
flags.DEFINE_string("trace_dir", "", "Write a jax.profiler (perfetto) trace of one step of --trace_case here.")
flags.DEFINE_string("trace_case", "fits/streamed", "Case whose step is traced.")
flags.DEFINE_float("host_memory_gib", 85, "Pinned host memory the plan may use (below XLA's pinned pool limit).")
FLAGS = flags.FLAGS

def hardware_flops_per_token(cfg, seq, recomputed_fraction):
  """Model FLOPs plus the forward passes the schedule runs twice (a third of a layer's training FLOPs each)."""
  layer_part = cfg.flops_per_token(seq) - 6 * cfg.vocab_size * cfg.embed_dim
  return cfg.flops_per_token(seq) + recomputed_fraction * layer_part / 3


def device_peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def peak_flops() -> float:
  """This GPU's peak from sljax.machines (on CPU, the reference machine's: smoke runs' MFU means nothing)."""
  return rates_of(jax.devices()[0].device_kind).peak_flops


def record(name, cfg, rows, seq, seconds, times, losses, recomputed_fraction, extra):
  tokens_per_s = rows * seq / seconds
  result = {
      "case": name, "tokens_per_s": tokens_per_s, "step_seconds": seconds, "step_seconds_all": times,
      "losses": losses, "mfu": tokens_per_s * cfg.flops_per_token(seq) / peak_flops(),
      "hfu": tokens_per_s * hardware_flops_per_token(cfg, seq, recomputed_fraction) / peak_flops(),
      "peak_device_bytes": device_peak_bytes(), "peak_host_rss_bytes": resource.getrusage(
          resource.RUSAGE_SELF).ru_maxrss * 1024, **extra}
  print(f"{name:28s} {tokens_per_s:10.0f} tok/s  MFU {result['mfu']:.3f}  HFU {result['hfu']:.3f}  "
        f"step {seconds:.3f} s", flush=True)
  return result


def run_engine(name, model, optimizer, engine_cfg, batch, steps, key):
  engine = Engine(model, optimizer, engine_cfg)
  start = time.perf_counter()
  state = jax.block_until_ready(engine.init(key))
  print(f"{name}: initialized in {time.perf_counter() - start:.0f} s", flush=True)
  before = dict(engine.place.moved)
  seconds, times, losses, state = timed(engine.step, state, batch, steps)
  moved = {k: (engine.place.moved[k] - before[k]) // (steps + 1) for k in before}  # every step moves the same
  if FLAGS.trace_dir and name == FLAGS.trace_case:
    with jax.profiler.trace(FLAGS.trace_dir, create_perfetto_trace=True):
      state, loss = engine.step(state, batch)
      jax.block_until_ready(loss)
  groups = len(engine.groups)
  rows, seq = batch["inputs"].shape
  return record(name, model.cfg, rows, seq, seconds, times, losses, (groups - 1) / groups,
                {"engine": dataclasses.asdict(engine_cfg), "bytes_moved_per_step": moved})


def all_on_device_step(model, optimizer):
  def step(state, batch):
    loss, grads = jax.value_and_grad(model.loss)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss
  return jax.jit(step, donate_argnums=0)


def per_micro_batch_step(engine: Engine, micro_batches: int):
  """ZeRO-3-offload order: every micro-batch streams every group's weights in and out again; group gradients
  accumulate on the device across micro-batches (kinder to the baseline than ZeRO's host accumulation); then one
  update per group. Runs the engine's own jitted calls, so only the order differs."""
  place, calls = engine.place, engine.calls

  def step(state, batch):
    outer, groups = state["outer"], state["groups"]
    grads = [calls.zeros(calls.fetch_weights(g)) for g in groups]
    outer_grads = calls.zeros(outer)
    inv_total = np.float32(1.0 / np.sum(batch["weights"]))
    losses = []
    for part in range(micro_batches):
      rows = slice(part * len(batch["inputs"]) // micro_batches, (part + 1) * len(batch["inputs"]) // micro_batches)
      tokens, targets, weights = (place.to_device(batch[k][rows]) for k in ("inputs", "targets", "weights"))
      order = list(range(len(groups))) + list(range(len(groups) - 2, -1, -1))
      stream = prefetch([groups[g] for g in order], calls.fetch_weights)
      xs = [calls.embed(outer, tokens)]
      for _ in range(len(groups) - 1):
        xs.append(calls.forward(next(stream), xs[-1]))
      loss, dx, grads[-1], outer_grads = calls.last_group(
          next(stream), outer, xs[-1], targets, weights, inv_total, grads[-1], outer_grads)
      losses.append(loss)
      for g in range(len(groups) - 2, -1, -1):
        dx, grads[g] = calls.backward(next(stream), xs[g], dx, grads[g])
      outer_grads = calls.embed_backward(outer, tokens, dx, outer_grads)
    zero, ok = jnp.zeros((), jnp.float32), jnp.ones((), bool)
    new_groups = [calls.apply(g, place.to_device((group["master"], group["opt"])), place.reduce(grads[g]), zero, ok)
                  for g, group in enumerate(groups)]
    outer_grads, loss = place.reduce((outer_grads, sum(losses)), sharded=False)  # per-device slots -> sums
    new_outer, new_opt = calls.update(outer, state["outer_opt"], outer_grads, zero, ok)
    return {"step": state["step"] + 1, "outer": new_outer, "outer_opt": new_opt, "groups": new_groups}, loss
  return step


def in_jit_scan_step(model, optimizer, place: Placement):
  """One jit: a lax.scan over layers whose body copies that layer's weights from pinned host memory with
  device_put; gradients come back through the copy's transpose. The update runs on the device per step."""
  cfg = model.cfg

  def loss_fn(layers_host, outer, batch):
    def body(h, layer_host):
      layer = jax.device_put(layer_host, place.device())
      return model.block(cfg).apply({"params": layer}, h), None
    h = model.embed(outer, batch["inputs"]).astype(cfg.dtype)
    h, _ = lax.scan(jax.checkpoint(body), h, layers_host)
    return model.head_loss(outer, h, batch["targets"], batch["weights"]) / jnp.sum(batch["weights"])

  def step(state, batch):
    loss, (g_layers, g_outer) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state["layers"], state["outer"], batch)
    g_layers = jax.device_put(g_layers, place.device())
    master = jax.device_put(state["master"], place.device())
    opt = jax.device_put(state["opt"], place.device())
    grads = {"layers": g_layers, "outer": g_outer}
    updates, opt = optimizer.update(grads, opt, master)
    master = optax.apply_updates(master, updates)
    layers = jax.device_put(jax.tree.map(lambda x: x.astype(cfg.dtype), master["layers"]), place.host())
    return {"layers": layers, "outer": master["outer"], "master": jax.device_put(master, place.host()),
            "opt": jax.device_put(opt, place.host())}, loss
  return jax.jit(step, donate_argnums=0)


def fits_cases(model, optimizer, rows, seq, steps, key):
  batch = batch_of(rows, seq, model.cfg.vocab_size)
  wanted = set(FLAGS.fits_cases)
  if "device" in wanted:
    device_model = build(dataclasses.replace(model.cfg, remat=True))
    params = device_model.init(key)
    state = {"params": params, "opt": optimizer.init(params)}
    seconds, times, losses, state = timed(all_on_device_step(device_model, optimizer), state, batch, steps)
    keep(record("fits/device", model.cfg, rows, seq, seconds, times, losses, 1.0, {}))
    del state, params

  budget = default_budget()
  plan = planner.make_plan(model, seq, rows, budget)
  print(plan.describe(), flush=True)
  if "engine" in wanted:
    keep(run_engine("fits/engine", model, optimizer, plan.engine, batch, steps, key))
    RESULTS[-1]["plan"] = plan.describe()
  streamed = dataclasses.replace(plan.engine, activations_on_host=True, device_state_groups=0)
  if "streamed" in wanted:
    keep(run_engine("fits/streamed", model, optimizer, streamed, batch, steps, key))

  if "per_micro_batch" in wanted:
    per_micro_cfg = dataclasses.replace(streamed, sub_batches=1, activations_on_host=False)  # ZeRO keeps them on GPU
    engine = Engine(model, optimizer, per_micro_cfg)
    step = per_micro_batch_step(engine, plan.engine.sub_batches)
    seconds, times, losses, _ = timed(step, engine.init(key), batch, steps)
    keep(record("fits/per_micro_batch", model.cfg, rows, seq, seconds, times, losses, 0.0,
                {"micro_batches": plan.engine.sub_batches}))

  if "in_jit_scan" not in wanted:
    return
  place = Placement.single()
  try:
    master = model.init(key)
    state = {"layers": place.to_host(jax.tree.map(lambda x: x.astype(model.cfg.dtype), master["layers"])),
             "outer": master["outer"], "master": place.to_host(master), "opt": place.to_host(optimizer.init(master))}
    del master
    seconds, times, losses, _ = timed(in_jit_scan_step(model, optimizer, place), state, batch, steps)
    keep(record("fits/in_jit_scan", model.cfg, rows, seq, seconds, times, losses, 1.0, {}))
  except Exception as error:  # noqa: BLE001 — a baseline that does not run is reported, not hidden
    keep({"case": "fits/in_jit_scan", "error": f"{type(error).__name__}: {error}"[:2000]})
    print("fits/in_jit_scan failed:", RESULTS[-1]["error"][:300], flush=True)


# --smoke: the same families and code paths at CPU sizes (the plan keeps their state on the device; --cases=fits
# also runs the streamed engine and both baselines).
SMOKE = dict(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=256)
SMOKE_ROWS, SMOKE_SEQ = 4, 32


def model_of(preset: str, overrides: list[str]):
  """The preset with `overrides` (and SMOKE's under --smoke), per-layer remat off: the engine's backward already
  recomputes each group."""
  return build(get_config(preset, {**parse_overrides(overrides), **(SMOKE if FLAGS.smoke else {}), "remat": False}))


def main(argv):
  del argv
  key = jax.random.key(0)
  optimizer = optax.adamw(1e-4, weight_decay=0.1)
  seq = SMOKE_SEQ if FLAGS.smoke else FLAGS.seq_len
  if "big" in FLAGS.cases:
    model = model_of("llama13b", [])
    rows = SMOKE_ROWS if FLAGS.smoke else FLAGS.big_batch
    budget = dataclasses.replace(default_budget(), host_bytes=int(FLAGS.host_memory_gib * GIB))
    plan = planner.make_plan(model, seq, rows, budget)
    print(plan.describe(), flush=True)
    result = run_engine("big/llama13b", model, optimizer, plan.engine, batch_of(rows, seq, model.cfg.vocab_size),
                        FLAGS.steps, key)
    result.update(plan=plan.describe(), predicted_compute_s=plan.compute_seconds,
                  predicted_transfer_s=plan.transfer_seconds)
    keep(result)
  if "fits" in FLAGS.cases:
    model = model_of(FLAGS.fits_model, [] if FLAGS.smoke else FLAGS.fits_set)
    fits_cases(model, optimizer, SMOKE_ROWS if FLAGS.smoke else FLAGS.fits_batch, seq, FLAGS.steps, key)


RESULTS = []


def keep(result):
  """Records a case and rewrites the JSON, so a crash or time-out later keeps what ran."""
  RESULTS.append(result)
  results = RESULTS
  seq = SMOKE_SEQ if FLAGS.smoke else FLAGS.seq_len
  by_case = {r["case"]: r for r in results}
  ratios = {}
  if "fits/engine" in by_case and "fits/device" in by_case:
    ratios["engine_over_all_on_device"] = by_case["fits/engine"]["tokens_per_s"] / by_case["fits/device"]["tokens_per_s"]
  for baseline in ("fits/per_micro_batch", "fits/in_jit_scan"):
    if baseline in by_case and "tokens_per_s" in by_case[baseline] and "fits/streamed" in by_case:
      ratios[f"streamed_engine_over_{baseline.split('/')[1]}"] = (
          by_case["fits/streamed"]["tokens_per_s"] / by_case[baseline]["tokens_per_s"])
  write_results(FLAGS.out, {**provenance(), "peak_flops": peak_flops(), "seq_len": seq, "results": results,
                            "ratios": ratios})
  return result


if __name__ == "__main__":
  app.run(main)
