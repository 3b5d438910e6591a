"""What 8-bit Adam moments (--moments_dtype=int8, sljax.optim.scale_by_adam_8bit) cost in quality, on CPU; and, with
--variants, the other inexact memory savers of the offload engine.

  python -m benchmarks.int8_moments_quality --out=benchmarks/results/int8_moments_quality_cpu.json  # llama-tiny
  python -m benchmarks.int8_moments_quality --variants=bf16_parked_grads \
      --out=benchmarks/results/bf16_parked_grads_quality_cpu.json
  python -m benchmarks.int8_moments_quality --variants=int8_exchange \
      --out=benchmarks/results/int8_exchange_quality_cpu.json
  python -m benchmarks.int8_moments_quality --smoke --out=/tmp/int8_moments_smoke.json              # seconds

Trains `--model` for `--steps` steps on the embedded corpus, with its recipe's AdamW (sljax.optim.RECIPES:
schedule, clipping, betas) and fp32 moments, then once per variant: the same initialization, batches and plain
jitted step, which computes what the engine computes with that saver (tests/test_optim.py, tests/test_engine.py):
  int8               8-bit moments (--moments_dtype=int8)
  bf16_parked_grads  the layers' gradients rounded to bf16 after the global norm is taken from them in fp32, as
                     clipping parks them with --parked_grads_dtype=bfloat16. The weight gradient of a bf16 matmul
                     is a bf16 value already: only a sum of several is not, so compare at --sub_batches > 1, where
                     every run (fp32 too) sums its sub-batches' gradients in fp32 as the engine does
  int8_exchange      the group inputs that the backward pass recomputes from, stashed as int8 rows with one scale
                     each (--int8_exchange) at groups of --live_layers layers and no tail: the engine's grouping
                     when asked for none. The forward and the loss are exact; only the gradients see the rounding
Reports, for each and its difference from fp32 (`<variant>_minus_float32`): the final train loss (the mean over the
last `--final_steps` steps, and the last step's) and the held-out loss (the mean over `--eval_batches` batches of the
corpus's held-out documents, which no training window reads).
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from benchmarks.common import define_flags, provenance, write_results
from models.common import loss_denominator
from models.presets import build, get_config
from sljax.data import DataConfig, make_source
from sljax.machines import configure_process
from sljax.optim import RECIPES, make_optimizer, run_decay_steps
from sljax.schedule import EngineConfig, dequantize_rows, quantize_rows


def define_script_flags():
  """The script's flags, defined when it runs (not on import: the tests import it for its losses beside other
  benchmarks that define the same names)."""
  flags.DEFINE_string("model", "llama-tiny", "Model preset (its recipe trains it).")
  flags.DEFINE_integer("steps", 2000, "Training steps of each run.")
  flags.DEFINE_integer("final_steps", 100, "The final train loss is the mean over this many last steps.")
  flags.DEFINE_integer("eval_batches", 16, "Held-out batches, of the training batch's shape.")
  flags.DEFINE_list("variants", ["int8"], "What to train beside fp32: int8, bf16_parked_grads, int8_exchange (see "
                    "above).")
  flags.DEFINE_integer("sub_batches", 1, "Every run's gradient is the fp32 sum of this many sub-batches' (the "
                       "engine's accumulation), not the full batch's.")
  flags.DEFINE_integer("live_layers", 1, "int8_exchange: layers per group; every group's input but the last's is "
                       "stashed.")
  flags.DEFINE_integer("seed", 0, "Seeds the initialization and the batches' order, the same for both runs.")
  define_flags("A 2-layer model of width 64, batches of 4 x 32, 6 steps and 2 held-out batches (--steps, "
               "--eval_batches given: theirs): checks the code path in seconds.")


FLAGS = flags.FLAGS

SMOKE = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2)
VARIANTS = ("int8", "bf16_parked_grads", "int8_exchange")


def parked_in_bf16(grads, max_norm: float):
  """The layers' gradients as --parked_grads_dtype=bfloat16 leaves them for the update: clipped by the global norm of
  the fp32 gradients, after a round trip through bf16 (the embeddings' and head's are never parked)."""
  norm = optax.global_norm(grads)
  grads = {**grads, "layers": jax.tree.map(lambda g: g.astype(jnp.bfloat16).astype(jnp.float32), grads["layers"])}
  return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm * max_norm), grads)


def int8_exchange_loss(model, live_layers: int):
  """`model.loss` as the offload engine with --int8_exchange computes it and its gradient, at groups of live_layers
  layers and no tail. Each group but the last runs forward on its exact input, while that input is stashed as int8
  rows (sljax.schedule.quantize_rows); the group's backward recomputes it from the stash, dequantized to the compute
  dtype, and takes the vjp there. The last group runs forward and backward in one call: it stashes nothing."""
  dtype = jnp.dtype(model.cfg.dtype)
  bounds = EngineConfig(live_layers=live_layers).bounds(model.cfg.num_layers)

  @jax.custom_vjp
  def stashed_group(stacked, h):
    return model.layers(stacked, h)

  def forward(stacked, h):
    return model.layers(stacked, h), (stacked, quantize_rows(h))

  def backward(residuals, dy):
    stacked, stashed = residuals
    return jax.vjp(model.layers, stacked, dequantize_rows(*stashed, dtype))[1](dy)

  stashed_group.defvjp(forward, backward)

  def loss(params, batch):
    group = lambda a, b: jax.tree.map(lambda x: x[a:b], params["layers"])
    h = model.embed(params["outer"], batch["inputs"]).astype(dtype)  # the stash's dtype once dequantized
    for a, b in bounds[:-1]:
      h = stashed_group(group(a, b), h)
    h = model.layers(group(*bounds[-1]), h)
    total = model.head_loss(params["outer"], h, batch["targets"], batch["weights"])
    return total * (1 / loss_denominator(jnp.sum(batch["weights"])))

  return loss


def train(model, optim_cfg, source, steps: int, eval_batches: list[dict], variant: str = "float32") -> dict:
  """Losses of `steps` plain jitted steps from the model's --seed init, and the held-out loss after them."""
  parked = variant == "bf16_parked_grads" and optim_cfg.grad_clip_norm > 0
  optimizer = make_optimizer(optim_cfg, clip=not parked)
  model_loss = int8_exchange_loss(model, FLAGS.live_layers) if variant == "int8_exchange" else model.loss

  def loss_and_grads(params, batch):
    """The batch's loss and gradient, each sub-batch's summed in fp32 (weighted by its share of the batch's weight)."""
    parts = jax.tree.map(lambda x: x.reshape(FLAGS.sub_batches, -1, *x.shape[1:]), batch)
    share = jnp.sum(parts["weights"], axis=(1, 2)) / loss_denominator(jnp.sum(batch["weights"]))
    losses, grads = jax.vmap(jax.value_and_grad(model_loss), in_axes=(None, 0))(params, parts)
    grads = jax.tree.map(lambda g: jnp.einsum("s,s...->...", share, g.astype(jnp.float32)), grads)
    return jnp.sum(share * losses), grads

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = (jax.value_and_grad(model_loss)(params, batch) if FLAGS.sub_batches == 1
                   else loss_and_grads(params, batch))
    if parked:
      grads = parked_in_bf16(grads, optim_cfg.grad_clip_norm)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.jit(model.init)(jax.random.key(FLAGS.seed))
  opt_state = jax.jit(optimizer.init)(params)  # jitted: op by op it compiled a kernel per operation and leaf
  losses, start = [], time.perf_counter()
  for n in range(steps):
    params, opt_state, loss = step(params, opt_state, source.batch(n))
    losses.append(loss)
  losses = [float(loss) for loss in losses]
  seconds = time.perf_counter() - start
  eval_loss = jax.jit(model.loss)  # one jitted function for every batch: a new one per batch traced each again
  held_out = float(np.mean([float(eval_loss(params, batch)) for batch in eval_batches]))
  final = losses[-min(FLAGS.final_steps, steps):]
  return {"train_loss_final": float(np.mean(final)), "train_loss_last_step": losses[-1],
          "train_loss_first": losses[0], "held_out_loss": held_out, "seconds": seconds}


def main(argv):
  del argv
  configure_process()
  steps = 6 if FLAGS.smoke and not FLAGS["steps"].present else FLAGS.steps
  eval_count = 2 if FLAGS.smoke and not FLAGS["eval_batches"].present else FLAGS.eval_batches
  recipe = RECIPES[FLAGS.model]
  seq_len, batch_size = (32, 4) if FLAGS.smoke else (recipe.seq_len, recipe.batch_size)
  overrides = SMOKE if FLAGS.smoke else {}
  cfg = get_config(FLAGS.model, overrides)
  model = build(cfg)
  data = DataConfig(seq_len=seq_len, batch_size=batch_size, seed=FLAGS.seed,
                    **(dict(max_tokens=2**16, eval_tokens=2**12) if FLAGS.smoke else {}))
  source = make_source(data, cfg.max_positions, cfg.vocab_size, held_out=True)
  eval_batches = source.eval_batches(eval_count)
  # The recipe's schedule over this run's length, as train.py gives it.
  decay_steps, _ = run_decay_steps(steps, recipe.optim.warmup_steps, recipe.optim.learning_rate)
  optim = dataclasses.replace(recipe.optim, decay_steps=decay_steps)
  unknown = set(FLAGS.variants) - set(VARIANTS)
  if unknown:
    raise SystemExit(f"sljax: --variants: {', '.join(sorted(unknown))} unknown (known: {', '.join(VARIANTS)})")
  moments = lambda variant: "int8" if variant == "int8" else "float32"
  runs = {variant: train(model, dataclasses.replace(optim, moments_dtype=moments(variant)), source, steps,
                         eval_batches, variant) for variant in ("float32", *FLAGS.variants)}
  difference = {f"{variant}_minus_float32": {key: runs[variant][key] - runs["float32"][key]
                                             for key in ("train_loss_final", "train_loss_last_step", "held_out_loss")}
                for variant in FLAGS.variants}
  out = {**provenance(), "model": FLAGS.model, "overrides": overrides, "seed": FLAGS.seed, "steps": steps,
         "sub_batches": FLAGS.sub_batches,
         **({"live_layers": FLAGS.live_layers} if "int8_exchange" in FLAGS.variants else {}),
         "batch": [batch_size, seq_len],
         "optimizer": optim.describe(), "final_steps": min(FLAGS.final_steps, steps),
         "held_out_tokens": eval_count * batch_size * seq_len, "runs": runs, **difference}
  print(json.dumps(out, indent=1))
  write_results(FLAGS.out, out)


if __name__ == "__main__":
  define_script_flags()
  app.run(main)
