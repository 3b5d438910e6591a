"""What int8 / int4 weight compression (sljax.quant) costs in quality, on a model trained briefly on CPU.

  python -m benchmarks.quant_quality --out=benchmarks/results/quant_quality_cpu.json   # llama-tiny, ~2 min on 2 cores
  python -m benchmarks.quant_quality --smoke --out=/tmp/quant_smoke.json                # seconds

Trains `--model` for `--steps` steps (AdamW, plain jitted step) on the embedded corpus, then runs held-out text (the
windows of the steps after training, never trained on in the first epoch) through the model with its layer kernels
in bf16 (what is streamed today), and dequantized from int8 and int4 (per-group scales, `--group_size`). Reports, per
format: perplexity, its ratio to bf16, and the largest and mean |logit - bf16 logit|; and the bytes per layer.
"""

import json
import math

import jax
import jax.numpy as jnp
import optax
from absl import app, flags

from benchmarks.common import define_flags, provenance, write_results
from models.presets import build, get_config
from sljax.data import DataConfig, make_source
from sljax.machines import configure_process
from sljax.memory import tree_bytes
from sljax.quant import QuantConfig, dequantize_layers, quantize_layers

flags.DEFINE_string("model", "llama-tiny", "Model preset.")
flags.DEFINE_multi_string("set", [], "Model config override field=value.")
flags.DEFINE_integer("steps", 400, "Training steps.")
flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
flags.DEFINE_float("learning_rate", 3e-3, "AdamW peak rate (20 warmup steps, cosine to 10%).")
flags.DEFINE_integer("eval_batches", 16, "Held-out batches.")
flags.DEFINE_integer("group_size", 128, "Contraction rows per scale.")
define_flags("A 2-layer model, 10 steps of 4 x 32: checks the code path in seconds.")
FLAGS = flags.FLAGS


def overrides() -> dict:
  pairs = dict(item.split("=", 1) for item in FLAGS.set)
  if FLAGS.smoke:
    pairs = {"num_layers": "2", "hidden_size": "128", "intermediate_size": "256", **pairs}
  return {key: int(value) if value.isdigit() else value for key, value in pairs.items()}


def main(argv):
  del argv
  configure_process()
  steps, eval_batches = (10, 2) if FLAGS.smoke else (FLAGS.steps, FLAGS.eval_batches)
  batch_size, seq_len = (4, 32) if FLAGS.smoke else (FLAGS.batch_size, FLAGS.seq_len)
  cfg = get_config(FLAGS.model, {**overrides(), "dtype": "float32"})
  model = build(cfg)
  source = make_source(DataConfig(seq_len=seq_len, batch_size=batch_size,
                                  max_tokens=batch_size * seq_len * (steps + eval_batches + 1)),
                       cfg.max_positions, cfg.vocab_size)
  schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.learning_rate, min(20, steps // 2), steps,
                                                FLAGS.learning_rate / 10)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1))

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.jit(model.init)(jax.random.key(0))  # jitted: op by op it compiled a kernel per operation and shape
  opt_state = jax.jit(optimizer.init)(params)
  losses = []
  for step in range(steps):
    params, opt_state, loss = train_step(params, opt_state, source.batch(step))
    losses.append(float(loss))

  bf16 = build(get_config(FLAGS.model, {**overrides(), "dtype": "bfloat16"}))
  outer = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["outer"])

  @jax.jit
  def logits_and_loss(stacked, batch):  # stacked: bf16 kernels, or compressed ones dequantized here
    h = bf16.layers(dequantize_layers(stacked, jnp.bfloat16), bf16.embed(outer, batch["inputs"]))
    logits = bf16.logits(outer, h).astype(jnp.float32)
    return logits, jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))

  formats = {"bf16": jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["layers"])}
  for bits in (8, 4):
    formats[f"int{bits}"] = quantize_layers(params["layers"], QuantConfig(bits=bits, group_size=FLAGS.group_size))
  held_out = [source.batch(steps + i) for i in range(eval_batches)]
  tokens = sum(batch["targets"].size for batch in held_out)
  reference = [logits_and_loss(formats["bf16"], batch)[0] for batch in held_out]
  results = {}
  for name, stacked in formats.items():
    total, worst, mean_abs = 0.0, 0.0, 0.0
    for batch, want in zip(held_out, reference):
      logits, loss_sum = logits_and_loss(stacked, batch)
      diff = jnp.abs(logits - want)
      total, worst, mean_abs = total + float(loss_sum), max(worst, float(diff.max())), mean_abs + float(diff.mean())
    results[name] = {"perplexity": math.exp(total / tokens), "max_abs_logit_diff": worst,
                     "mean_abs_logit_diff": mean_abs / len(held_out),
                     "layer_bytes": tree_bytes(stacked) // cfg.num_layers}
  for name in results:
    results[name]["perplexity_over_bf16"] = results[name]["perplexity"] / results["bf16"]["perplexity"]
    results[name]["bytes_over_bf16"] = results[name]["layer_bytes"] / results["bf16"]["layer_bytes"]
  out = {**provenance(), "model": FLAGS.model, "overrides": overrides(),
         "train_steps": steps, "train_loss_first_last": [losses[0], losses[-1]], "held_out_tokens": tokens,
         "group_size": FLAGS.group_size, "formats": results}
  print(json.dumps(out, indent=1))
  write_results(FLAGS.out, out)


if __name__ == "__main__":
  app.run(main)
