#!/usr/bin/env bash
# The GPU check, for a CUDA machine: build in place, run every test (GPU ones
# included) but the slow packaging build, then with --bench the benchmark runner.  Prints pytest's summary
# line and the benchmark table last.
DEPS_FOR=gpu-tests
source "$(dirname "$0")/_deps.sh"
"$PY" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name())"
status=0
# -m "not slow": the packaging test's second full build (minutes of device
# time) checks nothing GPU-specific; CI runs it.
"$PY" -X faulthandler -m pytest -q -p no:cacheprovider --tb=short -rfEs -m "not slow" tests || status=$?
if [ "${1:-}" = "--bench" ]; then
  shift
  "$PY" -m benchmarks.run "$@" || status=$?
fi
exit $status
