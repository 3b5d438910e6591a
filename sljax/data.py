"""Training batches: documents -> tokens -> one packed stream -> fixed-length windows in a seeded, resumable order.

Two corpora: the Python standard library's own source (embedded, byte-level, nothing to download) and any text
dataset prepared by TFDS in array_record format, read through `tfds` random access without TensorFlow.

Held-out text (`Source.eval_batches`, for train.py --eval_every): the embedded corpus keeps a slice of whole documents
that no training window reaches (`hold_out`); a TFDS dataset gives its eval_split.
"""

import dataclasses
import functools
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import numpy as np

STDLIB = "stdlib"
BYTE_VOCAB = 256
BYTE_SEPARATOR = 0  # NUL ends each document in byte-level streams; text practically never contains it
END_OF_TEXT = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")  # tokenizer.json names of the separator
DOCS_PER_CHUNK = 256  # documents read and tokenized together


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the text comes from, how it becomes tokens, and the batch shape."""

  name: str = STDLIB  # corpus: "stdlib" (embedded) or a TFDS name: "c4/en", "openwebtext", "wikipedia/20230601.en"
  data_dir: str | None = None  # TFDS data_dir (None: TFDS's default, ~/tensorflow_datasets or $TFDS_DATA_DIR)
  tokenizer: str | None = None  # a sentencepiece .model or a Hugging Face tokenizer.json; None: bytes, vocab 256
  split: str = "train"  # TFDS split, slices allowed ("train[:1%]")
  text_key: str = "text"  # TFDS feature holding the document text
  seq_len: int = 128  # tokens per sequence
  batch_size: int = 8  # sequences per step
  seed: int = 0  # picks the window order of every epoch (the trainer seeds the model's initialization with it too)
  max_tokens: int = 2**24  # tokens read and kept in memory: documents are read in order until the stream is this long
  eval_split: str = "validation"  # TFDS split that --eval_every evaluates on, slices allowed ("train[99%:]")
  # tokens of held-out text (--eval_every): stdlib keeps this many, of the whole documents after the training stream
  # (the corpus's last documents when it has fewer), that no training window reaches; TFDS reads the first this
  # many of eval_split
  eval_tokens: int = 2**20

  def __post_init__(self):
    for field in ("seq_len", "batch_size", "max_tokens", "eval_tokens"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be positive, got {getattr(self, field)}")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """Text bytes to token ids, with the id that ends each document (None: documents just abut)."""

  vocab_size: int
  separator: int | None
  encode: Callable[[list[bytes]], list[np.ndarray]]


def load_tokenizer(path: str | None) -> Tokenizer:
  """Bytes for None, sentencepiece for *.model, Hugging Face `tokenizers` for *.json."""
  if path is None:
    return Tokenizer(BYTE_VOCAB, BYTE_SEPARATOR, lambda docs: [np.frombuffer(doc, np.uint8) for doc in docs])
  if not os.path.isfile(path):
    raise ValueError(f"tokenizer file {path!r} does not exist")
  texts = lambda docs: [doc.decode("utf-8", errors="replace") for doc in docs]
  if path.endswith(".model"):
    import sentencepiece  # imported here, like tokenizers and tfds below: the default corpus needs none of them

    read = lambda: sentencepiece.SentencePieceProcessor(model_file=path)
    model = _read_tokenizer(path, "a sentencepiece model", read)
    encode = lambda docs: [np.asarray(ids) for ids in model.encode(texts(docs), num_threads=os.cpu_count())]
    return Tokenizer(model.get_piece_size(), model.eos_id() if model.eos_id() >= 0 else None, encode)
  if path.endswith(".json"):
    import tokenizers

    model = _read_tokenizer(path, "a Hugging Face tokenizer.json", lambda: tokenizers.Tokenizer.from_file(path))
    specials = {t.content: i for i, t in model.get_added_tokens_decoder().items() if t.special}
    separator = next((specials[name] for name in END_OF_TEXT if name in specials), None)
    encode = lambda docs: [np.asarray(e.ids) for e in model.encode_batch_fast(texts(docs), add_special_tokens=False)]
    return Tokenizer(model.get_vocab_size(with_added_tokens=True), separator, encode)
  raise ValueError(f"tokenizer {path!r}: unknown file type; expected a sentencepiece .model or a tokenizer.json")


def _read_tokenizer(path: str, kind: str, read: Callable):
  """read(), or ValueError naming the file: both libraries raise bare exceptions for a file they cannot parse."""
  try:
    return read()
  except Exception as error:
    reason = " ".join(str(error).split())  # one line
    raise ValueError(f"tokenizer {path} cannot be read (not {kind}: {reason})") from None


class Source:
  """Windows of seq_len + 1 tokens over one packed stream; batch(step) depends only on the config and step.

  Window i is tokens[i * seq_len : i * seq_len + seq_len + 1], so consecutive windows share one token and every
  adjacent pair in the stream is trained on once per epoch. Each epoch visits all windows in a permutation seeded
  by (seed, epoch); a batch may straddle two epochs. `held_out`: a stream no window reads, for `eval_batches`.
  """

  def __init__(self, tokens: np.ndarray, vocab_size: int, cfg: DataConfig, held_out: np.ndarray | None = None):
    self.tokens, self.held_out = tokens, held_out
    self.cfg = cfg
    self._vocab_size = vocab_size
    if self.num_windows < 1:
      raise ValueError(f"{cfg.name}: {len(tokens)} tokens make no window of seq_len + 1 = {cfg.seq_len + 1}")
    self._order = functools.lru_cache(maxsize=2)(self._permutation)

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def num_windows(self) -> int:
    return (len(self.tokens) - 1) // self.cfg.seq_len

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.cfg.seed, epoch]).permutation(self.num_windows)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """inputs, targets: int32[B, S] (targets = inputs shifted by one); weights: float32[B, S] of ones."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    seq_len, batch_size = self.cfg.seq_len, self.cfg.batch_size
    epoch_B, position_B = np.divmod(step * batch_size + np.arange(batch_size), self.num_windows)
    window_B = np.array([self._order(int(e))[p] for e, p in zip(epoch_B, position_B)])
    window_BxT = self.tokens[window_B[:, None] * seq_len + np.arange(seq_len + 1)].astype(np.int32)  # T = S + 1
    return _batch(window_BxT)

  def with_config(self, cfg: DataConfig) -> "Source":
    """The same streams, batched by `cfg` (another batch size, say), with no corpus read again."""
    return Source(self.tokens, self._vocab_size, cfg, self.held_out)

  def eval_batches(self, count: int) -> list[dict[str, np.ndarray]]:
    """The first `count` batches of the held-out stream, as `batch` shapes them: batch k holds its windows
    k B .. k B + B - 1 in stream order (window j: held_out[j S : j S + S + 1]), the same every call. ValueError when
    there is no held-out stream or it is too short."""
    seq_len, batch_size = self.cfg.seq_len, self.cfg.batch_size
    if self.held_out is None:
      raise ValueError(f"{self.cfg.name}: no held-out text was read (make_source(..., held_out=True))")
    needed = count * batch_size * seq_len + 1
    if len(self.held_out) < needed:
      where = "held-out slice" if self.cfg.name == STDLIB else f"split {self.cfg.eval_split!r}"
      raise ValueError(f"--eval_batches={count} of {batch_size} x {seq_len} tokens need {needed} tokens of held-out "
                       f"text; {self.cfg.name}'s {where} has {len(self.held_out)} (--eval_tokens={self.cfg.eval_tokens}"
                       f"): fewer --eval_batches, or more --eval_tokens")
    window_NxT = self.held_out[np.arange(count * batch_size)[:, None] * seq_len + np.arange(seq_len + 1)]
    return [_batch(window_BxT.astype(np.int32)) for window_BxT in np.split(window_NxT, count)]


def _batch(window_BxT: np.ndarray) -> dict[str, np.ndarray]:
  return {"inputs": window_BxT[:, :-1], "targets": window_BxT[:, 1:],
          "weights": np.ones(window_BxT[:, 1:].shape, np.float32)}


def make_source(cfg: DataConfig, max_positions: int, vocab_size: int | None = None, held_out: bool = False
                ) -> Source:
  """Checks cfg against the model (max_positions, vocab_size; None skips the vocab check), then reads the corpus.
  held_out: keep held-out text for `Source.eval_batches` (TFDS: cfg.eval_split is read too; the embedded corpus's
  held-out slice is set aside either way, so its training windows are the same with or without it)."""
  if cfg.seq_len > max_positions:
    raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_positions {max_positions}")
  tokenizer = load_tokenizer(cfg.tokenizer)
  if vocab_size is not None and tokenizer.vocab_size > vocab_size:
    raise ValueError(f"tokenizer {cfg.tokenizer or 'bytes'} has {tokenizer.vocab_size} tokens, "
                     f"more than the model's vocab_size {vocab_size}")
  if cfg.name == STDLIB:
    tokens, held = hold_out(stdlib_documents(), tokenizer, cfg.max_tokens, cfg.eval_tokens)
    return Source(tokens, tokenizer.vocab_size, cfg, held if held_out else None)
  data_source = open_tfds(cfg)
  held = pack(tfds_documents(open_tfds(cfg, cfg.eval_split, "--eval_split"), cfg.text_key), tokenizer,
              cfg.eval_tokens) if held_out else None
  return Source(pack(tfds_documents(data_source, cfg.text_key), tokenizer, cfg.max_tokens), tokenizer.vocab_size,
                cfg, held)


def pack(documents: Iterable[bytes], tokenizer: Tokenizer, max_tokens: int) -> np.ndarray:
  """Tokenizes documents chunk by chunk, each followed by the separator, into one stream of at most max_tokens."""
  pieces, length, tokenized = [], 0, _tokenized(documents, tokenizer)
  while length < max_tokens and (piece := next(tokenized, None)) is not None:
    pieces.append(piece)
    length += len(piece)
  return _joined(pieces, tokenizer)[:max_tokens]


def hold_out(documents: Iterable[bytes], tokenizer: Tokenizer, max_tokens: int, held_out: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """(training stream, held-out stream) of one corpus, sharing no document. The training stream is `pack`'s, the
  first max_tokens tokens; the held-out stream the first held_out tokens of the whole documents after the one that
  stream ends in. A corpus too short for both gives up its last documents instead: the held-out stream starts at
  the last document start that leaves it held_out tokens, and the training stream is what comes before."""
  pieces, starts, length, tokenized = [], [], 0, _tokenized(documents, tokenizer)
  first = None  # where the first document after the training stream starts
  while (first is None or length - first < held_out) and (piece := next(tokenized, None)) is not None:
    if first is None and length >= max_tokens:
      first = length
    starts.append(length)
    pieces.append(piece)
    length += len(piece)
  stream = _joined(pieces, tokenizer)
  if first is not None and length - first >= held_out:
    return stream[:max_tokens], stream[first:first + held_out]
  starts = np.array(starts, np.int64)
  leaving_enough = starts[length - starts >= held_out]
  cut = int(leaving_enough[-1]) if len(leaving_enough) else (int(starts[-1]) if len(starts) else 0)
  return stream[:min(cut, max_tokens)], stream[cut:cut + held_out]


def _tokenized(documents: Iterable[bytes], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
  """Each document's ids followed by the separator, tokenized DOCS_PER_CHUNK documents at a time; read lazily."""
  dtype = np.min_scalar_type(tokenizer.vocab_size - 1)
  separator = np.array([] if tokenizer.separator is None else [tokenizer.separator], dtype)
  documents = iter(documents)
  while chunk := list(islice(documents, DOCS_PER_CHUNK)):
    for ids in tokenizer.encode(chunk):
      yield np.concatenate([ids.astype(dtype), separator])


def _joined(pieces: list[np.ndarray], tokenizer: Tokenizer) -> np.ndarray:
  return np.concatenate(pieces) if pieces else np.zeros(0, np.min_scalar_type(tokenizer.vocab_size - 1))


def stdlib_documents() -> Iterator[bytes]:
  """The standard library's .py files (third-party packages excluded), sorted by path; read lazily."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for directory, subdirectories, files in os.walk(root):
    subdirectories[:] = [d for d in subdirectories if d not in ("site-packages", "dist-packages")]
    paths += [os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py")]
  for path in sorted(paths):
    with open(os.path.join(root, path), "rb") as f:
      yield f.read()


def tfds_documents(data_source, text_key: str) -> Iterator[bytes]:
  """The text of each example of a TFDS data source, in stored order, read a chunk at a time; read lazily."""
  for start in range(0, len(data_source), DOCS_PER_CHUNK):
    for example in data_source.__getitems__(list(range(start, min(start + DOCS_PER_CHUNK, len(data_source))))):
      text = example[text_key]
      yield text if isinstance(text, bytes) else text.encode("utf-8")


def open_tfds(cfg: DataConfig, split: str | None = None, flag: str = "--split"):
  """The random-access data source (array_record, no TensorFlow) of `split` (None: cfg.split, given by `flag`),
  after checking the dataset is ready."""
  split = cfg.split if split is None else split
  import tensorflow_datasets as tfds
  from tensorflow_datasets.core import constants, read_only_builder, registered

  where = cfg.data_dir or constants.DATA_DIR
  try:
    builder = read_only_builder.builder_from_files(cfg.name, data_dir=cfg.data_dir)
  except registered.DatasetNotFoundError:
    raise ValueError(f"TFDS dataset {cfg.name!r} is not prepared in {where}; prepare it with "
                     f"`tfds build {cfg.name} --data_dir={where} --file_format=array_record`") from None
  if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
    raise ValueError(f"TFDS dataset {cfg.name!r} in {where} is stored as {builder.info.file_format.value}; random "
                     f"access needs array_record: rebuild with `tfds build {cfg.name} --file_format=array_record`")
  if cfg.text_key not in builder.info.features:
    raise ValueError(f"TFDS dataset {cfg.name!r} has no feature {cfg.text_key!r}; "
                     f"it has {list(builder.info.features)}")
  try:
    builder.info.splits[split]
  except (KeyError, ValueError) as e:
    hint = (f"; hold out part of the training split instead, e.g. --split=train[:99%] --eval_split=train[99%:]"
            if flag == "--eval_split" else "")
    raise ValueError(f"TFDS dataset {cfg.name!r}: bad {flag} {split!r}: {e}{hint}") from None
  return builder.as_data_source(split=split)
