"""The suite's own shape: shared helpers live in helpers.py, imported as `helpers`; no test file imports another."""

import ast
import glob
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
TEST_MODULES = {os.path.basename(path)[:-3] for path in glob.glob(os.path.join(TESTS, "*.py"))} - {"helpers"}


def imported_modules(path: str) -> set[str]:
  """Every module an `import x` or `from x import y` in the file names (relative imports as `.x`)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      names.add("." * node.level + (node.module or ""))
  return names


def test_no_test_file_imports_another_and_helpers_come_from_one_module():
  offending = {}
  for path in sorted(glob.glob(os.path.join(TESTS, "*.py"))):
    bad = {name for name in imported_modules(path)
           if name.startswith(".") or name.split(".")[0] == "tests" or name.split(".")[0] in TEST_MODULES}
    if bad:
      offending[os.path.basename(path)] = sorted(bad)
  assert not offending, f"import shared test code from helpers (tests/helpers.py) instead: {offending}"


def test_the_check_sees_each_way_of_importing_a_test_file(tmp_path):
  sources = ["from test_engine import make_batch", "import test_train", "from tests.test_engine import x",
             "from tests import helpers", "from . import conftest", "import tests.helpers"]
  for n, source in enumerate(sources):
    (tmp_path / f"case{n}.py").write_text(source + "\n")
    name = next(iter(imported_modules(str(tmp_path / f"case{n}.py"))))
    assert name.startswith(".") or name.split(".")[0] in TEST_MODULES | {"tests"}, source
  (tmp_path / "fine.py").write_text("import helpers\nfrom helpers import REPO\n")
  assert imported_modules(str(tmp_path / "fine.py")) == {"helpers"}


# The fast tier (-m "not slow") keeps at least these: each module's core behaviour, on one small config.
FAST_CORE = {
    "test_engine.py": "test_one_sub_batch_one_group_is_the_models_own_bf16_step_bit_for_bit",  # fidelity
    "test_plan.py": "test_live_device_bytes_after_every_dispatch_stay_within_the_plan",
    "test_generate.py": "test_sampling_and_stop_tokens_equal_the_on_device_loop",
    "test_lora.py": "test_plan_streams_what_the_device_cannot_hold_and_its_engine_runs",
    "test_checkpoint.py": "test_round_trip_keeps_values_dtypes_shardings_and_meta",
    "test_train.py": "test_a_run_shorter_than_the_warmup_trains",
    "test_library.py": "test_own_model_trains_as_plain_jax_grad_on_the_full_batch",
    "test_models.py": "test_causal",
    "test_export.py": "test_host_memory_holds_one_shard_and_the_outer_params_not_the_model",
}


def marked_slow(path: str) -> set[str]:
  """The test functions of the file marked slow as a whole (not those with only some parameters marked)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
          and any(ast.unparse(decorator) == "pytest.mark.slow" for decorator in node.decorator_list)}


def test_the_fast_tier_keeps_each_modules_core_tests():
  for name, test in FAST_CORE.items():
    path = os.path.join(TESTS, name)
    with open(path) as f:
      assert f"def {test}(" in f.read(), (name, test)
    assert test not in marked_slow(path), f"{name}::{test} is the fast tier's core test of its module"


def test_the_longest_first_order_names_test_files():
  """conftest.py's LONGEST_FIRST, the order xdist hands out the long files in: each a test file, once."""
  with open(os.path.join(TESTS, "conftest.py")) as f:
    tree = ast.parse(f.read())
  (longest,) = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and [ast.unparse(target) for target in node.targets] == ["LONGEST_FIRST"]]
  assert len(set(longest)) == len(longest) and {name[:-3] for name in longest} <= TEST_MODULES - {"conftest"}, longest
