"""Generates text with a model larger than the GPU: weights and KV caches stream through pinned host memory.

  python generate.py --model llama-tiny --random_weights --prompt_file prompts.txt --max_new_tokens 32
  python generate.py --checkpoint runs/llama-tiny --prompt_file prompts.txt --temperature 0.8 --top_p 0.95
  python generate.py --hf_dir Llama-2-70b-hf --tokenizer Llama-2-70b-hf/tokenizer.json --set dtype=bfloat16 \\
      --prompt_file prompts.txt --batch 64 --stop_token 2
  python generate.py --model llama70b --set dtype=bfloat16 --prompt_len 512 --max_new_tokens 32 --plan

One prompt per line of --prompt_file (blank lines skipped); prints one JSON line per prompt, in order:
{"prompt", "completion", "tokens": ids generated, the stop token included}. The layout (batch, sub-batches, resident
layers, where the KV cache lives) comes from sljax.generate_plan.plan, except what the flags fix; --plan prints it and
exits.
"""

import dataclasses
import json
import os

import jax
from absl import app, flags, logging

from models.config import ModelConfig
from models.hf import HFWeights
from models.presets import PRESETS, build, get_config, parse_overrides
from sljax.checkpoint import newest_checkpoint, restore_params
from sljax.data import load_tokenizer
from sljax.generate import OffloadConfig, OffloadedGenerator, SamplingConfig
from sljax.generate_plan import memory_budgets, plan
from sljax.machines import GIB, default_host_budget_help

DEFAULT_MODEL = "llama-tiny"
SAMPLING, OFFLOAD = SamplingConfig(), OffloadConfig()  # the defaults the flags expose

flags.DEFINE_string("model", DEFAULT_MODEL, f"Model preset: {', '.join(PRESETS)}.")
flags.DEFINE_multi_string("set", [], "Model config override field=value, repeatable (e.g. --set dtype=bfloat16).")
flags.DEFINE_string("hf_dir", None, "Hugging Face LLaMA/OPT directory (config.json + *.safetensors).")
flags.DEFINE_string("checkpoint", None, "sljax training run: its workdir or checkpoints/ (the newest step is read).")
flags.DEFINE_bool("random_weights", False, "Random weights of --model (for benchmarks), made one group at a time.")
flags.DEFINE_integer("seed", SAMPLING.seed, "Seeds sampling and --random_weights.")

flags.DEFINE_string("prompt_file", None, "Text file, one prompt per line.")
flags.DEFINE_string("tokenizer", None, "sentencepiece .model or tokenizer.json (default: bytes).")
flags.DEFINE_integer("prompt_len", 0, "Left-pad prompts to this many tokens (default: the longest; --plan without "
                     "--prompt_file needs it).")
flags.DEFINE_integer("batch", 0, "Prompts per generation (0: the plan's choice, at most the number of prompts).")
flags.DEFINE_integer("max_new_tokens", SAMPLING.max_new_tokens, "Tokens generated per prompt, at most.")
flags.DEFINE_float("temperature", SAMPLING.temperature, "Sampling temperature (0: greedy).")
flags.DEFINE_float("top_p", SAMPLING.top_p, "Nucleus sampling: keep the most likely tokens up to this mass.")
flags.DEFINE_multi_integer("stop_token", [], "A row ends after generating this token id (repeatable).")

flags.DEFINE_integer("sub_batches", 0, "Sub-batches sharing each weight fetch (0: the plan chooses).")
flags.DEFINE_integer("live_layers", OFFLOAD.live_layers, "Layers per group: weights fetched to the device together.")
flags.DEFINE_integer("resident_layers", -1, "Last layers kept on the device (-1: as many as the plan fits).")
flags.DEFINE_bool("kv_on_host", None, "KV cache in pinned host memory (default: the plan chooses).")
flags.DEFINE_float("device_memory_gib", 0, "Device memory the plan may use (0: the allocator's limit less 3% and 1 "
                   "GiB; on CPU, 45% of RAM less those).")
flags.DEFINE_float("host_memory_gib", 0, "Pinned host memory the plan may use (0: "
                   f"{default_host_budget_help()}).")
flags.DEFINE_bool("plan", False, "Print the plan (layout, memory, bytes moved per token, estimate) and exit.")

FLAGS = flags.FLAGS


def model_config() -> ModelConfig:
  """From --hf_dir's config.json, the checkpoint's metadata, or --model; --set overrides any of them."""
  sources = [name for name in ("hf_dir", "checkpoint", "random_weights") if FLAGS[name].value]
  if len(sources) > 1:
    raise ValueError(f"give one weight source, not {' and '.join('--' + s for s in sources)}")
  for source, names in (("hf_dir", "whose config.json names the model"), ("checkpoint", "whose metadata names it")):
    if FLAGS[source].value and FLAGS["model"].present:
      raise ValueError(f"give --model or --{source} ({names}), not both")
  overrides = parse_overrides(FLAGS.set)
  if FLAGS.hf_dir:
    return HFWeights(FLAGS.hf_dir, **overrides).cfg  # reads config.json and the files' headers, no tensor
  if FLAGS.checkpoint:
    return ModelConfig(**{**read_checkpoint(FLAGS.checkpoint)[0]["model_config"], **overrides})
  return get_config(FLAGS.model, overrides)


def read_checkpoint(directory: str, params: bool = False) -> tuple[dict, dict | None]:
  """(metadata, params if asked) of the newest checkpoint under `directory`; ValueError (one line) when there is
  none or it cannot be read."""
  step_dir, meta = newest_checkpoint(directory)
  if "model_config" not in meta:
    raise ValueError(f"checkpoint {step_dir} was not written by train.py: its metadata has no model_config")
  return meta, restore_params(directory) if params else None


def codec(path: str | None):
  """(encode: str -> ids, decode: ids -> str, vocab size) of the tokenizer file, or of bytes. Prompts start with the
  tokenizer's begin-of-text token where it has one, as Hugging Face's tokenizers and LLaMA's sentencepiece add it."""
  vocab_size = load_tokenizer(path).vocab_size  # also checks the file
  if path is None:
    decode = lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return lambda text: list(text.encode()), decode, vocab_size
  if path.endswith(".model"):
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=path)
    begin = [model.bos_id()] if model.bos_id() >= 0 else []
    return lambda text: begin + model.encode(text), model.decode, vocab_size
  import tokenizers

  model = tokenizers.Tokenizer.from_file(path)
  return lambda text: model.encode(text).ids, model.decode, vocab_size


def read_prompts(path: str) -> list[str]:
  if not os.path.isfile(path):
    raise ValueError(f"--prompt_file {path} does not exist")
  with open(path, encoding="utf-8") as f:
    prompts = [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise ValueError(f"--prompt_file {path} has no prompts")
  return prompts


def make_plan(cfg: ModelConfig, prompt_len: int, prompts: int):
  for name in ("device_memory_gib", "host_memory_gib"):
    if FLAGS[name].value < 0:
      raise ValueError(f"--{name} must be >= 0 (0: the default), got {FLAGS[name].value}")
  device, host = memory_budgets()
  return plan(
      cfg, prompt_len, FLAGS.max_new_tokens, int(FLAGS.device_memory_gib * GIB) or device,
      int(FLAGS.host_memory_gib * GIB) or host, batch=FLAGS.batch or None, sub_batches=FLAGS.sub_batches or None,
      live_layers=FLAGS.live_layers, resident_layers=None if FLAGS.resident_layers < 0 else FLAGS.resident_layers,
      kv_on_host=FLAGS.kv_on_host, max_batch=prompts or 1024)


def open_weights(cfg: ModelConfig):
  """What OffloadedGenerator.load reads (None for --random_weights), checked before anything is allocated: the
  Hugging Face files' headers, or the checkpoint's params, read into host memory."""
  if FLAGS.random_weights:
    return None
  if FLAGS.hf_dir:
    # Read in the compute dtype, one layer group at a time straight to its home (device or pinned host): a bf16
    # 70B model is 138 GB, more than the host RAM of many GPU machines.
    return HFWeights(FLAGS.hf_dir, **{**parse_overrides(FLAGS.set), "param_dtype": cfg.dtype})
  return read_checkpoint(FLAGS.checkpoint, params=True)[1]


def run() -> list[dict]:
  """Checks the request, then generates; returns the printed records. Bad requests exit with one line."""
  try:
    cfg = model_config()
    sampling = SamplingConfig(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                              stop_tokens=tuple(FLAGS.stop_token), seed=FLAGS.seed)
    encode, decode, vocab_size = codec(FLAGS.tokenizer)
    if vocab_size > cfg.vocab_size:
      raise ValueError(f"tokenizer {FLAGS.tokenizer or 'bytes'} has {vocab_size} tokens, more than the model's "
                       f"vocab_size {cfg.vocab_size}")
    if not FLAGS.prompt_file and not (FLAGS.plan and FLAGS.prompt_len):
      raise ValueError("give --prompt_file (or, with --plan, --prompt_len)")
    texts = read_prompts(FLAGS.prompt_file) if FLAGS.prompt_file else []
    prompts = [encode(text) for text in texts]
    longest = max((len(p) for p in prompts), default=0)
    if FLAGS.prompt_len and longest > FLAGS.prompt_len:
      raise ValueError(f"a prompt has {longest} tokens, more than --prompt_len {FLAGS.prompt_len}")
    if 0 in map(len, prompts):
      raise ValueError("a prompt encodes to no tokens")
    prompt_len = FLAGS.prompt_len or longest
    chosen = make_plan(cfg, prompt_len, len(prompts))
    if FLAGS.plan:
      print(f"plan for {FLAGS.hf_dir or FLAGS.checkpoint or FLAGS.model} on {jax.devices()[0].device_kind}:\n"
            f"{chosen.describe(cfg)}")
      return []
    if not (FLAGS.hf_dir or FLAGS.checkpoint or FLAGS.random_weights):
      raise ValueError("give the weights: --hf_dir, --checkpoint or --random_weights")
    stored = open_weights(cfg)
  except ValueError as error:
    raise SystemExit(f"sljax: {error}") from None

  generator = OffloadedGenerator(build(cfg), chosen.offload)
  weights = generator.init(jax.random.key(FLAGS.seed)) if stored is None else generator.load(stored)
  records = []
  for first in range(0, len(prompts), chosen.batch):
    batch = prompts[first:first + chosen.batch]
    filler = [batch[-1]] * (chosen.batch - len(batch))  # the last batch runs full size: same shapes, no recompile
    batch_sampling = dataclasses.replace(sampling, seed=sampling.seed + first)  # fresh draws for every batch
    result = generator.generate(weights, batch + filler, batch_sampling, prompt_len=prompt_len)
    for i in range(len(batch)):
      ids = [int(t) for t in result.tokens[i, :result.lengths[i]]]
      kept = ids[:-1] if ids and ids[-1] in sampling.stop_tokens else ids
      records.append({"prompt": texts[first + i], "completion": decode(kept), "tokens": ids})
      print(json.dumps(records[-1], ensure_ascii=False), flush=True)
  return records


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"sljax: unexpected arguments {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)  # stdout is the JSON lines; libraries' INFO chatter would bury them
  run()


if __name__ == "__main__":
  app.run(main)
