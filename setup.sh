#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with edgeadapt and everything it needs.
# The CPU build of torch is installed first, so the project's torch range never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[server,dev]"
# The real-data carrier ships a numpy file; nothing of its code is needed, so no dependencies.
.venv/bin/python -m pip install -q --no-deps "seglearn==1.2.5"
echo "edgeadapt is set up in .venv"
