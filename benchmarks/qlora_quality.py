"""What an int4 frozen base (train.py --lora_rank --base_bits=4, QLoRA's) costs LoRA fine-tuning in quality, on CPU.

  python -m benchmarks.qlora_quality --out=benchmarks/results/qlora_quality_cpu.json  # llama-tiny, minutes
  python -m benchmarks.qlora_quality --smoke --out=/tmp/qlora_quality_smoke.json      # seconds

Pretrains `--model` briefly on the embedded corpus (`--pretrain_steps` plain jitted steps, its recipe's AdamW over
that length), then fine-tunes LoRA adapters on that base with the LoRA engine, twice from the same adapters on the
same following batches of the corpus: once on the base as the engine runs it unquantized (its kernels in the compute
dtype, bf16), once on it quantized to int4 (group-wise codes with scales, sljax.quant). Reports the held-out loss
(the mean over `--eval_batches` batches of the corpus's held-out documents, which no training window reads) of each
base before fine-tuning and after, and their difference (int4 - bf16).
"""

import dataclasses
import json
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.common import define_flags, provenance, write_results
from models.presets import build, get_config
from sljax.data import DataConfig, make_source
from sljax.lora.engine import LoraEngine, LoraEngineConfig
from sljax.lora.model import LoraConfig, LoraModel
from sljax.machines import configure_process
from sljax.optim import RECIPES, make_optimizer, run_decay_steps
from sljax.steps import all_on_device

flags.DEFINE_string("model", "llama-tiny", "Model preset (its recipe pretrains it).")
flags.DEFINE_integer("pretrain_steps", 300, "Pretraining steps of the base.")
flags.DEFINE_integer("steps", 200, "LoRA fine-tuning steps on each base.")
flags.DEFINE_integer("lora_rank", 16, "LoRA rank (every projection gets adapters, alpha = 2 x rank).")
flags.DEFINE_float("learning_rate", 1e-3, "The adapters' peak AdamW rate (the recipe's warmup, cosine decay).")
flags.DEFINE_integer("base_bits", 4, "The quantized base's bits (8 or 4).")
flags.DEFINE_integer("eval_batches", 16, "Held-out batches, of the training batch's shape.")
flags.DEFINE_integer("seed", 0, "Seeds the initialization, the adapters and the batches' order.")
define_flags("A 2-layer model of width 64, batches of 4 x 32, 30 pretraining and 10 fine-tuning steps, 2 held-out "
             "batches (the flags given: theirs): checks the code path in seconds.")
FLAGS = flags.FLAGS

SMOKE = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2)


def smoke_or(name: str, smoke_value):
  return smoke_value if FLAGS.smoke and not FLAGS[name].present else FLAGS[name].value


def pretrain(model, optim_cfg, source, steps: int) -> tuple[dict, list[float]]:
  """The model's params after `steps` plain steps from its --seed init, and the steps' losses."""
  step_fns = all_on_device(model, make_optimizer(optim_cfg))
  state, losses = step_fns.init(jax.random.key(FLAGS.seed)), []
  for n in range(steps):
    state, loss = step_fns.step(state, source.batch(n))
    losses.append(loss)
  return jax.tree.map(np.asarray, state["params"]), [float(loss) for loss in losses]


def fine_tune(model: LoraModel, optim_cfg, params: dict, source, first: int, steps: int, eval_batches) -> dict:
  """LoRA fine-tuning of `model`'s adapters on the base `params` (the whole base on the device, as one group),
  batches first .. first + steps - 1 of `source`: the held-out loss before and after, the steps' losses and time."""
  layers = model.cfg.num_layers
  engine = LoraEngine(model, make_optimizer(optim_cfg), LoraEngineConfig(live_layers=layers, resident_layers=layers,
                                                                         activations_on_host=False))
  engine.load_base(params)
  state = engine.init(jax.random.key(FLAGS.seed + 1))
  held_out = lambda state: float(np.mean([float(engine.eval_loss(state, batch)) for batch in eval_batches]))
  before, losses, start = held_out(state), [], time.perf_counter()
  for n in range(first, first + steps):
    state, loss = engine.step(state, source.batch(n))
    losses.append(loss)
  losses = [float(loss) for loss in losses]
  seconds = time.perf_counter() - start
  return {"held_out_loss_before": before, "held_out_loss": held_out(state), "train_loss_first": losses[0],
          "train_loss_last_step": losses[-1], "seconds": seconds}


def main(argv):
  del argv
  configure_process()
  pretrain_steps, steps = smoke_or("pretrain_steps", 30), smoke_or("steps", 10)
  eval_count = smoke_or("eval_batches", 2)
  recipe = RECIPES[FLAGS.model]
  seq_len, batch_size = (32, 4) if FLAGS.smoke else (recipe.seq_len, recipe.batch_size)
  overrides = SMOKE if FLAGS.smoke else {}
  cfg = get_config(FLAGS.model, overrides)
  data = DataConfig(seq_len=seq_len, batch_size=batch_size, seed=FLAGS.seed,
                    **(dict(max_tokens=2**16, eval_tokens=2**12) if FLAGS.smoke else {}))
  source = make_source(data, cfg.max_positions, cfg.vocab_size, held_out=True)
  eval_batches = source.eval_batches(eval_count)
  # The recipe's schedule over each phase's length, as train.py gives it.
  schedule = lambda optim, steps: dataclasses.replace(
      optim, decay_steps=run_decay_steps(steps, optim.warmup_steps, optim.learning_rate)[0])
  pretrain_optim = schedule(recipe.optim, pretrain_steps)
  params, pretrain_losses = pretrain(build(cfg), pretrain_optim, source, pretrain_steps)
  lora_optim = schedule(dataclasses.replace(recipe.optim, learning_rate=FLAGS.learning_rate), steps)
  base = build(dataclasses.replace(cfg, remat=False))
  runs = {}
  for bits in (0, FLAGS.base_bits):
    lora = LoraConfig(rank=FLAGS.lora_rank, alpha=2.0 * FLAGS.lora_rank, base_bits=bits)
    runs[f"int{bits}" if bits else cfg.dtype] = fine_tune(LoraModel(base, lora), lora_optim, params, source,
                                                          pretrain_steps, steps, eval_batches)
  unquantized, quantized = runs.values()
  difference = {key: quantized[key] - unquantized[key] for key in ("held_out_loss_before", "held_out_loss")}
  out = {**provenance(), "model": FLAGS.model, "overrides": overrides, "seed": FLAGS.seed,
         "batch": [batch_size, seq_len], "held_out_tokens": eval_count * batch_size * seq_len,
         "pretrain": {"steps": pretrain_steps, "optimizer": pretrain_optim.describe(),
                      "train_loss_first": pretrain_losses[0], "train_loss_last_step": pretrain_losses[-1]},
         "lora": {"steps": steps, "rank": FLAGS.lora_rank, "alpha": 2.0 * FLAGS.lora_rank,
                  "targets": "every projection", "optimizer": lora_optim.describe()},
         "runs": runs, "quantized_minus_unquantized": difference}
  print(json.dumps(out, indent=1))
  write_results(FLAGS.out, out)


if __name__ == "__main__":
  app.run(main)
