#!/usr/bin/env bash
# Installs what is missing, builds cgraph in place and runs the demo: on a
# machine with an NVIDIA GPU only.  Without one, nothing is installed or
# built (CUDA graphs cannot run there): it says what it would do, and exits 0.
# The check needs no Python and no torch: nvidia-smi listing a GPU, or the
# driver's /dev/nvidia0.
has_gpu() {
  { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; } \
    || [ -e /dev/nvidia0 ]
}
if ! has_gpu; then
  cat <<'EOF'
cgraph demo: no NVIDIA GPU here (nvidia-smi lists none, no /dev/nvidia0), and CUDA graphs
need one: nothing installed, nothing built. On a machine with a GPU, this script:
  1. installs torch (a CUDA build) and numpy into $PYTHON (default python3) where missing,
  2. builds cgraph's extension in place (python setup.py build_ext --inplace, about
     40 seconds on 2 CPU cores),
  3. graphs a small MLP (Linears and GELUs) with cgraph.make_graphed_callables and checks
     its outputs and grads bitwise against eager PyTorch,
  4. times one forward+backward step: eager, torch.cuda.make_graphed_callables, cgraph.
EOF
  exit 0
fi
source "$(dirname "$0")/_deps.sh"
# Where numpy could not be installed, torch's "Failed to initialize NumPy"
# warning at import is not the demo's (_deps.sh has said why): the demo does
# not use numpy.
exec "$PY" -W "ignore:Failed to initialize NumPy:UserWarning" -m cgraph.demo "$@"
