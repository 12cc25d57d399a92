#!/usr/bin/env bash
# Installs what is missing, builds cgraph in place and runs the test suite.
# Without a GPU the GPU tests are skipped; on a CUDA machine they all run.
DEPS_FOR=tests
source "$(dirname "$0")/_deps.sh"
exec "$PY" -m pytest -q tests "$@"
