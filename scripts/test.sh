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
# Two pytest-xdist workers, one test file each at a time (module fixtures, like the wheel's venv, are built
# once): a serial run leaves a core idle while ranks sleep, wait for timeouts or start TensorFlow. Tests marked
# `alone` run while the other worker runs none (tests/conftest.py). `scripts/test.sh -n 0` runs in one process.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
