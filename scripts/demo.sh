#!/usr/bin/env bash
# Installs what is missing, builds cgraph in place and runs the demo.
source "$(dirname "$0")/_deps.sh"
exec "$PY" -m cgraph.demo "$@"
