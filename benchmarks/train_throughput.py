"""Training throughput on one GPU: the SpeedLoader engine on llama13b and llama7b, and against the plain step and two
streaming baselines on a model that fits; beside each engine case, the MFU ceilings of its layer kernels.

  python -m benchmarks.train_throughput --cases=big --out=benchmarks/results/train_throughput_h200.json
  python -m benchmarks.train_throughput --cases=fits --merge --out=benchmarks/results/train_throughput_h200.json
  python -m benchmarks.train_throughput --smoke   # tiny shapes, any machine: checks the code paths

Cases (--cases; each recorded with tokens/s, MFU, hardware FLOPs utilization, peak device / host memory, bytes moved):
  big        llama13b, seq 2048, batch --big_batch, the plan's placement for --host_memory_gib, AdamW without
             clipping (its training state fits neither the GPU nor host RAM alone)
  big_like_deepspeed  llama13b at --big_batch (in --smoke too) with the optimizer of benchmarks.vs_deepspeed's
             DeepSpeed baseline: AdamW (LIKE_DEEPSPEED: constant learning rate, b2 0.95) with fp32 master weights and
             moments, clipped by the global norm at 1.0; --big_sub_batches, else the plan's, for --host_memory_gib
  big_clip   llama13b as the README's `python train.py --model=llama13b` runs it (sljax.launch): the recipe's AdamW
             clipped at 1.0, and the batch, placement and first-moment dtype the plan then chooses
  big_int8   llama13b as `python train.py --model=llama13b --moments_dtype=int8` runs it (issue 36's command), with
             --big_int8_trade_state_for_tail and --big_int8_device_memory_gib passing train.py's flags of those names
  llama7b    llama7b, all 32 layers, as `python train.py --model=llama7b --engine=offload` runs it (the bare command
             runs the on-device step on an H200, which its training state fits); --llama7b_sub_batches and
             --llama7b_tail_layers pass train.py's --sub_batches and --tail_layers
  fits       a model that fits on the device (--fits_model, --fits_set), same batch (--fits_cases):
             device_remat     the plain all-on-device jitted step (scan over layers, per-layer remat)
             device_no_remat  the same without remat (faster, where its activations fit; a failure is recorded)
             engine           the engine, placed by the plan (all on the device when it fits)
             streamed         the engine with everything on the host (weights, state, activations)
             per_micro_batch  weights streamed per micro-batch with gradient accumulation (what ZeRO-3 offload does)
             in_jit_scan      weights streamed by a lax.scan inside one jit with device_put in its body (JAX's way)
Each engine case also records its layer kernels' MFU ceilings (benchmarks.kernel_ceiling, in the same process, at
the case's sub-batch shape) as ceiling_mfu_full_recompute and ceiling_mfu_residuals_kept beside its mfu, and
ceiling_mfu_schedule: the plan's mix of the two (the last group's layers keep their residuals, the others recompute),
each also `*_sustained`: from the kernels timed back to back at the power cap, as a step runs them;
a case in
--trace_cases (default big) runs one more step under jax.profiler and records gpu_busy_fraction, the idle gaps and the
copies hidden behind compute (benchmarks.trace_overlap). Ratios: fits/engine_over_best_device (the engine over the
faster all-on-device step), engine_over_all_on_device (over the remat one), the streamed engine over each streaming
baseline.

XLA's pinned host pool never shrinks, so a case run after another starts with the first one's pool on top of its own:
on the GPU run each case in its own process, --merge collecting them in one file.
"""

import contextlib
import dataclasses
import io
import json
import os
import resource
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jax import lax

from benchmarks import trace_overlap
from benchmarks.common import (TRAINING_SMOKE, TRAINING_SMOKE_ROWS, TRAINING_SMOKE_SEQ, batch_of, define_flags,
                               provenance, timed, write_results)
from benchmarks.kernel_ceiling import SMOKE_SUSTAIN_S, SUSTAIN_S, ceilings
from models.presets import build, get_config, parse_overrides
from sljax import launch
from sljax import plan as planner
from sljax.machines import GIB, configure_process, default_budget, rates_of
from sljax.metrics import training_flops
from sljax.memory import Placement, prefetch
from sljax.mesh import make_mesh
from sljax.request import LaunchConfig, Request
from sljax.schedule import Engine
from sljax.steps import offload_engine
from sljax.trainer import RunConfig

CASES = ("big", "big_like_deepspeed", "big_clip", "big_int8", "llama7b", "fits")
FITS_CASES = ("device_remat", "device_no_remat", "engine", "streamed", "per_micro_batch", "in_jit_scan")
# The cases a trace can be taken of.
ENGINE_CASES = ("big", "big_like_deepspeed", "big_clip", "big_int8", "llama7b", "fits/engine", "fits/streamed")

define_flags("Tiny shapes: checks every code path on any machine in a minute or two.",
             out="Write the results JSON here (rewritten after every case).")
flags.DEFINE_list("cases", ",".join(CASES), f"Which cases to run, of {', '.join(CASES)}.")
flags.DEFINE_bool("merge", False, "Keep the results already in --out of the cases this run does not run (each case "
                  "run in its own process, all in one file); the ratios are then over all of them.")
flags.DEFINE_integer("big_batch", 32, "llama13b effective batch of the big case (sequences of --seq_len).")
flags.DEFINE_integer("big_sub_batches", 0, "big_like_deepspeed: sub-batches per step (0: the plan's).")
flags.DEFINE_bool("kernel_ceilings", True, "After each engine case, its layer kernels' MFU ceilings at its shape "
                  "(half a minute of device time per case on the H200).")
flags.DEFINE_integer("fits_batch", 16, "Effective batch of the model that fits.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
flags.DEFINE_integer("steps", 3, "Timed steps per case (after one warm-up step).")
flags.DEFINE_string("fits_model", "llama7b", "Preset of the model that fits.")
flags.DEFINE_multi_string("fits_set", ["num_layers=8"], "Overrides of the model that fits.")
flags.DEFINE_list("fits_cases", ",".join(FITS_CASES), "Which cases of the model that fits to run.")
flags.DEFINE_list("trace_cases", "big", f"Engine cases ({', '.join(ENGINE_CASES)}) that run one more step, traced: "
                  "gpu_busy_fraction and the idle gaps of that step.")
flags.DEFINE_string("trace_dir", "", "Keep the traces (jax.profiler, perfetto) here (default: a temporary directory, "
                    "removed once read).")
flags.DEFINE_float("host_memory_gib", 85, "Pinned host memory the plans of big and big_like_deepspeed may use "
                   "(below XLA's pinned pool limit; the others plan for the default host budget, as train.py does).")
flags.DEFINE_bool("big_int8_trade_state_for_tail", False, "big_int8: train.py's --trade_state_for_tail.")
flags.DEFINE_float("big_int8_device_memory_gib", 0, "big_int8: train.py's --device_memory_gib (0: the allocator's "
                   "limit).")
flags.DEFINE_integer("llama7b_sub_batches", 0, "llama7b: sub-batches per step, as train.py's --sub_batches (0: the "
                     "plan's).")
flags.DEFINE_integer("llama7b_tail_layers", 0, "llama7b: layers in the last group, as train.py's --tail_layers (0: "
                     "the plan's).")
FLAGS = flags.FLAGS


def seq_len() -> int:
  return TRAINING_SMOKE_SEQ if FLAGS.smoke else FLAGS.seq_len


def device_peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def peak_flops() -> float:
  """This GPU's peak from sljax.machines (on CPU, the reference machine's: smoke runs' MFU means nothing)."""
  return rates_of(jax.devices()[0].device_kind).peak_flops


def record(name, cfg, rows, seq, seconds, times, losses, recomputed_layers, extra):
  tokens_per_s, flops = rows * seq / seconds, training_flops(cfg, seq, recomputed_layers)
  result = {
      "case": name, "tokens_per_s": tokens_per_s, "step_seconds": seconds, "step_seconds_all": times,
      "losses": losses, "mfu": tokens_per_s * flops.model / peak_flops(),
      "hfu": tokens_per_s * flops.hardware / peak_flops(),
      "peak_device_bytes": device_peak_bytes(), "peak_host_rss_bytes": resource.getrusage(
          resource.RUSAGE_SELF).ru_maxrss * 1024, **extra}
  print(f"{name:28s} {tokens_per_s:10.0f} tok/s  MFU {result['mfu']:.3f}  HFU {result['hfu']:.3f}  "
        f"step {seconds:.3f} s", flush=True)
  return result


def run_engine(name, engine: Engine, batch, steps, key):
  """Init, one warm-up step, `steps` timed steps and (name in --trace_cases) one traced; then, the state freed, the
  layer kernels' ceilings at the step's sub-batch shape."""
  start = time.perf_counter()
  state = jax.block_until_ready(engine.init(key))
  print(f"{name}: initialized in {time.perf_counter() - start:.0f} s", flush=True)
  before = dict(engine.place.moved)
  seconds, times, losses, state = timed(engine.step, state, batch, steps)
  moved = {k: (engine.place.moved[k] - before[k]) // (steps + 1) for k in before}  # every step moves the same
  layers = engine.model.cfg.num_layers
  recomputed = engine.groups[-1][0]  # every group's layers but the last group's
  rows, seq = batch["inputs"].shape
  result = record(name, engine.model.cfg, rows, seq, seconds, times, losses, recomputed,
                  {"engine": dataclasses.asdict(engine.cfg), "bytes_moved_per_step": moved})
  if name in FLAGS.trace_cases:
    state, traced = traced_step(engine, state, batch, seconds)
    result.update(traced)
  if not FLAGS.kernel_ceilings:
    return result
  del state  # the ceilings' kernels get the device the step had
  sub_batches = engine.cfg.sub_batches
  ceiling = ceilings(engine.model, rows // sub_batches, seq, sub_batches, engine.cfg.live_layers,
                     sustain_s=SMOKE_SUSTAIN_S if FLAGS.smoke else SUSTAIN_S)
  print(f"{name}: layer kernels alone: MFU ceiling {ceiling['ceiling_mfu_full_recompute']:.3f} with full recompute, "
        f"{ceiling['ceiling_mfu_residuals_kept']:.3f} with residuals kept; sustained (at the power cap) "
        f"{ceiling['ceiling_mfu_full_recompute_sustained']:.3f}, {ceiling['ceiling_mfu_residuals_kept_sustained']:.3f}",
        flush=True)

  def schedule_ceiling(suffix=""):
    """This schedule's own: the layers before the last group recompute, the last group's keep their residuals."""
    per_layer_s = {kind: ceiling[f"step_s_{kind}{suffix}"] / layers for kind in ("full_recompute", "residuals_kept")}
    schedule_s = (recomputed * per_layer_s["full_recompute"]
                  + (layers - recomputed) * per_layer_s["residuals_kept"])
    return ceiling[f"ceiling_mfu_full_recompute{suffix}"] * ceiling[f"step_s_full_recompute{suffix}"] / schedule_s

  return {**result, **{f"ceiling_mfu_{kind}{suffix}": ceiling[f"ceiling_mfu_{kind}{suffix}"]
                       for kind in ("full_recompute", "residuals_kept") for suffix in ("", "_sustained")},
          "ceiling_mfu_schedule": schedule_ceiling(), "ceiling_mfu_schedule_sustained": schedule_ceiling("_sustained"),
          "kernel_ceiling": ceiling}


def traced_step(engine: Engine, state, batch, untraced_seconds: float):
  """One more step under jax.profiler: (the state after it, what the GPU did in it: benchmarks.trace_overlap's
  summary, and its compute fraction as gpu_busy_fraction; None without a GPU, whose trace has no device lanes).

  The profiler costs time of its own (trace_overlap.PROFILER_FLUSH: the step idles while it flushes its buffers), so
  untraced_busy_fraction divides the same kernels' time by the untraced step's `untraced_seconds` instead."""
  with contextlib.ExitStack() as stack:
    trace_dir = FLAGS.trace_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="sljax_trace_"))
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      state, loss = engine.step(state, batch)
      jax.block_until_ready(loss)
      seconds = time.perf_counter() - start  # the step, not the trace's export
    path = trace_overlap.newest_trace(trace_dir)
    trace = trace_overlap.load(path)
  summary = trace_overlap.summarize(trace)[0] if jax.devices()[0].platform == "gpu" else None
  untraced = trace_overlap.kernel_share(summary, untraced_seconds) if summary else None
  if summary:
    print(f"traced step: GPU busy {summary['compute_fraction_of_span']:.1%} of {summary['span_s']:.2f} s, idle "
          f"{summary['idle_s']:.2f} s in {summary['idle_gaps_over_100us']} gaps over 100 us, "
          f"{summary['idle_while_profiler_flushed_s']:.2f} s of it while the profiler flushed; its kernels are "
          f"{untraced:.1%} of an untraced step ({untraced_seconds:.2f} s)", flush=True)
    print("  kernel seconds by program: " + ", ".join(
        f"{module} {seconds:.2f}" for module, seconds in summary["compute_s_by_module"].items()), flush=True)
    for gap in summary["largest_idle_gaps"][:1]:
      print(f"  longest gap {gap['ms']:.1f} ms: copies in {gap['copies_ms']['host_to_device']:.1f} ms, out "
            f"{gap['copies_ms']['device_to_host']:.1f} ms; the dispatching thread in "
            f"{' > '.join(gap['dispatch_thread_in']) or 'nothing'}", flush=True)
  return state, {"gpu_busy_fraction": summary["compute_fraction_of_span"] if summary else None,
                 "untraced_busy_fraction": untraced, "traced_step_seconds": seconds,
                 "trace": {"file": path if FLAGS.trace_dir else None, "events": len(trace["traceEvents"]),
                           **(summary or {})}}


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


def device_case(name, model, optimizer, batch, steps, key):
  params = jax.jit(model.init)(key)  # jitted: eagerly, flax's init runs op by op
  state = {"params": params, "opt": optimizer.init(params)}
  del params
  seconds, times, losses, _ = timed(all_on_device_step(model, optimizer), state, batch, steps)
  rows, seq = batch["inputs"].shape
  return record(name, model.cfg, rows, seq, seconds, times, losses,
                model.cfg.num_layers if model.cfg.remat else 0, {"remat": model.cfg.remat})


def in_jit_scan_case(model, optimizer, batch, steps, key):
  place = Placement.single()
  master = jax.jit(model.init)(key)
  state = {"layers": place.to_host(jax.tree.map(lambda x: x.astype(model.cfg.dtype), master["layers"])),
           "outer": master["outer"], "master": place.to_host(master), "opt": place.to_host(optimizer.init(master))}
  del master
  seconds, times, losses, _ = timed(in_jit_scan_step(model, optimizer, place), state, batch, steps)
  rows, seq = batch["inputs"].shape
  return record("fits/in_jit_scan", model.cfg, rows, seq, seconds, times, losses, model.cfg.num_layers, {})


def attempt(name, run) -> dict:
  """run()'s result, or the error of a baseline that does not run (out of memory, say): reported, not hidden."""
  try:
    return run()
  except Exception as error:  # noqa: BLE001
    print(f"{name} failed:", f"{type(error).__name__}: {error}"[:300], flush=True)
    return {"case": name, "error": f"{type(error).__name__}: {error}"[:2000]}


def fits_cases(model, rows, seq, steps, key):
  optimizer = optax.adamw(1e-4, weight_decay=0.1)
  batch = batch_of(rows, seq, model.cfg.vocab_size)
  wanted = set(FLAGS.fits_cases)
  for name, remat in (("fits/device_remat", True), ("fits/device_no_remat", False)):
    if name.split("/")[1] in wanted:
      device_model = build(dataclasses.replace(model.cfg, remat=remat))
      keep(attempt(name, lambda: device_case(name, device_model, optimizer, batch, steps, key)))

  budget = default_budget()
  plan = planner.make_plan(model, seq, rows, budget)
  print(plan.describe(), flush=True)
  if "engine" in wanted:
    keep({**run_engine("fits/engine", Engine(model, optimizer, plan.engine), batch, steps, key),
          "plan": plan.describe()})
  streamed = dataclasses.replace(plan.engine, activations_on_host=True, device_state_groups=0)
  if "streamed" in wanted:
    keep(run_engine("fits/streamed", Engine(model, optimizer, streamed), batch, steps, key))

  if "per_micro_batch" in wanted:
    per_micro_cfg = dataclasses.replace(streamed, sub_batches=1, activations_on_host=False)  # ZeRO keeps them on GPU
    engine = Engine(model, optimizer, per_micro_cfg)
    step = per_micro_batch_step(engine, plan.engine.sub_batches)
    seconds, times, losses, _ = timed(step, engine.init(key), batch, steps)
    keep(record("fits/per_micro_batch", model.cfg, rows, seq, seconds, times, losses, 0,
                {"micro_batches": plan.engine.sub_batches}))

  if "in_jit_scan" in wanted:
    keep(attempt("fits/in_jit_scan", lambda: in_jit_scan_case(model, optimizer, batch, steps, key)))


def model_of(preset: str, overrides: list[str]):
  """The preset with `overrides` (and TRAINING_SMOKE's under --smoke), per-layer remat off: the engine's backward
  already recomputes each group."""
  smoke = TRAINING_SMOKE if FLAGS.smoke else {}
  return build(get_config(preset, {**parse_overrides(overrides), **smoke, "remat": False}))


# The optimizer of benchmarks/baselines/deepspeed_zero3.py (its ADAMW, CLIP_NORM and default --lr), for the case
# that runs beside it; benchmarks.vs_deepspeed checks that the two records of it agree.
LIKE_DEEPSPEED = dict(learning_rate=1e-5, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
LIKE_DEEPSPEED_CLIP_NORM = 1.0


def optimizer_settings(optimizer, settings: dict, grad_clip_norm: float, cfg) -> dict:
  """What big_like_deepspeed's optimizer computes, in the keys the DeepSpeed baseline records; the moments' dtype read
  off optimizer.init's shapes for a parameter in cfg.param_dtype."""
  state = jax.eval_shape(optimizer.init, jax.ShapeDtypeStruct((8,), cfg.param_dtype))
  moments = sorted({str(leaf.dtype) for leaf in jax.tree.leaves(state) if leaf.shape == (8,)})
  return {"lr": settings["learning_rate"], "betas": [settings["b1"], settings["b2"]], "eps": settings["eps"],
          "weight_decay": settings["weight_decay"], "decoupled_weight_decay": True, "grad_clip_norm": grad_clip_norm,
          "master_dtype": str(jnp.dtype(cfg.param_dtype)), "moments_dtype": ",".join(moments),
          "grad_accum_dtype": "float32",  # the engine's gradient accumulators, whatever the compute dtype
          "compute_dtype": str(jnp.dtype(cfg.dtype))}


def big_case(name, seq, key):
  """llama13b under the plan for --host_memory_gib: big at --big_batch (one row in --smoke) with AdamW at 1e-4
  without clipping, big_like_deepspeed at --big_batch with the DeepSpeed baseline's optimizer."""
  model = model_of("llama13b", [])
  if name == "big":
    rows = TRAINING_SMOKE_ROWS if FLAGS.smoke else FLAGS.big_batch
    optimizer, clip, sub_batches, extra = optax.adamw(1e-4, weight_decay=0.1), 0.0, 0, {}
  else:
    rows, clip, sub_batches = FLAGS.big_batch, LIKE_DEEPSPEED_CLIP_NORM, FLAGS.big_sub_batches
    optimizer = optax.adamw(**LIKE_DEEPSPEED)
    extra = {"optimizer_settings": optimizer_settings(optimizer, LIKE_DEEPSPEED, clip, model.cfg)}
  budget = dataclasses.replace(default_budget(), host_bytes=int(FLAGS.host_memory_gib * GIB))
  plan = planner.make_plan(model, seq, rows, budget, sub_batches=sub_batches, optimizer=optimizer,
                           grad_clip_norm=clip)
  print(plan.describe(), flush=True)
  engine = Engine(model, optimizer, plan.engine)
  result = run_engine(name, engine, batch_of(rows, seq, model.cfg.vocab_size), FLAGS.steps, key)
  keep({**result, **extra, "plan": plan.describe(), "predicted_compute_s": plan.compute_seconds,
        "predicted_transfer_s": plan.transfer_seconds})


def as_train_py_case(name, preset, seq, key, sub_batches=0, tail_layers=0, optim=None, **launch_flags):
  """The engine as `python train.py --model=<preset> --engine=offload --seq_len=<seq>` builds it: sljax.launch's
  recipe, plan (batch, placement, first-moment dtype, for the default host budget) and optimizer, on one device.
  optim: OptimConfig fields the command sets (as --moments_dtype); launch_flags: LaunchConfig's."""
  overrides = tuple(f"{field}={value}" for field, value in TRAINING_SMOKE.items()) if FLAGS.smoke else ()
  # Smoke: one row, where the plan would fill a sub-batch of 16384 tokens (512 rows of 32).
  data = {"seq_len": seq, **({"batch_size": TRAINING_SMOKE_ROWS} if FLAGS.smoke else {})}
  request = Request(LaunchConfig(model=preset, overrides=overrides, engine="offload", sub_batches=sub_batches,
                                 tail_layers=tail_layers, **launch_flags), RunConfig(steps=FLAGS.steps + 1), data=data,
                    optim=optim or {})
  printed = io.StringIO()  # what train.py prints of its choices: recorded with the result
  try:
    with contextlib.redirect_stdout(printed):
      configs = launch.resolve(request)
      one_device = make_mesh({"data": 1, "fsdp": 1}, jax.devices()[:1])
      model_cfg, data_cfg, optim_cfg, engine_cfg, pinned_bytes = launch.choose_engine(request, configs, one_device)
  finally:
    print(printed.getvalue(), end="", flush=True)
  launch.grow_pinned_pools(one_device, pinned_bytes)  # as train.py does before its first step
  engine = offload_engine(build(model_cfg), optim_cfg, engine_cfg)
  result = run_engine(name, engine, batch_of(data_cfg.batch_size, seq, model_cfg.vocab_size), FLAGS.steps, key)
  keep({**result, "optimizer": optim_cfg.describe(), "launch_output": printed.getvalue().splitlines()})


def check_flags():
  """app.UsageError naming the first flag with a value this benchmark does not know."""
  for name, known in (("cases", CASES), ("fits_cases", FITS_CASES), ("trace_cases", ENGINE_CASES)):
    unknown = sorted(set(FLAGS[name].value) - set(known))
    if unknown:
      raise app.UsageError(f"--{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
  if FLAGS.steps < 1:
    raise app.UsageError(f"--steps must be >= 1, got {FLAGS.steps}")
  if FLAGS.merge and not FLAGS.out:
    raise app.UsageError("--merge keeps the results of --out: give --out")


def main(argv):
  del argv
  check_flags()
  # train.py's XLA settings for the default host budget, which big_clip and llama7b plan for as train.py does; big's
  # smaller --host_memory_gib fits in that pool.
  configure_process()
  key = jax.random.key(0)
  seq = seq_len()
  RESULTS.extend(earlier_results(seq))
  for name in ("big", "big_like_deepspeed"):
    if name in FLAGS.cases:
      big_case(name, seq, key)
  if "big_clip" in FLAGS.cases:
    as_train_py_case("big_clip", "llama13b", seq, key)
  if "big_int8" in FLAGS.cases:
    as_train_py_case("big_int8", "llama13b", seq, key, optim={"moments_dtype": "int8"},
                     trade_state_for_tail=FLAGS.big_int8_trade_state_for_tail,
                     device_memory_gib=FLAGS.big_int8_device_memory_gib)
  if "llama7b" in FLAGS.cases:
    as_train_py_case("llama7b", "llama7b", seq, key, FLAGS.llama7b_sub_batches, FLAGS.llama7b_tail_layers)
  if "fits" in FLAGS.cases:
    model = model_of(FLAGS.fits_model, [] if FLAGS.smoke else FLAGS.fits_set)
    fits_cases(model, TRAINING_SMOKE_ROWS if FLAGS.smoke else FLAGS.fits_batch, seq, FLAGS.steps, key)


RESULTS = []


def earlier_results(seq: int) -> list[dict]:
  """--merge: the results in --out (when it exists) of the cases this run does not run. app.UsageError when they
  were measured on another device or sequence length."""
  if not (FLAGS.merge and os.path.exists(FLAGS.out)):
    return []
  with open(FLAGS.out) as f:
    earlier = json.load(f)
  here = (jax.devices()[0].device_kind, seq)
  if (earlier["device"], earlier["seq_len"]) != here:
    raise app.UsageError(f"--merge: {FLAGS.out} holds results on {earlier['device']} at seq_len {earlier['seq_len']}, "
                         f"this run is on {here[0]} at seq_len {seq}")
  if not all("command" in r for r in earlier["results"]):  # written by an earlier version: its cases are stale
    raise app.UsageError(f"--merge: {FLAGS.out} holds results that do not say which run made them (an earlier "
                         f"version wrote it): run its first case without --merge")
  return [r for r in earlier["results"] if r["case"].split("/")[0] not in FLAGS.cases]


def ratios(results: list[dict]) -> dict:
  tokens = {r["case"]: r["tokens_per_s"] for r in results if "tokens_per_s" in r}
  out = {}
  devices = [case for case in ("fits/device_remat", "fits/device_no_remat") if case in tokens]
  if "fits/engine" in tokens and devices:
    best = max(devices, key=tokens.get)
    out.update({"fits/engine_over_best_device": tokens["fits/engine"] / tokens[best], "fits/best_device": best})
  if "fits/engine" in tokens and "fits/device_remat" in tokens:  # as earlier files, whose device step had remat
    out["engine_over_all_on_device"] = tokens["fits/engine"] / tokens["fits/device_remat"]
  for baseline in ("fits/per_micro_batch", "fits/in_jit_scan"):
    if baseline in tokens and "fits/streamed" in tokens:
      out[f"streamed_engine_over_{baseline.split('/')[1]}"] = tokens["fits/streamed"] / tokens[baseline]
  return out


def keep(result):
  """Records a case (with this run's command and date: --merge keeps results of several runs) and rewrites the JSON,
  so a crash or time-out later keeps what ran."""
  facts = provenance()
  RESULTS.append({**result, "command": facts["command"], "date": facts["date"]})
  write_results(FLAGS.out, {**facts, "peak_flops": peak_flops(), "seq_len": seq_len(), "results": RESULTS,
                            "ratios": ratios(RESULTS)})


if __name__ == "__main__":
  app.run(main)
