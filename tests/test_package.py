"""sljax as an installable package, and the entry points it shares with the checkout: pyproject.toml's dependencies
are requirements.txt's runtime part; the wheel holds sljax/ and models/ and the console scripts, which run from
anywhere; every command line and benchmark sets XLA's process settings through one function,
sljax.machines.configure_process, so that generate.py and benchmarks.generate_throughput plan under the same limits."""

import ast
import glob
import json
import os
import runpy
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from sljax.machines import MEMORY_FRACTION_ENV, PINNED_POOL_ENV, XLA_MEMORY_FRACTION

from helpers import REPO

# The command lines in the package.
CLIS = ["sljax/cli/train.py", "sljax/cli/generate.py", "sljax/export.py"]


def read_pyproject() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def test_dependencies_are_the_runtime_part_of_requirements_txt():
  with open(os.path.join(REPO, "requirements.txt")) as f:
    lines = [line.strip() for line in f]
  tests = next(n for n, line in enumerate(lines) if line.startswith("# Tests"))
  runtime = [line for line in lines[:tests] if line and not line.startswith("#")]
  assert read_pyproject()["project"]["dependencies"] == runtime


def test_console_scripts_are_the_cli_modules_consoles():
  scripts = read_pyproject()["project"]["scripts"]
  assert scripts == {"sljax-train": "sljax.cli.train:console", "sljax-generate": "sljax.cli.generate:console",
                     "sljax-export": "sljax.export:console"}
  for target in scripts.values():
    module, function = target.split(":")
    tree = ast.parse(open(os.path.join(REPO, *module.split(".")) + ".py").read())
    assert function in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, target


def main_calls(path: str) -> set[str]:
  """The names of what main() calls in the file (`f(...)` and `x.f(...)` both as "f")."""
  tree = ast.parse(open(path).read(), path)
  main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
  return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
          for node in ast.walk(main) if isinstance(node, ast.Call)}


def is_script(path: str) -> bool:
  """Whether the file runs as a program (`if __name__ == "__main__":`)."""
  return any(isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
             for node in ast.parse(open(path).read(), path).body)


def imports_jax(path: str) -> bool:
  tree = ast.parse(open(path).read(), path)
  return any(alias.name.split(".")[0] == "jax" for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names)


def test_every_command_line_and_benchmark_sets_xla_through_configure_process():
  """Each command line, and each benchmark that runs jax in its own process (the others drive other processes or
  read files: an XLA setting there would reach their children first, and win), calls configure_process in main;
  none sets XLA's memory variables itself. benchmarks/baselines/ drive other systems."""
  benchmarks = [path for path in sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py"))) if is_script(path)]
  entries = [os.path.join(REPO, path) for path in CLIS] + [path for path in benchmarks if imports_jax(path)]
  assert len(entries) >= len(CLIS) + 5, entries  # the checks below see the benchmarks that run jax
  missing = [os.path.relpath(path, REPO) for path in entries if "configure_process" not in main_calls(path)]
  assert not missing, f"call sljax.machines.configure_process in main, before anything touches a device: {missing}"
  common = os.path.join(REPO, "benchmarks", "common.py")
  own = {os.path.relpath(path, REPO): writes for path in entries + benchmarks + [common]
         if (writes := xla_memory_writes(path))}
  assert not own, f"XLA's memory settings are sljax.machines.configure_process's: {own}"


def xla_memory_writes(path: str) -> list[str]:
  """What in the file sets XLA's memory variables other than through configure_process: os.environ written under a
  name of one, or a call of configure_process's parts."""
  variables = ("MEMORY_FRACTION_ENV", "PINNED_POOL_ENV", MEMORY_FRACTION_ENV, PINNED_POOL_ENV)
  parts = ("reserve_gpu_memory", "cap_pinned_pools")
  writes = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Call):
      function = ast.unparse(node.func)
      names_one = function in ("os.environ.setdefault", "os.environ.update") and any(
          name in ast.unparse(node) for name in variables)
      if names_one or function.split(".")[-1] in parts:
        writes.append(ast.unparse(node))
    elif isinstance(node, ast.Assign):
      targets = [ast.unparse(target) for target in node.targets]
      if any(target.startswith("os.environ[") and any(name in target for name in variables) for target in targets):
        writes.append(ast.unparse(node))
  return writes


# Each entry's main run up to its first device use (replaced by a stop that records XLA's settings then), once per
# flag list, in one fresh process; XLA's settings are unset before each.
XLA_ENV_AT_FIRST_DEVICE_USE = """
import importlib, json, os, sys
from absl import flags
from sljax import machines
module, first_device_use, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
entry = importlib.import_module(module)
def stop(*args, **kwargs):
  raise SystemExit(json.dumps(machines.xla_memory_env()))
setattr(entry, first_device_use, stop)
settings = []
for args in cases:
  for name in (machines.MEMORY_FRACTION_ENV, machines.PINNED_POOL_ENV):
    os.environ.pop(name, None)
  flags.FLAGS.unparse_flags()
  flags.FLAGS([module, *args])
  try:
    entry.main([module])
  except SystemExit as exit:
    settings.append(json.loads(str(exit)))
print(json.dumps(settings))
"""


def xla_env_at_first_device_use(module: str, first_device_use: str, cases: list[list[str]]) -> list[dict]:
  env = {name: value for name, value in os.environ.items() if name not in (MEMORY_FRACTION_ENV, PINNED_POOL_ENV)}
  script = [sys.executable, "-c", XLA_ENV_AT_FIRST_DEVICE_USE, module, first_device_use, json.dumps(cases)]
  done = subprocess.run(script, cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**env, "CUDA_VISIBLE_DEVICES": "0,1"})
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_generate_py_and_the_generation_benchmark_run_under_the_same_xla_settings():
  """The same flags, the same process settings, so the same plan: with the default host budget and with one given
  (on two GPUs: 40 GiB, 22 GiB of pinned pool each)."""
  cases = [[], ["--host_memory_gib=40"]]
  cli = xla_env_at_first_device_use("sljax.cli.generate", "run", cases)
  benchmark = xla_env_at_first_device_use("benchmarks.generate_throughput", "measure_bandwidth", cases)
  assert cli == benchmark, (cli, benchmark)
  assert all(env[MEMORY_FRACTION_ENV] == str(XLA_MEMORY_FRACTION) for env in cli)
  assert cli[1][PINNED_POOL_ENV] == "22" and cli[0][PINNED_POOL_ENV] != "22"


def test_the_scripts_import_their_cli_module_once():
  """`python train.py` runs sljax.cli.train, whose flags are defined on its first import only: a test that imports
  it and then runs the script defines nothing twice."""
  from sljax.cli import train

  assert runpy.run_path(os.path.join(REPO, "train.py"), run_name="not_main")["train"] is train


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
  """The wheel of `pip wheel .`, built from a copy of what it reads: setuptools writes build/ and sljax.egg-info/
  into the tree it builds, and a stale build/ of the checkout's would reach the wheel."""
  source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), source)
  for name in ("sljax", "models"):
    shutil.copytree(os.path.join(REPO, name), source / name, ignore=shutil.ignore_patterns("__pycache__"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                  str(source)], check=True, capture_output=True, timeout=120)
  (path,) = glob.glob(str(out / "sljax-*.whl"))
  return path


@pytest.mark.slow
def test_the_wheel_holds_the_packages_and_the_console_scripts(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
  assert tops == {"sljax", "models"}, tops  # not benchmarks, tests, examples, train.py
  assert {"sljax/__init__.py", "sljax/cli/train.py", "sljax/cli/generate.py", "sljax/lora/__init__.py",
          "models/presets.py"} <= set(names)
  (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
  text = zipfile.ZipFile(wheel).read(entry_points).decode()
  assert "sljax-train = sljax.cli.train:console" in text and "sljax-generate = sljax.cli.generate:console" in text
  assert "sljax-export = sljax.export:console" in text


@pytest.mark.slow
def test_the_installed_package_imports_and_its_console_script_parses_flags_from_elsewhere(wheel, tmp_path):
  target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
  elsewhere.mkdir()
  subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), wheel],
                 check=True, capture_output=True, timeout=120)
  env = {**os.environ, "PYTHONPATH": str(target)}  # the dependencies: this environment's
  run = lambda *args: subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
  imported = run(sys.executable, "-c", "import sljax, models.presets; print(sljax.__file__)")
  assert imported.returncode == 0 and imported.stdout.startswith(str(target)), imported.stderr
  helped = run(str(target / "bin" / "sljax-train"), "--help")  # absl exits 1 after --help
  assert helped.stdout.startswith("Trains a decoder-only LM") and "--lora_rank" in helped.stdout, helped
