#!/usr/bin/env bash
# Installs what is missing, builds cgraph in place and runs the demo.
source "$(dirname "$0")/_deps.sh"
# Where numpy could not be installed, torch's "Failed to initialize NumPy"
# warning at import is not the demo's: the demo does not use numpy.
exec "$PY" -W "ignore:Failed to initialize NumPy:UserWarning" -m cgraph.demo "$@"
