"""Eight CPU devices for mesh tests, one compilation cache, quick compiles; must run before jax is imported."""

import gc
import os
import shutil
import sys
import tempfile

# XLA:CPU's older fusion emitters compile a third faster than its MLIR ones (the test_engine fidelity tests: 91 ->
# 60 s), and one codegen thread per compile suits two test workers on two cores.
FAST_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_MADE_FOLDERS = []  # the session folders this process made (xdist's workers inherit the controller's): gone at its end


def session_folder(variable: str, prefix: str):
  """Sets `variable` to a new temporary folder for the session, unless it is set already."""
  if variable not in os.environ:
    os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
    _MADE_FOLDERS.append(os.environ[variable])


# One compilation cache for the session, its subprocesses included: the CLI tests build the same tiny steps again
# and again, each run jitting new closures of them.
session_folder("JAX_COMPILATION_CACHE_DIR", "sljax_test_jax_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The tests compile far more than they run: without LLVM's optimizations XLA:CPU compiles in about half the time
# (the suite takes a third less). The programs are the same HLO, only their machine code is slower. Subprocesses
# inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

from sljax.footprint import PEAK_CACHE_ENV  # noqa: E402

# One compiled-peak cache too: a train.py process that plans a tiny model planned before reads its compiled calls'
# peaks instead of lowering and compiling them again (2 s of its 8).
session_folder(PEAK_CACHE_ENV, "sljax_test_peak_cache_")

from hypothesis import settings  # noqa: E402

# CI draws the same random configs every run (reproducible); locally each run explores new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
  settings.load_profile("ci")

# The garbage collector ran 3.4 s of the test_engine fidelity tests' 40 s of CPU, walking the tests' many short-lived
# tracer objects and everything the imports made: at a gen-0 threshold of 20,000 allocations (not 700), with what
# collection imported frozen (pytest_collection_finish), 1.45 s. Tests that need an object freed call gc.collect().
gc.set_threshold(20_000, 50, 1_000)

# The shared test helpers are the module `helpers` (tests/helpers.py), whatever pytest's import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# The test files that take longest, longest first (their shares of the suite's time on 2 cores, 2026-12-05: 12% for
# test_engine.py down to 1% for test_package.py); the rest follow in their own order. `-n 2 --dist loadfile` hands a
# worker the next file as it nears the end of its own, so with the long files first the short ones even the two
# workers out at the end. xdist's own order, the most tests first, left one worker idle for 12-34 s at the end.
LONGEST_FIRST = ["test_engine.py", "test_lora.py", "test_plan.py", "test_checkpoint.py", "test_benchmarks.py",
                 "test_benchmarks_training.py", "test_train.py", "test_mesh.py", "test_resilience.py",
                 "test_generate.py", "test_library.py", "test_export.py", "test_lora_cli.py", "test_optim.py",
                 "test_models.py", "test_bad_inputs.py", "test_quant.py", "test_hf.py", "test_package.py"]


def pytest_configure(config):
  # The fast tier, `-m "not slow"`, keeps at least one test of each module's core behaviour (tests/test_suite.py).
  config.addinivalue_line("markers", "slow: end-to-end, CLI or subprocess tests that cost most of the suite's time; "
                                     "-m 'not slow' skips them")
  if hasattr(config.option, "loadscopereorder"):  # xdist's scheduler takes the files in collection order
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests in their order


def pytest_collection_finish(session):
  gc.freeze()  # the test modules and all they imported (jax, torch, transformers) live the whole session


def pytest_unconfigure(config):
  for folder in _MADE_FOLDERS:
    shutil.rmtree(folder, ignore_errors=True)
