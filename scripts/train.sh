#!/usr/bin/env bash
# Sets up a venv with ringreduce, then trains the digits example on 4 local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
exec .venv/bin/ringrun -np "${NP:-4}" .venv/bin/python examples/train_digits.py "$@"
