#!/usr/bin/env bash
# The GPU check, for a CUDA machine: build in place, run every test (GPU ones
# included), then with --bench the benchmark runner.  Prints pytest's summary
# line and the benchmark table last.
DEPS_FOR=tests
source "$(dirname "$0")/_deps.sh"
"$PY" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name())"
status=0
"$PY" -X faulthandler -m pytest -q -p no:cacheprovider --tb=short -rs tests || status=$?
if [ "${1:-}" = "--bench" ]; then
  shift
  "$PY" -m benchmarks.run "$@" || status=$?
fi
exit $status
