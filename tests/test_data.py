"""sljax.data: packing, determinism, resumability, the TFDS path (real files, no TensorFlow) and config errors."""

import io
import json
import os
import sysconfig

import numpy as np
import pytest
import sentencepiece
import tensorflow_datasets as tfds
import tokenizers

from sljax import data

WORDS = "the layer weights stream from host memory into the device while sub batches wait their turn".split()
DOCUMENTS = [" ".join(np.random.default_rng(i).choice(WORDS, size=5 + 3 * i)) + "." for i in range(40)]


class SljaxTinyText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A few dozen short documents, prepared as array_record like any real text dataset."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(DOCUMENTS), "validation": self._generate_examples(DOCUMENTS[:4])}

  def _generate_examples(self, documents):
    for i, text in enumerate(documents):
      yield i, {"text": text}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
  path = str(tmp_path_factory.mktemp("tfds"))
  tfds.disable_progress_bar()
  SljaxTinyText(data_dir=path, file_format="array_record").download_and_prepare()
  return path


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(DOCUMENTS), model_writer=model, vocab_size=40, model_type="bpe", minloglevel=2)
  path = tmp_path_factory.mktemp("sp") / "tiny.model"
  path.write_bytes(model.getvalue())
  return str(path)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"])
  tokenizer.train_from_iterator(DOCUMENTS, trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tokenizer.save(str(path))
  return str(path)


@pytest.fixture(scope="module")
def stdlib_source() -> data.Source:
  return data.make_source(data.DataConfig(seq_len=64, batch_size=4), max_positions=64, vocab_size=256)


def tiny_config(data_dir, **overrides) -> data.DataConfig:
  return data.DataConfig(**{"name": "sljax_tiny_text", "data_dir": data_dir, "seq_len": 16, "batch_size": 3,
                            **overrides})


def stored_texts(data_dir: str) -> list[str]:
  """The train split's documents in the order TFDS stored them."""
  return [ex["text"].decode() for ex in tfds.data_source("sljax_tiny_text", split="train", data_dir=data_dir)]


def one_epoch(source: data.Source) -> np.ndarray:
  """The first num_windows windows served, [num_windows, S + 1]."""
  steps = -(-source.num_windows // source.cfg.batch_size)
  batches = [source.batch(step) for step in range(steps)]
  inputs = np.concatenate([b["inputs"] for b in batches])[:source.num_windows]
  targets = np.concatenate([b["targets"] for b in batches])[:source.num_windows]
  return np.concatenate([inputs, targets[:, -1:]], axis=1)


def assert_windows_cover(source: data.Source):
  """One epoch serves every window of the stream exactly once; together they cover it up to the last window."""
  seq_len, n = source.cfg.seq_len, source.num_windows
  expected = np.stack([source.tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)
  served = one_epoch(source)
  assert sorted(map(tuple, served)) == sorted(map(tuple, expected))
  assert n * seq_len + 1 <= len(source.tokens) < (n + 1) * seq_len + 1


def test_stdlib_batch_shapes_and_packing(stdlib_source):
  batch = stdlib_source.batch(0)
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      "inputs": ((4, 64), np.int32), "targets": ((4, 64), np.int32), "weights": ((4, 64), np.float32)}
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
  assert np.all(batch["weights"] == 1.0)
  assert stdlib_source.vocab_size == 256 and 0 <= batch["inputs"].min() and batch["inputs"].max() < 256


def test_stdlib_stream_is_sorted_source_files_joined(stdlib_source):
  root = sysconfig.get_paths()["stdlib"]
  names = sorted(f for f in os.listdir(root) if f.endswith(".py"))
  first, second = (open(os.path.join(root, name), "rb").read() for name in names[:2])
  assert bytes(stdlib_source.tokens[:len(first) + len(second) + 2]) == first + b"\0" + second + b"\0"
  assert len(stdlib_source.tokens) == data.DataConfig().max_tokens


def test_stdlib_windows_are_slices_of_the_stream(stdlib_source):
  seq_len, n = stdlib_source.cfg.seq_len, stdlib_source.num_windows
  aligned_NxS = stdlib_source.tokens[:n * seq_len].reshape(n, seq_len)
  for window in stdlib_source.batch(7)["inputs"]:
    assert (aligned_NxS == window).all(axis=1).any()


def test_same_config_same_batches_and_seeds_differ(stdlib_source):
  again = data.make_source(data.DataConfig(seq_len=64, batch_size=4), max_positions=64)
  other_seed = data.make_source(data.DataConfig(seq_len=64, batch_size=4, seed=1), max_positions=64)
  for step in (0, 1, 1000):
    np.testing.assert_array_equal(stdlib_source.batch(step)["inputs"], again.batch(step)["inputs"])
    assert not np.array_equal(stdlib_source.batch(step)["inputs"], other_seed.batch(step)["inputs"])


def test_resumed_source_serves_the_same_batches(data_dir):
  uninterrupted = data.make_source(tiny_config(data_dir), max_positions=16)
  history = [uninterrupted.batch(step)["inputs"] for step in range(40)]  # spans several epochs
  resumed = data.make_source(tiny_config(data_dir), max_positions=16)
  for step in (29, 3, 17):
    np.testing.assert_array_equal(resumed.batch(step)["inputs"], history[step])


def test_epochs_are_different_permutations(data_dir):
  source = data.make_source(tiny_config(data_dir, batch_size=1), max_positions=16)
  first = [tuple(source.batch(s)["inputs"][0]) for s in range(source.num_windows)]
  second = [tuple(source.batch(s)["inputs"][0]) for s in range(source.num_windows, 2 * source.num_windows)]
  assert sorted(first) == sorted(second) and first != second


def test_tfds_bytes_stream_is_the_stored_documents(data_dir):
  source = data.make_source(tiny_config(data_dir), max_positions=16, vocab_size=256)
  texts = stored_texts(data_dir)
  assert sorted(texts) == sorted(DOCUMENTS)
  assert bytes(source.tokens) == "".join(t + "\0" for t in texts).encode()
  assert_windows_cover(source)


def test_tfds_max_tokens_caps_the_stream(data_dir):
  source = data.make_source(tiny_config(data_dir, max_tokens=100), max_positions=16)
  assert bytes(source.tokens) == "".join(t + "\0" for t in stored_texts(data_dir)).encode()[:100]


def test_tfds_split_slice(data_dir):
  source = data.make_source(tiny_config(data_dir, split="validation[:2]"), max_positions=16)
  assert sorted(bytes(source.tokens).decode().split("\0")[:-1]) == sorted(
      ex["text"].decode() for ex in tfds.data_source("sljax_tiny_text", split="validation[:2]", data_dir=data_dir))


def test_tfds_with_sentencepiece(data_dir, sentencepiece_model):
  source = data.make_source(tiny_config(data_dir, tokenizer=sentencepiece_model), max_positions=16, vocab_size=64)
  model = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
  assert source.vocab_size == model.get_piece_size() == 40
  expected = np.concatenate([model.encode(t) + [model.eos_id()] for t in stored_texts(data_dir)])
  np.testing.assert_array_equal(source.tokens, expected)
  assert model.decode(source.batch(2)["inputs"][0].tolist())  # ids the model knows
  assert_windows_cover(source)


def test_tfds_with_tokenizer_json(data_dir, tokenizer_json):
  source = data.make_source(tiny_config(data_dir, tokenizer=tokenizer_json), max_positions=16, vocab_size=64)
  tokenizer = tokenizers.Tokenizer.from_file(tokenizer_json)
  end_of_text = tokenizer.token_to_id("<|endoftext|>")
  assert source.vocab_size == tokenizer.get_vocab_size() == 60
  expected = np.concatenate([tokenizer.encode(t).ids + [end_of_text] for t in stored_texts(data_dir)])
  np.testing.assert_array_equal(source.tokens, expected)
  assert tokenizer.decode(source.tokens[:20].tolist()).split()[:3] == stored_texts(data_dir)[0].split()[:3]
  assert_windows_cover(source)


def test_stdlib_with_tokenizer(tokenizer_json):
  source = data.make_source(data.DataConfig(tokenizer=tokenizer_json, max_tokens=5000), max_positions=128)
  assert len(source.tokens) == 5000 and source.tokens.max() < 60


def test_errors(data_dir, sentencepiece_model, tmp_path):
  def error(cfg: data.DataConfig, max_positions: int = 128, vocab_size: int | None = None) -> str:
    with pytest.raises(ValueError) as info:
      data.make_source(cfg, max_positions, vocab_size)
    return str(info.value)

  assert "max_positions 64" in error(data.DataConfig(seq_len=128), max_positions=64)
  assert "does not exist" in error(data.DataConfig(tokenizer=str(tmp_path / "missing.model")))
  (tmp_path / "vocab.txt").write_text("a\nb\n")
  assert "unknown file type" in error(data.DataConfig(tokenizer=str(tmp_path / "vocab.txt")))
  assert "more than the model's vocab_size 32" in error(data.DataConfig(tokenizer=sentencepiece_model), vocab_size=32)
  assert "more than the model's vocab_size 128" in error(data.DataConfig(), vocab_size=128)
  message = error(data.DataConfig(name="c4/en", data_dir=str(tmp_path)))
  assert "'c4/en' is not prepared in " + str(tmp_path) in message and "tfds build c4/en" in message
  assert "Unknown split 'test'" in error(tiny_config(data_dir, split="test"))
  assert "no feature 'content'" in error(tiny_config(data_dir, text_key="content"))
  assert "no window" in error(tiny_config(data_dir, max_tokens=10))
  with pytest.raises(ValueError, match="seq_len must be positive"):
    data.DataConfig(seq_len=0)


GARBAGE_TOKENIZERS = {  # (file name, content, what the message says it is not)
    "json-cut-short": ("tokenizer.json", b'{"model": {"type": "BPE", "vocab": ', "a Hugging Face tokenizer.json"),
    "json-without-model": ("tokenizer.json", b'{"version": "1.0", "added_tokens": []}', "a Hugging Face tokenizer.json"),
    "model-random-bytes": ("tokenizer.model", np.random.default_rng(0).bytes(1000), "a sentencepiece model"),
    "model-empty": ("tokenizer.model", b"", "a sentencepiece model"),
}


@pytest.mark.parametrize("case", GARBAGE_TOKENIZERS)
def test_a_garbage_tokenizer_file_is_refused_naming_it(tmp_path, case):
  name, content, kind = GARBAGE_TOKENIZERS[case]
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(ValueError) as info:
    data.load_tokenizer(str(path))
  assert str(info.value).startswith(f"tokenizer {path} cannot be read (not {kind}: ")
  assert "\n" not in str(info.value)


def test_tfrecord_dataset_is_refused(data_dir, tmp_path):
  # Writing tfrecord needs TensorFlow; relabel a copy of the array_record dataset instead.
  copy = tmp_path / "sljax_tiny_text" / "1.0.0"
  copy.mkdir(parents=True)
  for name in os.listdir(os.path.join(data_dir, "sljax_tiny_text", "1.0.0")):
    (copy / name).write_bytes(open(os.path.join(data_dir, "sljax_tiny_text", "1.0.0", name), "rb").read())
  info = json.loads((copy / "dataset_info.json").read_text())
  info["fileFormat"] = "tfrecord"
  (copy / "dataset_info.json").write_text(json.dumps(info))
  with pytest.raises(ValueError, match="stored as tfrecord; random access needs array_record"):
    data.make_source(tiny_config(str(tmp_path)), max_positions=16)


# ---- held-out text (train.py --eval_every) -----------------------------------------------------------------------

BYTES = data.load_tokenizer(None)


def test_stdlib_held_out_slice_is_the_whole_documents_after_the_training_stream():
  """The training stream is what it was without a held-out slice (pack's first max_tokens); the held-out stream
  starts at the first document after the one the training stream ends in, so no training window reads any of it."""
  cfg = data.DataConfig(seq_len=64, batch_size=4, max_tokens=5000, eval_tokens=3000)
  source = data.make_source(cfg, max_positions=64, held_out=True)
  np.testing.assert_array_equal(source.tokens, data.pack(data.stdlib_documents(), BYTES, 5000))
  stream, starts = b"", []
  for document in data.stdlib_documents():
    starts.append(len(stream))
    stream += document + b"\0"
    if len(stream) > 5000 + 3000 + 1000:
      break
  first = min(start for start in starts if start >= 5000)
  assert bytes(source.held_out) == stream[first:first + 3000]
  assert bytes(source.held_out[:100]) not in bytes(source.tokens)  # its documents are not trained on
  assert bytes(source.tokens) == stream[:5000]


def test_a_corpus_too_short_for_both_gives_up_its_last_documents():
  documents = [bytes([65 + i]) * 10 for i in range(5)]  # 5 documents of 11 tokens with their separators
  stream = b"".join(d + b"\0" for d in documents)
  train, held = data.hold_out(documents, BYTES, max_tokens=20, held_out=15)  # enough after: 22..54
  assert bytes(train) == stream[:20] and bytes(held) == stream[22:37]
  train, held = data.hold_out(documents, BYTES, max_tokens=100, held_out=20)  # the last 2 documents leave 22
  assert bytes(train) == stream[:33] and bytes(held) == stream[33:53]


def test_eval_batches_are_fixed_consecutive_windows_of_the_held_out_stream():
  cfg = data.DataConfig(seq_len=16, batch_size=3, max_tokens=5000, eval_tokens=1000)
  source = data.make_source(cfg, max_positions=16, held_out=True)
  batches = source.eval_batches(2)
  assert [b["inputs"].shape for b in batches] == [(3, 16)] * 2 and all(b["weights"].all() for b in batches)
  windows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1) for b in batches])
  np.testing.assert_array_equal(windows, [source.held_out[j * 16: j * 16 + 17] for j in range(6)])
  again = source.with_config(cfg).eval_batches(2)  # a later evaluation, and one after the plan set the batch
  for a, b in zip(batches, again):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  wider = source.with_config(data.DataConfig(seq_len=16, batch_size=6, max_tokens=5000, eval_tokens=1000))
  np.testing.assert_array_equal(wider.eval_batches(1)[0]["inputs"], windows[:, :-1])
  with pytest.raises(ValueError, match=r"^--eval_batches=21 of 3 x 16 tokens need 1009 tokens of held-out text; "
                                       r"stdlib's held-out slice has 1000 \(--eval_tokens=1000\)"):
    source.eval_batches(21)


def test_tfds_held_out_text_is_the_eval_split(data_dir):
  source = data.make_source(tiny_config(data_dir), max_positions=16, held_out=True)
  assert bytes(source.held_out).decode().split("\0")[:-1] == [
      ex["text"].decode() for ex in tfds.data_source("sljax_tiny_text", split="validation", data_dir=data_dir)]
  assert sorted(bytes(source.tokens).decode().split("\0")[:-1]) == sorted(DOCUMENTS)  # training: the train split
  assert source.eval_batches(1)[0]["inputs"].shape == (3, 16)
  with pytest.raises(ValueError, match="no held-out text was read"):
    data.make_source(tiny_config(data_dir), max_positions=16).eval_batches(1)
  with pytest.raises(ValueError, match=r"bad --eval_split 'test': .*--split=train\[:99%\] --eval_split=train\[99%:\]"):
    data.make_source(tiny_config(data_dir, eval_split="test"), max_positions=16, held_out=True)
  sliced = data.make_source(tiny_config(data_dir, split="train[:90%]", eval_split="train[90%:]"), max_positions=16,
                            held_out=True)
  assert not set(bytes(sliced.held_out).split(b"\0")[:-1]) & set(bytes(sliced.tokens).split(b"\0")[:-1])
