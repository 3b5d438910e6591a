"""The house rules that code review would otherwise keep by hand."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["sljax", "models", "benchmarks", "train.py", "generate.py", "examples"]
PROJECT = {os.path.splitext(top)[0] for top in SOURCES}  # the top-level names the project's imports start with
# The peers' wrappers, which drive other systems (DeepSpeed, accelerate) by whatever those expose.
PEERS = os.path.join(REPO, "benchmarks", "baselines")


def python_files():
  for top in SOURCES:
    path = os.path.join(REPO, top)
    if path.endswith(".py"):
      yield path
      continue
    for folder, _, files in os.walk(path):
      if not folder.startswith(PEERS):
        yield from (os.path.join(folder, name) for name in sorted(files) if name.endswith(".py"))


def private_names(tree: ast.Module) -> set[str]:
  """Private members a module defines: its functions and classes, their methods, and attributes set on self."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
      names.add(node.name)
    elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
          and node.value.id == "self" and node.attr.startswith("_")):
      names.add(node.attr)
  return {name for name in names if not name.startswith("__")}


def private_imports(node: ast.ImportFrom) -> list[str]:
  """The private names `from module import _name` takes from a project module (relative imports are the project's)."""
  if not (node.level or node.module.split(".")[0] in PROJECT):
    return []
  return [alias.name for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


def test_no_module_reaches_into_another_modules_private_members():
  """Neither as an attribute (module._name, object._name) nor imported (from module import _name)."""
  trees = {path: ast.parse(open(path).read(), path) for path in python_files()}
  defined = {path: private_names(tree) for path, tree in trees.items()}
  reaches = []
  for path, tree in trees.items():
    elsewhere = set().union(*(names for other, names in defined.items() if other != path)) - defined[path]
    where = lambda node: f"{os.path.relpath(path, REPO)}:{node.lineno}"
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr in elsewhere
          and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
        reaches.append(f"{where(node)} .{node.attr}")
      elif isinstance(node, ast.ImportFrom):
        reaches += [f"{where(node)} from {node.module} import {name}" for name in private_imports(node)]
  assert not reaches, reaches
