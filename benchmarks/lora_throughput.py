"""LoRA fine-tuning throughput on one GPU: a frozen random base (streamed where the device cannot hold it), adapters
of --lora_rank on every projection, the plan's batch and placement; then a save and a restore of the adapters'
state through the project's checkpointer, and the step after each compared.

  python -m benchmarks.lora_throughput --models=llama70b,llama13b --out=benchmarks/results/lora_llama70b_h200.json
  python -m benchmarks.lora_throughput --smoke --out=/tmp/lora_smoke.json   # tiny shapes, any machine
  python -m benchmarks.lora_throughput --models=llama70b --base_bits=4 --out=...  # QLoRA: the int4 base resident

Per model: the plan (sljax.lora.plan.plan_lora) for --seq_len; the base made one group at a time straight into its
place; one warm-up step (it compiles), --steps timed steps. Recorded: tokens/s; mfu and hfu = tokens/s x FLOPs per
token / peak, with FLOPs per token from sljax.lora.engine.lora_flops_per_token: model FLOPs for mfu (base matmuls
forward and input gradient, the adapters' forward and both gradients, causal attention forward and backward, the
head's forward and input gradient; no weight gradient of the base exists; no recompute), hardware FLOPs for hfu (the
same plus the forward once more for each recomputed layer); PCIe bytes per step (counted by the placement); peak
device memory and host RSS. (Files from before hfu was recorded hold the hardware figure as mfu, with its FLOPs per
token as flops_per_token.) Then: save the state, one more step (loss A), restore the saved state,
the same step again (loss B): A must equal B.
"""

import dataclasses
import gc
import resource
import shutil
import time

import jax
import numpy as np
import optax
from absl import app, flags

from benchmarks.common import batch_of, define_flags, provenance, write_results
from models.presets import build, get_config
from sljax.checkpoint import Checkpointer
from sljax.lora.engine import LoraEngine, lora_flops_per_token
from sljax.lora.model import LoraConfig, LoraModel
from sljax.footprint import pass_copy_seconds
from sljax.lora.plan import plan_lora
from sljax.machines import GIB, Budget, configure_process, default_budget, rates_of

define_flags("Tiny llama on CPU with a budget that makes half its base stream: checks the code path.")
flags.DEFINE_list("models", ["llama70b", "llama13b"], "Presets to fine-tune, one after another in this process.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
flags.DEFINE_integer("batch", 0, "Rows per step (0: the plan's).")
flags.DEFINE_integer("lora_rank", 16, "Adapter rank.")
flags.DEFINE_integer("base_bits", 0, "The frozen base's kernels as 8- or 4-bit codes with scales, as train.py "
                     "--base_bits (0: in the compute dtype).")
flags.DEFINE_integer("steps", 3, "Timed steps after the warm-up step.")
flags.DEFINE_float("host_memory_gib", 85, "Pinned host memory the plan may use (and XLA's pinned pool, as train.py's "
                   "--host_memory_gib sets it).")
flags.DEFINE_float("device_memory_gib", 0, "Device memory the plan may use (0: the allocator's limit; the plan keeps "
                   "sljax.footprint.GPU_MARGIN_BYTES of it unplanned).")
flags.DEFINE_string("workdir", "/tmp/sljax_lora_checkpoint", "Where the adapters' checkpoint goes (removed after).")
FLAGS = flags.FLAGS


def device_peak_bytes():
  return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def run(name: str, budget: Budget, overrides: dict) -> dict:
  model = LoraModel(build(get_config(name, overrides)), LoraConfig(rank=FLAGS.lora_rank, alpha=2.0 * FLAGS.lora_rank,
                                                                    base_bits=FLAGS.base_bits))
  seq = FLAGS.seq_len
  optimizer = optax.adamw(1e-4, weight_decay=0.0)
  start = time.perf_counter()
  plan = plan_lora(model, seq, budget, batch=FLAGS.batch, optimizer=optimizer)
  print(f"{name}: {plan.describe()}", flush=True)
  engine = LoraEngine(model, optimizer, plan.engine)
  engine.init_base(jax.random.key(0))
  state = engine.init(jax.random.key(1))
  jax.block_until_ready(state)
  init_s = time.perf_counter() - start
  batch = batch_of(plan.batch, seq, model.cfg.vocab_size)

  start = time.perf_counter()
  state, loss = engine.step(state, batch)
  first = float(loss)
  warmup_s = time.perf_counter() - start
  moved_before = dict(engine.place.moved)
  times, losses = [], []
  for _ in range(FLAGS.steps):
    start = time.perf_counter()
    state, loss = engine.step(state, batch)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - start)
  moved = {k: (v - moved_before[k]) // FLAGS.steps for k, v in engine.place.moved.items()}
  step_s = float(np.median(times))
  tokens_per_s = plan.batch * seq / step_s
  last_layers = engine.groups[-1][1] - engine.groups[-1][0]
  flops = lora_flops_per_token(model, seq, recomputed_layers=model.cfg.num_layers - last_layers)
  machine = rates_of(jax.devices()[0].device_kind)
  peak = machine.peak_flops
  copy_s = (moved["host_to_device"] / machine.copy_bytes_per_s
            + moved["device_to_host"] / machine.copy_to_host_bytes_per_s)
  result = {
      "model": name, "lora_rank": FLAGS.lora_rank, "base_bits": FLAGS.base_bits, "seq_len": seq, "batch": plan.batch,
      "plan": dataclasses.asdict(plan.engine), "plan_device_bytes": plan.device_bytes,
      "plan_host_bytes": plan.host_bytes, "plan_compute_bound": plan.compute_bound,
      "plan_seconds": {name: {"compute": phase.compute_seconds, "copies": pass_copy_seconds(plan.machine, phase)}
                       for name, phase in plan.phases.items()},
      "step_seconds": step_s, "step_times": times, "tokens_per_s": tokens_per_s,
      "model_flops_per_token": flops.model, "hardware_flops_per_token": flops.hardware,
      "mfu": tokens_per_s * flops.model / peak, "hfu": tokens_per_s * flops.hardware / peak,
      "pcie_bytes_per_step": moved, "pcie_seconds_per_step_at_the_copy_rates": copy_s,
      "first_loss": first, "losses": losses, "init_seconds": init_s, "warmup_seconds": warmup_s,
      "adapter_params": int(sum(x.size for x in jax.tree.leaves(state["adapters"]))),
      "peak_device_bytes": device_peak_bytes(),
      "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }
  print(f"{name}: {tokens_per_s:,.0f} tok/s, MFU {result['mfu']:.3f}, HFU {result['hfu']:.3f}, step {step_s:.2f} s, "
        f"PCIe {sum(moved.values()) / 1e9:.1f} GB/step ({copy_s:.2f} s at the copy rates)", flush=True)
  result.update(save_and_resume(engine, state, batch))
  return result


def save_and_resume(engine: LoraEngine, state, batch) -> dict:
  """Saves the state, steps once (loss A), restores the saved state into the engine's layout, steps again (B)."""
  shutil.rmtree(FLAGS.workdir, ignore_errors=True)
  checkpointer = Checkpointer(FLAGS.workdir, save_every=1)
  start = time.perf_counter()
  checkpointer.save(int(state["step"]), state, {"base": "random, key 0"}, force=True)
  save_s = time.perf_counter() - start
  state, loss = engine.step(state, batch)
  after_save = float(loss)
  del state
  gc.collect()
  start = time.perf_counter()
  step, restored, meta = checkpointer.restore_latest(engine.abstract(jax.random.key(1)))
  restore_s = time.perf_counter() - start
  restored, loss = engine.step(restored, batch)
  after_restore = float(loss)
  checkpointer.close()
  shutil.rmtree(FLAGS.workdir, ignore_errors=True)
  print(f"checkpoint: save {save_s:.1f} s, restore {restore_s:.1f} s; step after save {after_save:.6f}, after "
        f"restore {after_restore:.6f}", flush=True)
  return {"checkpoint": {"save_seconds": save_s, "restore_seconds": restore_s, "restored_step": step,
                         "loss_after_save": after_save, "loss_after_restore": after_restore,
                         "equal": after_save == after_restore}}


def main(argv):
  del argv
  configure_process(FLAGS.host_memory_gib)
  results = []
  if FLAGS.smoke:
    FLAGS.seq_len, FLAGS.steps, FLAGS.lora_rank = 16, 2, 4
    overrides = dict(num_layers=8, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, vocab_size=256,
                     dtype="float32")
    # A device budget two layers short of the whole base (with everything else the plan counts): part of it streams.
    roomy = plan_lora(LoraModel(build(get_config("llama-tiny", overrides)), LoraConfig(rank=4, alpha=8.0)), 16,
                      Budget(GIB, GIB), batch=4, tail_layers=0)
    layer = roomy.device_bytes["resident base layers"] // 8
    FLAGS.batch = 4
    results.append(run("llama-tiny", Budget(sum(roomy.device_bytes.values()) - 2 * layer, GIB), overrides))
  else:
    budget = default_budget()
    device = FLAGS.device_memory_gib * GIB or budget.device_bytes
    for name in FLAGS.models:
      results.append(run(name, Budget(int(device), int(FLAGS.host_memory_gib * GIB)),
                         dict(param_dtype="bfloat16", remat=False)))
      gc.collect()
  write_results(FLAGS.out, {**provenance(), "smoke": FLAGS.smoke, "results": results})


if __name__ == "__main__":
  app.run(main)
