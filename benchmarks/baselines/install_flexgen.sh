#!/usr/bin/env bash
# Install FlexGen offline, for the FlexGen generation baseline (benchmarks/baselines/flexgen_generate.py), on a machine
# with no network.
#
# Reads .flexdeps/ (git-ignored; carry it to the GPU machine): FlexGen 0.1.8's wheel from PyPI, pure Python, ~120 kB.
# Installed with --no-deps: of what it declares, torch, transformers, numpy, tqdm and attrs are in the GPU image, and
# pulp (16 MB) is imported only by FlexGen's offline policy search (experimental/cost_model.py), which the baseline
# does not use. The wheel is installed unchanged: the baseline patches FlexGen at run time (its docstring lists how).
# None of this belongs in the project's requirements.txt.
#
# Fill .flexdeps on a machine with PyPI access (it is not in git; a new checkout has none):
#   pip download --no-deps -d .flexdeps flexgen==0.1.8
#
# Usage (from the repo root):   bash benchmarks/baselines/install_flexgen.sh [extra pip args...]
#   PYTHON=...    interpreter to install into (default: python3; on the GPU machine /opt/torch/.venv/bin/python3)
#   FLEXDEPS=...  folder with the wheel (default: .flexdeps next to this repo's root)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
FLEXDEPS="${FLEXDEPS:-$root/.flexdeps}"

wheel=$(ls "$FLEXDEPS"/flexgen-0.1.8-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$wheel" ]]; then
  echo "install_flexgen: no flexgen-0.1.8-*.whl in $FLEXDEPS" >&2
  exit 2
fi

export PIP_CONFIG_FILE=/dev/null  # ignore any machine pip config (indexes, constraints): offline, from $FLEXDEPS only
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir "$@" "$wheel"

# Fail here, with the reason, rather than later inside the benchmark: what FlexGen imports must be there.
"$PYTHON" - <<'EOF'
import importlib.metadata as metadata
import attr, numpy, torch, tqdm, transformers  # noqa: F401  (FlexGen's imports)
import flexgen.flex_opt  # noqa: F401
print(f"install_flexgen: flexgen {metadata.version('flexgen')} (torch {torch.__version__}, transformers "
      f"{transformers.__version__}, numpy {numpy.__version__}, CUDA {torch.cuda.is_available()})")
EOF
