"""A trained run exported to a Hugging Face directory at scale: the export's time and peak host memory, and the logits
transformers gives on the written files beside the model's own on the checkpoint's params (cast to the dtype written).

  python -m benchmarks.export_scale --checkpoint=runs/llama13b --out=benchmarks/results/export_scale_h200.json
  python -m benchmarks.export_scale --smoke --out=/tmp/export_smoke.json       # trains a tiny run first; any machine

Three processes, one after the other, so that each one's memory is its own: `python -m sljax.export` as a user types
it (its peak RSS from the kernel's rusage of that child), the model's logits on the checkpoint's params in JAX, and
transformers' on the exported directory (torch, on the GPU where there is one). Both forwards are in fp32 on the
same params (the checkpoint's, rounded to --dtype), so they differ only by the two frameworks' arithmetic.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks.common import REPO, define_flags, provenance, write_results
from sljax.machines import configure_process

define_flags("Trains a tiny run on CPU and exports it: checks the code path in seconds.")
flags.DEFINE_string("checkpoint", "", "A train.py run's workdir (its newest checkpoint is exported).")
flags.DEFINE_string("workdir", "", "Where the export (and the smoke run) go (default: a temporary directory, removed).")
flags.DEFINE_string("dtype", "bfloat16", "The param dtype written (--set=param_dtype=...).")
flags.DEFINE_integer("rows", 2, "Sequences of the logits check.")
flags.DEFINE_integer("seq", 32, "Tokens per sequence of the logits check.")
flags.DEFINE_enum("part", "", ["", "jax", "transformers"], "Internal: one forward in this process.")
flags.DEFINE_string("tokens", "", "Internal: the .npy of tokens for --part.")
flags.DEFINE_string("hf", "", "Internal: the exported directory for --part=transformers.")
FLAGS = flags.FLAGS

SMOKE_RUN = ["--model=llama-tiny", "--set=num_layers=3", "--set=hidden_size=32", "--set=intermediate_size=64",
             "--set=num_heads=2", "--set=num_kv_heads=1", "--seq_len=32", "--batch_size=2", "--max_tokens=200000",
             "--steps=2", "--checkpoint_every=2"]


def jax_logits(checkpoint: str, tokens_BxS: np.ndarray, dtype: str) -> np.ndarray:
  """The model's fp32 logits on the newest checkpoint's params, each rounded to `dtype` first (as written)."""
  import jax
  import jax.numpy as jnp
  from sljax.checkpoint import newest_checkpoint, read_params
  from sljax.export import Cast
  from models.config import ModelConfig
  from models.presets import build
  import dataclasses
  jax.config.update("jax_default_matmul_precision", "highest")  # fp32 matmuls, as torch's default on the GPU
  cfg = ModelConfig(**newest_checkpoint(checkpoint)[1]["model_config"])
  reader = Cast(read_params(checkpoint), dtype)
  model = build(dataclasses.replace(cfg, dtype="float32", param_dtype="float32"))
  up = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
  outer = up(reader.outer())
  h = model.embed(outer, jnp.asarray(tokens_BxS, jnp.int32))
  for start in range(cfg.num_layers):  # a layer's params on the device at a time
    h = model.layers(up(reader.layers(start, start + 1)), h)
  return np.asarray(model.logits(outer, h))


def transformers_logits(directory: str, tokens_BxS: np.ndarray) -> tuple[np.ndarray, float]:
  """transformers' fp32 logits on the exported directory, and the seconds its from_pretrained took."""
  import torch
  import transformers
  start = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                            attn_implementation="eager")
  seconds = time.perf_counter() - start
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = model.to(device).eval()
  with torch.no_grad():
    return model(torch.from_numpy(tokens_BxS).long().to(device)).logits.float().cpu().numpy(), seconds


def child(args: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
  """Runs `args` from the repository root: (the finished process, its seconds, its peak RSS in GiB)."""
  start = time.perf_counter()
  with tempfile.TemporaryFile("w+") as log:
    process = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    log.seek(0)
    output = log.read()
  if process.returncode:
    raise SystemExit(f"{' '.join(args[1:])} failed ({process.returncode}):\n{output[-3000:]}")
  return subprocess.CompletedProcess(args, process.returncode, output), seconds, usage.ru_maxrss / 2**20


def part(name: str, workdir: str, extra: list[str]) -> tuple[np.ndarray, dict]:
  """One forward in its own process (this module's --part): its logits and its facts."""
  out = os.path.join(workdir, f"{name}.npy")
  done, seconds, rss = child([sys.executable, "-m", "benchmarks.export_scale", f"--part={name}", f"--out={out}",
                              f"--tokens={os.path.join(workdir, 'tokens.npy')}", *extra])
  facts = json.loads(done.stdout.strip().splitlines()[-1])
  return np.load(out), {"seconds": round(seconds, 1), "peak_rss_gib": round(rss, 2), **facts}


def main(argv):
  del argv
  if FLAGS.part:
    tokens_BxS = np.load(FLAGS.tokens)
    if FLAGS.part == "jax":
      configure_process()  # here only: the parent runs no jax, and its XLA settings would reach its children
      np.save(FLAGS.out, jax_logits(FLAGS.checkpoint, tokens_BxS, FLAGS.dtype))
      print(json.dumps({}))
    else:
      logits, load_seconds = transformers_logits(FLAGS.hf, tokens_BxS)
      np.save(FLAGS.out, logits)
      print(json.dumps({"from_pretrained_seconds": round(load_seconds, 1)}))
    return
  if not FLAGS.smoke and not FLAGS.checkpoint:
    raise SystemExit("sljax: give --checkpoint (a train.py run's workdir) or --smoke")
  root = FLAGS.workdir or tempfile.mkdtemp(prefix="export_scale_")
  os.makedirs(root, exist_ok=True)
  try:
    checkpoint = FLAGS.checkpoint
    if FLAGS.smoke:
      checkpoint = os.path.join(root, "run")
      child([sys.executable, "train.py", f"--workdir={checkpoint}", *SMOKE_RUN])
    hf = os.path.join(root, "hf")
    shutil.rmtree(hf, ignore_errors=True)
    command = [sys.executable, "-m", "sljax.export", f"--checkpoint={checkpoint}", f"--out={hf}",
               f"--set=param_dtype={FLAGS.dtype}"]
    done, seconds, rss = child(command)
    written = sum(os.path.getsize(os.path.join(hf, name)) for name in os.listdir(hf))
    with open(os.path.join(hf, "config.json")) as f:
      config = json.load(f)
    print(done.stdout.strip().splitlines()[-1])
    print(f"export: {seconds:.1f} s, {written / 1e9:.2f} GB written ({written / 1e9 / seconds:.2f} GB/s), "
          f"peak RSS {rss:.2f} GiB", flush=True)
    vocab = config["vocab_size"]
    np.save(os.path.join(root, "tokens.npy"),
            np.random.default_rng(0).integers(0, vocab, (FLAGS.rows, FLAGS.seq)).astype(np.int32))
    want, jax_facts = part("jax", root, [f"--checkpoint={checkpoint}", f"--dtype={FLAGS.dtype}"])
    got, hf_facts = part("transformers", root, [f"--hf={hf}"])
    diff = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    agree = float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))
    print(f"logits: largest difference {diff:.2e} (largest logit {scale:.2f}), argmax agreement {agree:.4f}")
    result = {
        **provenance(None, "transformers", "torch", "safetensors"),
        "checkpoint": checkpoint, "export_command": " ".join(["python", *command[1:]]),
        "model": {key: config.get(key) for key in ("model_type", "num_hidden_layers", "hidden_size",
                                                    "intermediate_size", "vocab_size", "torch_dtype", "dtype")},
        "files": sorted(os.listdir(hf)), "bytes_written": written, "export_seconds": round(seconds, 1),
        "export_gb_per_s": round(written / 1e9 / seconds, 3), "export_peak_rss_gib": round(rss, 2),
        "jax_forward": jax_facts, "transformers_forward": hf_facts,
        "logits_shape": list(want.shape), "logits_max_abs_diff": diff, "logits_max_abs": scale,
        "argmax_agreement": agree, "finite": bool(np.isfinite(got).all() and np.isfinite(want).all()),
    }
    write_results(FLAGS.out, result)
  finally:
    if not FLAGS.workdir:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
