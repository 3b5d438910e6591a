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
