# Sourced by the other scripts: install what is missing, then build in place.
# torch comes from PyPI (on the CPU machines, pip takes it from local disk);
# where torch is already importable (the GPU machine) nothing is installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
need=()
$PY -c "import torch" 2>/dev/null || need+=("torch==2.14.1")
$PY -c "import pytest" 2>/dev/null || need+=("pytest")
$PY -c "import setuptools" 2>/dev/null || need+=("setuptools")
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  $PY -m pip install -q "${need[@]}"
fi
$PY setup.py -q build_ext --inplace >/tmp/cgraph-build.log 2>&1 || { cat /tmp/cgraph-build.log; exit 1; }
