"""absl flags made from a frozen config dataclass: one flag per field, named after it, its type from the annotation,
its default the field's, its help the field's comment; and the dataclass built back from the parsed flags.

  RUN = sljax.flags.define(RunConfig)
  OPTIM = sljax.flags.define(OptimConfig, unset={name: "the recipe's" for name in ...})
  ...
  run_cfg = RUN.build()          # after absl parsed the command line
  optim_fields = OPTIM.given()   # only the `unset` fields whose flag was given, with every other field

A field documents itself with a comment on its line (or on the lines just above it); adding a field adds its flag.
"""

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Mapping

from absl import flags

flags.disclaim_key_flags()  # the flags defined here belong to define's caller: train.py --help lists them

_DEFINE = {int: flags.DEFINE_integer, float: flags.DEFINE_float, str: flags.DEFINE_string, bool: flags.DEFINE_bool}
_DEFINE_MULTI = {int: flags.DEFINE_multi_integer, str: flags.DEFINE_multi_string}


@dataclasses.dataclass(frozen=True)
class FieldFlags:
  """The flags `define` made for one dataclass."""

  cls: type
  names: Mapping[str, str]  # field -> flag name
  unset: frozenset[str]  # fields whose flag defaults to None: not given, the field's value comes from elsewhere
  flag_values: flags.FlagValues

  def given(self) -> dict:
    """{field: parsed value} of every flag, less the `unset` fields whose flag was not given."""
    values = {field: self.flag_values[name].value for field, name in self.names.items()}
    values = {field: tuple(v) if isinstance(v, list) else v for field, v in values.items()}
    return {field: v for field, v in values.items() if not (field in self.unset and v is None)}

  def build(self, **fields):
    """The dataclass from the parsed flags, `fields` replacing theirs; ValueError from its checks."""
    return self.cls(**{**self.given(), **fields})


def define(cls, *, rename: Mapping[str, str] = {}, skip: tuple[str, ...] = (), unset: Mapping[str, str] = {},
           help: Mapping[str, str] = {}, flag_values: flags.FlagValues = flags.FLAGS) -> FieldFlags:
  """Defines a flag for each field of the dataclass `cls` but `skip`'s.

  rename: {field: flag name} where they differ. unset: {field: what leaving its flag out means}, for a field whose
  value, when the flag is absent, is not the dataclass's default (a recipe's, another flag's): its flag defaults to
  None and its help ends "(default: <meaning>)". help: {field: text} in place of its comment. Types: int, float, str,
  bool, X | None, tuple[X, ...] (a repeatable flag) and Literal[...] (an enum of strings).
  """
  hints = typing.get_type_hints(cls)
  comments = field_comments(cls)
  names = {}
  for field in dataclasses.fields(cls):
    if field.name in skip:
      continue
    name = rename.get(field.name, field.name)
    text = _sentence(help.get(field.name) or comments.get(field.name, ""))
    if not text:
      raise ValueError(f"{cls.__name__}.{field.name} has no comment to make its --{name} help from: write one")
    default = None if field.name in unset else _default(field)
    if field.name in unset:
      text = f"{text[:-1]} (default: {unset[field.name]})."
    _define_one(hints[field.name], name, default, text, flag_values)
    names[field.name] = name
  return FieldFlags(cls, names, frozenset(unset), flag_values)


def _default(field: dataclasses.Field):
  if field.default is not dataclasses.MISSING:
    return list(field.default) if isinstance(field.default, tuple) else field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return None


def _define_one(kind, name: str, default, text: str, flag_values: flags.FlagValues):
  args = typing.get_args(kind)
  if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
    (kind,) = [arg for arg in args if arg is not type(None)]  # X | None: X's flag, None a possible default
    args = typing.get_args(kind)
  if typing.get_origin(kind) is typing.Literal:
    flags.DEFINE_enum(name, default, list(args), text, flag_values=flag_values)
  elif typing.get_origin(kind) is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _DEFINE_MULTI:
    _DEFINE_MULTI[args[0]](name, default if default is not None else [], text, flag_values=flag_values)
  elif kind in _DEFINE:
    _DEFINE[kind](name, default, text, flag_values=flag_values)
  else:
    raise TypeError(f"--{name}: no flag type for a field of type {kind}")


def field_comments(cls) -> dict[str, str]:
  """{field: its comment}: the comment at the end of the field's lines, else the comment lines just above it."""
  source = textwrap.dedent(inspect.getsource(cls))
  comments = {token.start[0]: token.string[1:].strip()
              for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
  lines = source.splitlines()
  found = {}
  for node in ast.parse(source).body[0].body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    above, n = [], node.lineno - 1
    while n in comments and lines[n - 1].lstrip().startswith("#"):
      above.insert(0, comments[n])
      n -= 1
    found[node.target.id] = " ".join(trailing or above)
  return found


def _sentence(text: str) -> str:
  if not text:
    return ""
  return text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")
