#!/usr/bin/env bash
# Builds ringreduce's C extensions (and, with RINGREDUCE_CUDA=1, the CUDA
# kernels' fatbin) in place in this checkout, with the Python given (default
# python3) and whatever setuptools it has, so `PYTHONPATH=$PWD python ...`
# runs the tree as it is:
#
#   bash scripts/build_inplace.sh [/path/to/python]
#
# setuptools reads pyproject.toml's [project] table too, and one older than
# the project's build requirement (setuptools 77) refuses its metadata (the
# license string) before compiling anything. The extensions need none of
# that metadata: with such a setuptools the build runs in a scratch folder
# that links the sources and the package but holds no pyproject.toml, and
# the built files land in ./ringreduce all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # still this Python from the scratch folder
if "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"; then
    exec "$PY" setup.py -q build_ext --inplace
fi
echo "setuptools $("$PY" -c 'import setuptools; print(setuptools.__version__)') < 77: building without pyproject.toml" >&2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
ln -s "$PWD/csrc" "$PWD/ringreduce" "$PWD/setup.py" "$scratch/"
cd "$scratch"
"$PY" setup.py -q build_ext --inplace
