# Sourced by the other scripts: install what is missing into the Python they
# run ($PYTHON, default python3; PYTHON=/path/to/python bash scripts/test.sh),
# then build cgraph's extension in place for that Python.
# torch comes from PyPI (on the CPU machines, pip takes it from local disk),
# with numpy (torch warns "Failed to initialize NumPy" at import without it)
# and ninja (the build's compiles run in parallel with it); where torch is
# already importable (the GPU machine, no network) nothing is installed for
# it, and numpy and ninja are tried quickly.  DEPS_FOR=tests (test.sh) adds
# pytest and build, DEPS_FOR=gpu-tests (gpu.sh) pytest.
set -euo pipefail
PY=${PYTHON:-python3}
case "$PY" in
  /*) ;;
  */*) PY="$PWD/$PY" ;;  # relative to where the user stands: keep it valid after the cd
esac
command -v "$PY" >/dev/null || { echo "no Python at '$PY': set PYTHON=/path/to/python" >&2; exit 1; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "cgraph needs Python 3.11 or newer; $PY is older: set PYTHON=/path/to/python" >&2; exit 1; }
# -P: not from the checkout, whose build/ folder would pass for the build package.
has() { "$PY" -P -c "$1" 2>/dev/null; }
need=()
# ninja: torch's cpp_extension runs `ninja`, from Debian's ninja-build or pip's
# (setup.py finds the latter in its Python's bin folder).
has_ninja() { command -v ninja >/dev/null || has "import ninja"; }
has "import torch" || { need+=("torch==2.14.1"); has "import numpy" || need+=("numpy"); has_ninja || need+=("ninja"); }
# 77 reads pyproject.toml's license expression (PEP 639).
has "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
  || need+=("setuptools>=77")
case "${DEPS_FOR:-}" in
  tests) has "import pytest" || need+=("pytest")
         has "import build" || need+=("build") ;;  # tests/test_packaging.py builds the sdist
  gpu-tests) has "import pytest" || need+=("pytest") ;;  # gpu.sh leaves that test out
esac
if [ ${#need[@]} -gt 0 ]; then
  echo "installing into $PY: ${need[*]}"
  "$PY" -m pip install -q "${need[@]}"
fi
# Optional beside an installed torch: where there is no network (the GPU
# machine), go on without them, quickly, and say once what that means.
if ! has "import numpy"; then
  echo "installing into $PY: numpy"
  "$PY" -m pip install -q --retries 0 --timeout 10 numpy >/dev/null 2>&1 \
    || echo "numpy could not be installed (no network?): importing torch will warn" \
            "\"Failed to initialize NumPy: No module named 'numpy'\"; harmless here, as" \
            "neither cgraph nor its tests use numpy."
fi
if ! has_ninja; then
  echo "installing into $PY: ninja"
  "$PY" -m pip install -q --retries 0 --timeout 10 ninja >/dev/null 2>&1 \
    || echo "ninja could not be installed (no network?): the build compiles its C++ in one unit" \
            "instead of one a core (about 47 s instead of 40 on 2 cores)."
fi
# The frameworks cgraph's callbacks plug into (tests/test_trainers.py and the
# CPU tests of graph_layers skip without them), tried where pytest runs.
if [ "${DEPS_FOR:-}" = tests ] && ! has "import transformers, accelerate, lightning"; then
  echo "installing into $PY: transformers accelerate lightning"
  "$PY" -m pip install -q --retries 0 --timeout 20 "transformers>=5" "accelerate>=1" \
    "lightning>=2.4" >/dev/null 2>&1 \
    || echo "transformers, accelerate or lightning could not be installed (no network?):" \
            "their CPU tests skip."
fi

mkdir -p build
# Measured from clean (rm -rf build cgraph/*.so) on a 2-core machine: 37-41 s
# with ninja, 47 s without (setup.py's unity build; 207 s and 292 s before it).
echo "building cgraph's extension in place (about 40 seconds on 2 cores)..."
started=$SECONDS
"$PY" setup.py -q build_ext --inplace >build/inplace.log 2>&1 \
  || { cat build/inplace.log; echo "cgraph's build failed (log above, also in build/inplace.log)" >&2; exit 1; }
echo "built in $((SECONDS - started))s"
