#!/usr/bin/env bash
# Sets up a venv with ringreduce (TCP and MPI transports) and its test dependencies, then runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# MPI first, so the build finds mpicc and compiles the MPI transport too.
.venv/bin/python -m pip install -q "mpich>=4.1" "mpi4py>=4.0"
MPICC="$PWD/.venv/bin/mpicc" .venv/bin/python -m pip install -q -e ".[dev,mpi,tf]"
# The layers and the import graph first (pyproject.toml [tool.importlinter]): a broken contract fails fast.
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q "$@"
