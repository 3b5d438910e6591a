"""From a generation request to its records: the model and its weights (Hugging Face files, an sljax checkpoint, a
LoRA run's adapters merged into their base, or a random init), the prompts through the tokenizer, the plan, and the
batches through OffloadedGenerator. generate.py is these functions behind flags. Imports nothing from training but
the checkpoint readers (sljax.checkpoint's, sljax.lora.checkpoint's).

  job = generate_launch.prepare(GenerateConfig(random_weights=True, prompt_file="prompts.txt"), SamplingConfig())
  for record in generate_launch.generate(job):
    print(record["completion"])

Messages call GenerateConfig's fields by their generate.py flags (--prompt_file, --hf_dir).
"""

import contextlib
import dataclasses
import os
import sys
import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, saved_model_config
from models.common import params_reader
from models.hf import HFWeights
from models.presets import build, get_config, parse_overrides
from sljax.checkpoint import newest_checkpoint, restore_params
from sljax.data import load_tokenizer
from sljax.generate import OffloadConfig, OffloadedGenerator, SamplingConfig
from sljax.generate_plan import memory_budgets, plan
from sljax.lora.checkpoint import MergedWeights, base_weights, open_checkpoint, read_adapters
from sljax.machines import GIB, MACHINES, check_budget_gib
from sljax.memory import MemoryPeaks

DEFAULT_MODEL = "llama-tiny"  # train.py's too: a checkpoint of `python train.py` needs no --model


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  """What to generate from, beyond SamplingConfig: the weights, the prompts, and the layout the plan leaves open."""

  model: str | None = None  # model preset (models.presets.PRESETS); None: DEFAULT_MODEL, unless another source
  overrides: tuple[str, ...] = ()  # model config override field=value, repeatable (e.g. --set dtype=bfloat16)
  hf_dir: str | None = None  # Hugging Face LLaMA/OPT directory (config.json + *.safetensors)
  checkpoint: str | None = None  # an sljax training run: its workdir or checkpoints/ (the newest step is read)
  # a train.py --lora_rank run (its workdir or checkpoints/): the newest adapters, merged into the base its checkpoint
  # names (--hf_dir: that base, read from there) one layer group at a time as the weights are read
  lora_checkpoint: str | None = None
  random_weights: bool = False  # random weights of --model (for benchmarks), made one group at a time
  prompt_file: str | None = None  # text file, one prompt per line
  tokenizer: str | None = None  # a sentencepiece .model or tokenizer.json (default: bytes)
  # left-pad prompts to this many tokens (default: the longest; --plan without --prompt_file needs it)
  prompt_len: int = 0
  batch: int = 0  # prompts per generation (0: the plan's choice, at most the number of prompts)
  sub_batches: int = 0  # sub-batches sharing each weight fetch (0: the plan chooses)
  live_layers: int = OffloadConfig.live_layers  # layers per group: weights fetched to the device together
  resident_layers: int = -1  # last layers kept on the device (-1: as many as the plan fits)
  kv_on_host: bool | None = None  # KV cache in pinned host memory (default: the plan chooses)
  streamed_bits: int = 16  # streamed layers' matmul kernels: 16 (the compute dtype, exact), or int8 / int4 codes
  resident_bits: int = 16  # the same for the layers kept on the device
  # device memory the plan may use (0: the allocator's limit; on CPU, 45% of RAM); a GPU plan leaves
  # sljax.footprint.GPU_MARGIN_BYTES of it unplanned
  device_memory_gib: float = 0
  # pinned host memory the plan may use (0: the default host budget, sljax.machines.default_budget)
  host_memory_gib: float = 0
  plan: bool = False  # print the plan (layout, memory, bytes moved per token, estimate) and exit
  # with --plan: plan for one GPU of this kind (its allocator limit, pinned budget and rates from sljax.machines)
  # instead of this machine's device
  target: typing.Literal[("", *MACHINES)] = ""
  # print the plan, and at the end the memory peaks (live arrays per memory kind, sampled by a thread; the device
  # allocator's), to stderr: what benchmarks.plan_vs_peak compares with the plan
  memory_peaks: bool = False

  def __post_init__(self):
    check_budget_gib(device_memory_gib=self.device_memory_gib, host_memory_gib=self.host_memory_gib)
    if self.target not in MACHINES and self.target:  # the flag checks it; a library caller's typo must not plan
      raise ValueError(f"--target must be one of {', '.join(map(repr, MACHINES))}, got {self.target!r}")
    if self.target and not self.plan:
      raise ValueError(f"--target={self.target} plans for a machine this is not: use it with --plan")


class Generation(NamedTuple):
  """A checked generation request: its model, prompts, plan and weights (None: random)."""

  request: GenerateConfig
  model: ModelConfig
  sampling: SamplingConfig
  texts: list[str]
  prompts: list[list[int]]  # token ids of each text
  prompt_len: int
  decode: typing.Callable  # ids -> text
  plan: typing.Any  # sljax.generate_plan.Plan
  weights: typing.Any


def model_config(request: GenerateConfig) -> ModelConfig:
  """From --hf_dir's config.json, the checkpoint's metadata (--checkpoint's or --lora_checkpoint's), or --model;
  --set overrides any of them."""
  sources = [name for name in ("hf_dir", "checkpoint", "random_weights", "lora_checkpoint") if getattr(request, name)]
  if request.lora_checkpoint and request.hf_dir:
    sources.remove("hf_dir")  # where the adapters' base is
  if len(sources) > 1:
    raise ValueError(f"give one weight source, not {' and '.join('--' + s for s in sources)}")
  for source, names in (("hf_dir", "whose config.json names the model"), ("checkpoint", "whose metadata names it"),
                        ("lora_checkpoint", "whose metadata names it")):
    if getattr(request, source) and request.model is not None:
      raise ValueError(f"give --model or --{source} ({names}), not both")
  overrides = parse_overrides(request.overrides)
  if request.lora_checkpoint:
    return saved_model_config(open_checkpoint(request.lora_checkpoint).meta["model_config"], overrides,
                              f"--lora_checkpoint {request.lora_checkpoint}")
  if request.hf_dir:
    return HFWeights(request.hf_dir, **overrides).cfg  # reads config.json and the files' headers, no tensor
  if request.checkpoint:
    return saved_model_config(read_checkpoint(request.checkpoint)[0]["model_config"], overrides,
                              f"--checkpoint {request.checkpoint}")
  return get_config(request.model or DEFAULT_MODEL, overrides)


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


def check_layers_and_tokens(request: GenerateConfig, sampling: SamplingConfig, cfg: ModelConfig):
  """ValueError (one line) when --live_layers or --resident_layers count more layers than the model has, or a
  --stop_token is no token of its vocabulary (it would never stop a row)."""
  too_many = [f"--{name}={getattr(request, name)}" for name in ("live_layers", "resident_layers")
              if getattr(request, name) > cfg.num_layers]
  if too_many:
    raise ValueError(f"{' and '.join(too_many)}: more than the model's {cfg.num_layers} layers")
  outside = [token for token in sampling.stop_tokens if not 0 <= token < cfg.vocab_size]
  if outside:
    raise ValueError(f"--stop_token {', '.join(map(str, outside))}: outside the model's vocabulary "
                     f"0..{cfg.vocab_size - 1}")


class NonFiniteWeights(ValueError):
  """The weights hold a NaN or an infinity: every logit would be NaN, and greedy decoding token 0."""


class FiniteWeights:
  """A weights reader (outer(), layers(start, stop)) that checks each part as it is read: NonFiniteWeights, naming
  the array, on a NaN or an infinity, before any of it is placed."""

  def __init__(self, reader, source: str):
    self.reader, self.source = reader, source

  def _checked(self, tree, part: str):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      x = np.asarray(x)
      if jnp.issubdtype(x.dtype, jnp.floating) and not np.isfinite(x).all():  # bfloat16's kind is "V"
        raise NonFiniteWeights(f"{self.source} holds a non-finite weight ({x.flat[np.argmin(np.isfinite(x))]}) in "
                               f"{part}, {jax.tree_util.keystr(path)}: refusing to generate from it")
    return tree

  def outer(self):
    return self._checked(self.reader.outer(), "the embeddings and head")

  def layers(self, start: int, stop: int):
    return self._checked(self.reader.layers(start, stop),
                         f"layers {start}-{stop - 1}" if stop - start > 1 else f"layer {start}")


def read_prompts(path: str) -> list[str]:
  if not os.path.isfile(path):
    raise ValueError(f"--prompt_file {path} does not exist")
  with open(path, encoding="utf-8") as f:
    prompts = [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise ValueError(f"--prompt_file {path} has no prompts")
  return prompts


def make_plan(request: GenerateConfig, cfg: ModelConfig, prompt_len: int, new_tokens: int, prompts: int):
  """sljax.generate_plan.plan within the request's budgets, the layout it fixes applied."""
  target = MACHINES[request.target] if request.target else None
  device, host = memory_budgets(target)
  return plan(
      cfg, prompt_len, new_tokens, int(request.device_memory_gib * GIB) or device,
      int(request.host_memory_gib * GIB) or host, batch=request.batch or None, sub_batches=request.sub_batches or None,
      live_layers=request.live_layers, resident_layers=None if request.resident_layers < 0 else request.resident_layers,
      kv_on_host=request.kv_on_host, max_batch=prompts or 1024, streamed_bits=request.streamed_bits,
      resident_bits=request.resident_bits, target=target)


def open_weights(request: GenerateConfig, cfg: ModelConfig):
  """What OffloadedGenerator.load reads (None for --random_weights), checked before anything is allocated: the
  Hugging Face files' headers, the checkpoint's params read into host memory, or a LoRA run's adapters (read into
  host memory) and the headers of their base."""
  if request.random_weights:
    return None
  if request.lora_checkpoint:
    checkpoint = open_checkpoint(request.lora_checkpoint)
    # Merged in the run's param dtype (the group being read is all that is ever in host RAM), then cast by the load.
    base = base_weights(checkpoint, cfg, request.hf_dir)
    return FiniteWeights(MergedWeights(base, checkpoint.lora, read_adapters(checkpoint)),
                         f"--lora_checkpoint {request.lora_checkpoint}")
  if request.hf_dir:
    # Read in the compute dtype, one layer group at a time straight to its home (device or pinned host): a bf16
    # 70B model is 138 GB, more than the host RAM of many GPU machines.
    return FiniteWeights(HFWeights(request.hf_dir, **{**parse_overrides(request.overrides), "param_dtype": cfg.dtype}),
                         f"--hf_dir {request.hf_dir}")
  return FiniteWeights(params_reader(read_checkpoint(request.checkpoint, params=True)[1]),
                       f"--checkpoint {request.checkpoint}")


def prepare(request: GenerateConfig, sampling: SamplingConfig) -> Generation:
  """Checks the request and plans it; with --plan prints the plan. ValueError (one line) on anything wrong with it,
  before any weight is read onto a device."""
  cfg = model_config(request)
  check_layers_and_tokens(request, sampling, cfg)
  encode, decode, vocab_size = codec(request.tokenizer)
  if vocab_size > cfg.vocab_size:
    raise ValueError(f"tokenizer {request.tokenizer or 'bytes'} has {vocab_size} tokens, more than the model's "
                     f"vocab_size {cfg.vocab_size}")
  if not request.prompt_file and not (request.plan and request.prompt_len):
    raise ValueError("give --prompt_file (or, with --plan, --prompt_len)")
  texts = read_prompts(request.prompt_file) if request.prompt_file else []
  prompts = [encode(text) for text in texts]
  longest = max((len(p) for p in prompts), default=0)
  if request.prompt_len and longest > request.prompt_len:
    raise ValueError(f"a prompt has {longest} tokens, more than --prompt_len {request.prompt_len}")
  if 0 in map(len, prompts):
    raise ValueError("a prompt encodes to no tokens")
  prompt_len = request.prompt_len or longest
  chosen = make_plan(request, cfg, prompt_len, sampling.max_new_tokens, len(prompts))
  if request.plan:
    name = request.lora_checkpoint or request.hf_dir or request.checkpoint or request.model or DEFAULT_MODEL
    on = f"one {request.target} (--target)" if request.target else jax.devices()[0].device_kind
    print(f"plan for {name} on {on}:\n"
          f"{chosen.describe(cfg)}")
    return Generation(request, cfg, sampling, texts, prompts, prompt_len, decode, chosen, None)
  if not (request.hf_dir or request.checkpoint or request.random_weights or request.lora_checkpoint):
    raise ValueError("give the weights: --hf_dir, --checkpoint, --lora_checkpoint or --random_weights")
  return Generation(request, cfg, sampling, texts, prompts, prompt_len, decode, chosen, open_weights(request, cfg))


def generate(job: Generation) -> typing.Iterator[dict]:
  """{"prompt", "completion", "tokens": ids generated, the stop token included} of each prompt, in order, yielded as
  each batch of them is done."""
  peaks = MemoryPeaks() if job.request.memory_peaks else contextlib.nullcontext()
  if job.request.memory_peaks:
    print(f"plan:\n{job.plan.describe(job.model)}", file=sys.stderr, flush=True)
  with peaks:
    generator = OffloadedGenerator(build(job.model), job.plan.offload)
    weights = (generator.init(jax.random.key(job.sampling.seed)) if job.weights is None
               else generator.load(job.weights))
    batch_size, sampling = job.plan.batch, job.sampling
    batches = -(-len(job.prompts) // batch_size)
    for first in range(0, len(job.prompts), batch_size):
      batch = job.prompts[first:first + batch_size]
      filler = [batch[-1]] * (batch_size - len(batch))  # the last batch runs full size: same shapes, no recompile
      batch_sampling = dataclasses.replace(sampling, seed=sampling.seed + first)  # fresh draws for every batch
      result = generator.generate(weights, batch + filler, batch_sampling, prompt_len=job.prompt_len)
      seconds = result.prefill_seconds + result.decode_seconds
      print(f"batch {first // batch_size + 1} of {batches}: {batch_size} rows, prompt pass {result.prefill_seconds:.2f}"
            f" s{' (compiles)' if not first else ''}, {sampling.max_new_tokens - 1} decode passes "
            f"{result.decode_seconds:.2f} s: {batch_size * sampling.max_new_tokens / seconds:.1f} generated tok/s",
            file=sys.stderr, flush=True)
      for i in range(len(batch)):
        ids = [int(t) for t in result.tokens[i, :result.lengths[i]]]
        kept = ids[:-1] if ids and ids[-1] in sampling.stop_tokens else ids
        yield {"prompt": job.texts[first + i], "completion": job.decode(kept), "tokens": ids}
  if job.request.memory_peaks:
    print(peaks.line(), file=sys.stderr, flush=True)
