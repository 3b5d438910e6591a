"""The layer kernels' ceiling on a training step's MFU: the engine's own layer function, timed alone.

  python -m benchmarks.kernel_ceiling --out=benchmarks/results/kernel_ceiling_h200.json   # llama13b, 4 x 8 x 2048
  python -m benchmarks.kernel_ceiling --smoke   # tiny shapes, any machine: checks the code path

`ceilings` times three jitted calls on one sub-batch of hidden states through a group of `live_layers` layers (the
engine's `model.layers`, the weights in the dtypes the engine casts them to):
  forward             the group's forward, as the engine's forward pass runs it
  recompute_backward  jax.vjp, then its pullback applied (the engine's group backward): the forward runs again
  residuals_kept      forward and backward in one call: a backward whose forward residuals are kept, not re-run
A step of layer kernels alone is (layers / live_layers) x sub_batches of them: forward + recompute_backward each
under full recompute (the engine's schedule), residuals_kept each if every group kept its residuals. The ceilings are
the step's MFU (model FLOPs: flops_per_token, the head's included, as train_throughput counts them) over those times
alone, so the step's MFU stays below them. Left out of the times: the embedding, the head and loss, the optimizer
updates, copies, dispatch, idle gaps, and the engine's last group keeping its residuals (timed here at the price of
full recompute: one group in layers / live_layers). train_throughput measures them in the process of the step.

A training step is a sustained load: on the H200 it runs at the 700 W power cap, its SM clock near 1.46 GHz
(`benchmarks/results/llama7b_clocks_h200.json`), while a few calls each waited for are not. The `*_sustained` keys
time each kernel again back to back for `sustain_s` seconds after as many seconds of warm-up, at the cap: 1-7%
slower than alone on the H200 (train_throughput_h200_sustained_ceilings.json), the ceilings a step can reach.
"""

import statistics
import time

import jax
import optax
from absl import app, flags

from benchmarks.common import TRAINING_SMOKE, TRAINING_SMOKE_ROWS, TRAINING_SMOKE_SEQ, define_flags, provenance, \
    write_results
from models.presets import build, get_config, parse_overrides
from sljax.machines import configure_process, rates_of
from sljax.metrics import training_flops
from sljax.schedule import Engine, EngineConfig

FLAGS = flags.FLAGS
REPEATS = 5  # timed calls per kernel, after one that compiles it
SUSTAIN_S = 3.0  # seconds of each kernel back to back (after as many of warm-up) for the sustained times
SMOKE_SUSTAIN_S = 0.005  # --smoke: each kernel at least once back to back, the code path only


def median_seconds(fn, args, repeats: int) -> tuple[float, list[float]]:
  """(Median, each) of `repeats` calls of fn(*args), each waited for, after one call that compiles it."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def sustained_seconds(fn, args, seconds: float) -> float:
  """Seconds per call of fn(*args) dispatched back to back for about `seconds`, after about as long of the same
  (the GPU at the clock its power cap holds under that load), fn compiled and timed once first."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  calls = max(1, round(seconds / max(time.perf_counter() - start, 1e-6)))
  for _ in range(2):  # the warm-up, then the same again timed
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def ceilings(model, rows: int, seq: int, sub_batches: int, live_layers: int = 1, repeats: int = REPEATS,
             sustain_s: float = SUSTAIN_S) -> dict:
  """The three kernels' milliseconds on a sub-batch of rows x seq tokens, the step times they imply for `sub_batches`
  sub-batches through all of `model`'s layers, the MFU ceilings (and the HFU one) of those steps, and each kernel's
  hardware FLOPs over its time and this device's peak (`kernel_hfu`); the same from the kernels' sustained times
  (`*_sustained`, sustain_s > 0). ValueError on a shape that is not positive."""
  if min(rows, seq, sub_batches, live_layers, repeats) < 1:
    raise ValueError(f"rows, seq, sub_batches, live_layers and repeats must be >= 1, got {rows}, {seq}, "
                     f"{sub_batches}, {live_layers}, {repeats}")
  engine = Engine(model, optax.identity(), EngineConfig(live_layers=live_layers))  # its layer function and casts
  layers, cfg = engine.model.layers, engine.model.cfg
  if live_layers > cfg.num_layers:
    raise ValueError(f"live_layers {live_layers} is more than the model's {cfg.num_layers} layers")
  weights_key, x_key, dy_key = jax.random.split(jax.random.key(0), 3)
  weights = jax.jit(lambda keys: engine.cast_layers(engine.model.init_layers(keys)))(
      jax.random.split(weights_key, live_layers))
  x_BxSxD = jax.random.normal(x_key, (rows, seq, cfg.hidden_size), cfg.dtype)
  dy_BxSxD = jax.random.normal(dy_key, (rows, seq, cfg.hidden_size), cfg.dtype)

  def recompute_backward(weights, x, dy):  # sljax.schedule's _backward_fn, less its gradient accumulation
    _, pullback = jax.vjp(layers, weights, x)
    return pullback(dy)

  def residuals_kept(weights, x, dy):
    y, pullback = jax.vjp(layers, weights, x)
    return y, pullback(dy)

  kernels = {"forward": (layers, (weights, x_BxSxD)),
             "recompute_backward": (recompute_backward, (weights, x_BxSxD, dy_BxSxD)),
             "residuals_kept": (residuals_kept, (weights, x_BxSxD, dy_BxSxD))}
  jitted = {name: (jax.jit(fn), args) for name, (fn, args) in kernels.items()}
  timed = {name: median_seconds(fn, args, repeats) for name, (fn, args) in jitted.items()}
  seconds = {name: median for name, (median, _) in timed.items()}
  sustained_s = ({name: sustained_seconds(fn, args, sustain_s) for name, (fn, args) in jitted.items()}
                 if sustain_s > 0 else {})

  peak = rates_of(jax.devices()[0].device_kind).peak_flops
  # A kernel's hardware FLOPs: the group's layers' forward, three times that with the backward (XLA may drop a matmul
  # whose output only the unused forward result needs).
  forward_flops = rows * seq * cfg.layer_forward_flops(seq) * live_layers
  hardware = {"forward": forward_flops, "recompute_backward": 3 * forward_flops, "residuals_kept": 3 * forward_flops}
  calls = cfg.num_layers / live_layers * sub_batches  # of each kernel per step
  step_of = lambda seconds: {"full_recompute": calls * (seconds["forward"] + seconds["recompute_backward"]),
                             "residuals_kept": calls * seconds["residuals_kept"]}
  step_s = step_of(seconds)
  step_tokens = rows * seq * sub_batches
  sustained = {}
  if sustained_s:
    sustained_step_s = step_of(sustained_s)
    sustained = {"sustain_s": sustain_s, **{f"{name}_ms_sustained": 1e3 * s for name, s in sustained_s.items()},
                 **{f"step_s_{kind}_sustained": s for kind, s in sustained_step_s.items()},
                 **{f"ceiling_mfu_{kind}_sustained": step_tokens * cfg.flops_per_token(seq) / (s * peak)
                    for kind, s in sustained_step_s.items()}}
  return {
      "rows": rows, "seq_len": seq, "sub_batches": sub_batches, "live_layers": live_layers, "repeats": repeats,
      "peak_flops": peak, **{f"{name}_ms": 1e3 * s for name, s in seconds.items()},
      "ms_all": {name: [1e3 * t for t in times] for name, (_, times) in timed.items()},
      **{f"step_s_{kind}": s for kind, s in step_s.items()},
      **{f"ceiling_mfu_{kind}": step_tokens * cfg.flops_per_token(seq) / (s * peak) for kind, s in step_s.items()},
      "ceiling_hfu_full_recompute": (step_tokens * training_flops(cfg, seq, cfg.num_layers).hardware
                                     / (step_s["full_recompute"] * peak)),
      "kernel_hfu": {name: hardware[name] / (seconds[name] * peak) for name in kernels},
      **sustained,
  }


def main(argv):
  del argv
  configure_process()
  rows, seq = (TRAINING_SMOKE_ROWS, TRAINING_SMOKE_SEQ) if FLAGS.smoke else (FLAGS.rows, FLAGS.seq_len)
  try:
    cfg = get_config(FLAGS.model, {**parse_overrides(FLAGS.set), **(TRAINING_SMOKE if FLAGS.smoke else {})})
    result = ceilings(build(cfg), rows, seq, FLAGS.sub_batches, FLAGS.live_layers, FLAGS.repeats,
                      min(FLAGS.sustain_s, SMOKE_SUSTAIN_S) if FLAGS.smoke else FLAGS.sustain_s)
  except ValueError as error:
    raise app.UsageError(str(error)) from None
  print(f"{FLAGS.model}, {rows} x {seq} tokens, {FLAGS.live_layers} layer(s): forward {result['forward_ms']:.2f} ms, "
        f"recompute + backward {result['recompute_backward_ms']:.2f} ms, residuals kept "
        f"{result['residuals_kept_ms']:.2f} ms; step of {FLAGS.sub_batches} sub-batches: full recompute "
        f"{result['step_s_full_recompute']:.2f} s (MFU ceiling {result['ceiling_mfu_full_recompute']:.3f}), "
        f"residuals kept {result['step_s_residuals_kept']:.2f} s ({result['ceiling_mfu_residuals_kept']:.3f})")
  write_results(FLAGS.out, {**provenance(), "model": FLAGS.model, "overrides": FLAGS.set, **result})


if __name__ == "__main__":
  # Flags only for the program: train_throughput imports ceilings(), and --out, --smoke are its flags too.
  define_flags("Tiny shapes: checks the code path on any machine in seconds.")
  flags.DEFINE_string("model", "llama13b", "Model preset.")
  flags.DEFINE_multi_string("set", [], "Model config override field=value.")
  flags.DEFINE_integer("rows", 8, "Sequences per sub-batch.")
  flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
  flags.DEFINE_integer("sub_batches", 4, "Sub-batches per step (the step times and ceilings).")
  flags.DEFINE_integer("live_layers", 1, "Layers per group: what one call runs.")
  flags.DEFINE_integer("repeats", REPEATS, "Timed calls per kernel, after one that compiles it.")
  flags.DEFINE_float("sustain_s", SUSTAIN_S, "Seconds of each kernel back to back for the sustained times (after as "
                     "many of warm-up); 0: none.")
  app.run(main)
