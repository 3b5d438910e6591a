import dataclasses
import typing

import pytest
from absl import flags

from sljax import flags as config_flags


@dataclasses.dataclass(frozen=True)
class Example:
  steps: int = 3  # optimizer steps
  rate: float = 0.5  # peak rate
  # where the run writes; "": nowhere
  workdir: str = ""
  profile: bool = False  # trace a few steps
  tokenizer: str | None = None  # a tokenizer file; None: bytes
  shape: typing.Literal["cosine", "linear"] = "cosine"  # decay after warmup
  stops: tuple[int, ...] = ()  # stop token ids
  seq_len: int = 128  # tokens per sequence

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"steps must be positive, got {self.steps}")


def defined(**kwargs) -> tuple[flags.FlagValues, config_flags.FieldFlags]:
  values = flags.FlagValues()
  return values, config_flags.define(Example, flag_values=values, **kwargs)


def test_every_field_becomes_a_flag_with_its_type_default_and_comment():
  values, made = defined()
  assert set(values) == {f.name for f in dataclasses.fields(Example)}
  values(["prog"])
  assert made.build() == Example()
  assert values["steps"].help == "Optimizer steps." and values["workdir"].help == 'Where the run writes; "": nowhere.'
  assert values["tokenizer"].default is None and values["shape"].parser.enum_values == ["cosine", "linear"]
  values(["prog", "--steps=7", "--rate=0.25", "--workdir=/tmp/x", "--profile", "--tokenizer=t.json", "--shape=linear",
          "--stops=2", "--stops=5"])
  assert made.build() == Example(7, 0.25, "/tmp/x", True, "t.json", "linear", (2, 5))
  assert made.build(steps=9).steps == 9


def test_unset_fields_default_to_none_and_are_left_out_until_given():
  values, made = defined(unset={"seq_len": "the recipe's"}, rename={"stops": "stop"}, skip=("rate",))
  assert "rate" not in values and "stop" in values
  assert values["seq_len"].help == "Tokens per sequence (default: the recipe's)."
  values(["prog"])
  assert "seq_len" not in made.given() and made.build(seq_len=64).seq_len == 64
  values(["prog", "--seq_len=256", "--stop=1"])
  assert made.given()["seq_len"] == 256 and made.build().stops == (1,)


def test_the_dataclass_checks_the_values():
  values, made = defined()
  values(["prog", "--steps=0"])
  with pytest.raises(ValueError, match="steps must be positive, got 0"):
    made.build()
  with pytest.raises(flags.IllegalFlagValueError):
    values(["prog", "--shape=exponential"])


def test_a_field_without_a_comment_is_refused_unless_given_help():
  @dataclasses.dataclass(frozen=True)
  class Undocumented:
    steps: int = 3

  with pytest.raises(ValueError, match="Undocumented.steps has no comment"):
    config_flags.define(Undocumented, flag_values=flags.FlagValues())
  values = flags.FlagValues()
  config_flags.define(Undocumented, help={"steps": "Optimizer steps"}, flag_values=values)
  assert values["steps"].help == "Optimizer steps."
