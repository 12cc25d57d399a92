# Sourced by the other scripts: install what is missing into the Python they
# run ($PYTHON, default python3; PYTHON=/path/to/python bash scripts/test.sh),
# then build cgraph's extension in place for that Python.
# torch comes from PyPI (on the CPU machines, pip takes it from local disk);
# where torch is already importable (the GPU machine) nothing is installed for
# it.  DEPS_FOR=tests (test.sh) adds pytest and build, DEPS_FOR=gpu-tests
# (gpu.sh) pytest.
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
has "import torch" || need+=("torch==2.14.1")
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
# Optional: torch warns at import without numpy; nothing here uses it.  Where
# there is no network (the GPU machine), go on without it, quickly.
if ! has "import numpy"; then
  echo "installing into $PY: numpy"
  "$PY" -m pip install -q --retries 0 --timeout 10 numpy >/dev/null 2>&1 \
    || echo "numpy could not be installed (no network?): going on without it"
fi

mkdir -p build
echo "building cgraph's extension in place (about 2 minutes)..."
started=$SECONDS
"$PY" setup.py -q build_ext --inplace >build/inplace.log 2>&1 \
  || { cat build/inplace.log; echo "cgraph's build failed (log above, also in build/inplace.log)" >&2; exit 1; }
echo "built in $((SECONDS - started))s"
