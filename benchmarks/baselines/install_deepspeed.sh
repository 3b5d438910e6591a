#!/usr/bin/env bash
# Install DeepSpeed offline, for the ZeRO-3 offload baseline (issue 7), on a machine with no network.
#
# Reads .dsdeps/ (git-ignored; carry it to the GPU machine): DeepSpeed's source distribution from PyPI plus the
# wheels of the dependencies the GPU image lacks (hjson, pydantic, pydantic-core cp312, annotated-types,
# typing-inspection, typing-extensions >= 4.16 where the image's is older; setuptools + wheel are there too but used
# only if the image lacks them). Everything else DeepSpeed needs (torch, numpy, ninja, msgpack, einops, psutil,
# py-cpuinfo, packaging, tqdm) is already in that image. None of this belongs in the project's requirements.txt.
#
# DS_BUILD_OPS=0: no op is compiled at install time; DeepSpeedCPUAdam builds itself on first use (a plain C++
# extension through torch.utils.cpp_extension + ninja + g++ -fopenmp; no nvcc), which needs Python.h.
#
# Fill .dsdeps on a machine with PyPI access (it is not in git; a new checkout has none):
#   pip download --no-deps --no-binary=:all: -d .dsdeps deepspeed==0.19.8
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .dsdeps \
#     hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing-extensions==4.16.0 setuptools wheel
#
# Usage (from the repo root):   bash benchmarks/baselines/install_deepspeed.sh [extra pip args...]
#   PYTHON=...    interpreter to install into (default: python3; on the GPU machine /opt/torch/.venv/bin/python3)
#   DSDEPS=...    folder with the sdist and wheels (default: .dsdeps next to this repo's root)
# Extra arguments go to pip, e.g. `--find-links /tmp/dsdeps311` to test on a Python 3.11 machine.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
DSDEPS="${DSDEPS:-$root/.dsdeps}"

sdist=$(ls "$DSDEPS"/deepspeed-*.tar.gz 2>/dev/null | head -n1 || true)
if [[ -z "$sdist" ]]; then
  echo "install_deepspeed: no deepspeed-*.tar.gz in $DSDEPS" >&2
  exit 2
fi
version=$(basename "$sdist" .tar.gz); version=${version#deepspeed-}

export DS_BUILD_OPS=0          # build no op ahead of time; CPU Adam is JIT-built on first use
export DS_SKIP_CUDA_CHECK=1    # don't fail the build on a CUDA/torch minor-version mismatch
export PIP_CONFIG_FILE=/dev/null  # ignore any machine pip config (indexes, constraints): offline, from $DSDEPS only
export PIP_DISABLE_PIP_VERSION_CHECK=1

t0=$(date +%s)
# --no-build-isolation builds the sdist with the interpreter's own setuptools; setuptools < 70.1 also needs `wheel`
# for bdist_wheel. Both are in the GPU image; bring them from $DSDEPS only where they are missing.
if ! "$PYTHON" -c "import setuptools, wheel" 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-cache-dir --find-links "$DSDEPS" "$@" setuptools wheel
fi
"$PYTHON" -m pip install -q --no-index --no-build-isolation --no-cache-dir \
  --find-links "$DSDEPS" "$@" \
  "deepspeed==$version"
t1=$(date +%s)

# Fail here, with the reason, rather than later inside the benchmark.
"$PYTHON" - <<EOF
import sysconfig, os, shutil
import deepspeed, pydantic, hjson, torch
inc = sysconfig.get_paths()["include"]
print(f"install_deepspeed: deepspeed {deepspeed.__version__} (pydantic {pydantic.__version__}, torch {torch.__version__})"
      f" installed in $((t1 - t0)) s from $DSDEPS")
print(f"install_deepspeed: for the CPU Adam JIT build: Python.h {'found' if os.path.exists(os.path.join(inc, 'Python.h')) else 'MISSING'}"
      f" in {inc}; ninja {shutil.which('ninja') or 'MISSING'}; c++ {shutil.which('c++') or 'MISSING'}")
EOF
