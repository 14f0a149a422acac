#!/usr/bin/env bash
# Sets up a venv with ringreduce and its test dependencies, then runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
exec .venv/bin/python -m pytest -q "$@"
