"""What 8-bit Adam moments (--moments_dtype=int8, sljax.optim.scale_by_adam_8bit) cost in quality, on CPU.

  python -m benchmarks.int8_moments_quality --out=benchmarks/results/int8_moments_quality_cpu.json  # llama-tiny
  python -m benchmarks.int8_moments_quality --smoke --out=/tmp/int8_moments_smoke.json              # seconds

Trains `--model` twice for `--steps` steps on the embedded corpus, with its recipe's AdamW (sljax.optim.RECIPES:
schedule, clipping, betas) and fp32 moments, then with 8-bit ones: the same initialization, batches and plain
jitted step. Reports, for each and their difference (int8 - fp32): the final train loss (the mean over the last
`--final_steps` steps, and the last step's) and the held-out loss (the mean over `--eval_batches` batches of the
corpus's held-out documents, which no training window reads).
"""

import dataclasses
import json
import time

import jax
import numpy as np
import optax
from absl import app, flags

from benchmarks.common import define_flags, provenance, write_results
from models.presets import build, get_config
from sljax.data import DataConfig, make_source
from sljax.machines import configure_process
from sljax.optim import RECIPES, make_optimizer, run_decay_steps

flags.DEFINE_string("model", "llama-tiny", "Model preset (its recipe trains it).")
flags.DEFINE_integer("steps", 2000, "Training steps of each run.")
flags.DEFINE_integer("final_steps", 100, "The final train loss is the mean over this many last steps.")
flags.DEFINE_integer("eval_batches", 16, "Held-out batches, of the training batch's shape.")
flags.DEFINE_integer("seed", 0, "Seeds the initialization and the batches' order, the same for both runs.")
define_flags("A 2-layer model of width 64, batches of 4 x 32, 6 steps and 2 held-out batches (--steps, "
             "--eval_batches given: theirs): checks the code path in seconds.")
FLAGS = flags.FLAGS

SMOKE = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2)
MOMENTS = ("float32", "int8")


def train(model, optim_cfg, source, steps: int, eval_batches: list[dict]) -> dict:
  """Losses of `steps` plain jitted steps from the model's --seed init, and the held-out loss after them."""
  optimizer = make_optimizer(optim_cfg)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.jit(model.init)(jax.random.key(FLAGS.seed))
  opt_state = optimizer.init(params)
  losses, start = [], time.perf_counter()
  for n in range(steps):
    params, opt_state, loss = step(params, opt_state, source.batch(n))
    losses.append(loss)
  losses = [float(loss) for loss in losses]
  seconds = time.perf_counter() - start
  held_out = float(np.mean([float(jax.jit(model.loss)(params, batch)) for batch in eval_batches]))
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
  runs = {moments: train(model, dataclasses.replace(optim, moments_dtype=moments), source, steps, eval_batches)
          for moments in MOMENTS}
  difference = {key: runs["int8"][key] - runs["float32"][key]
                for key in ("train_loss_final", "train_loss_last_step", "held_out_loss")}
  out = {**provenance(), "model": FLAGS.model, "overrides": overrides, "seed": FLAGS.seed, "steps": steps,
         "batch": [batch_size, seq_len],
         "optimizer": optim.describe(), "final_steps": min(FLAGS.final_steps, steps),
         "held_out_tokens": eval_count * batch_size * seq_len, "runs": runs, "int8_minus_float32": difference}
  print(json.dumps(out, indent=1))
  write_results(FLAGS.out, out)


if __name__ == "__main__":
  app.run(main)
