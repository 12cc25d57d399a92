#!/usr/bin/env bash
# The GPU check, for a CUDA machine: build in place, run every test (GPU ones
# included) but the slow packaging build, twice (the second time with
# CGRAPH_DEBUG=1), then with --bench the benchmark runner.  Prints pytest's
# summary lines and the benchmark table last.
DEPS_FOR=gpu-tests
source "$(dirname "$0")/_deps.sh"
"$PY" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name())"
# The notebook test's Jupyter packages, on a machine with no network: wheels
# carried in .whl/notebook/ (git-ignored), installed after the build so that
# they cannot change it.  Without them tests/test_notebook.py skips.
if compgen -G ".whl/notebook/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/notebook/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
# -m "not slow": the packaging test's second full build (minutes of device
# time) checks nothing GPU-specific; CI runs it.
"$PY" -X faulthandler -m pytest -q -p no:cacheprovider --tb=short -rfEs -m "not slow" tests || status=$?
# Once more with cgraph's debug checks on (Note [Checked invariants] in
# csrc/aten_checks.cpp): every rule about which replay may run and what it
# may overwrite is checked again, without the fast path's shortcuts.
echo "== again with CGRAPH_DEBUG=1"
CGRAPH_DEBUG=1 "$PY" -X faulthandler -m pytest -q -p no:cacheprovider --tb=short -rfEs \
  -m "not slow" tests || status=$?
if [ "${1:-}" = "--bench" ]; then
  shift
  "$PY" -m benchmarks.run "$@" || status=$?
fi
exit $status
