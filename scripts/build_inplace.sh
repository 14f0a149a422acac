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
# the built files land in ./ringreduce all the same. Without setuptools, or
# with RINGREDUCE_BUILD_CORE_ONLY=1 (where the setuptools build failed), the
# core alone is compiled directly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # still this Python from the scratch folder
if [ -n "${RINGREDUCE_BUILD_CORE_ONLY:-}" ] || ! "$PY" -c "import setuptools" 2>/dev/null; then
    # No setuptools at all (a bare Python 3.12+ environment), or asked: the
    # core alone, compiled as setup.py would (its sources and flags read from
    # it), without the MPI transport and the fatbin (cupy then compiles the
    # kernels itself).
    why=${RINGREDUCE_BUILD_CORE_ONLY:+RINGREDUCE_BUILD_CORE_ONLY=$RINGREDUCE_BUILD_CORE_ONLY}
    echo "${why:-no setuptools}: compiling ringreduce._core with the C compiler alone" >&2
    exec "$PY" - <<'BUILD'
import ast, subprocess, sys, sysconfig
found = {}
for node in ast.parse(open("setup.py").read()).body:
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        if node.targets[0].id in ("FLAGS", "CORE_SOURCES"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
cmd = [cc, "-shared", "-fPIC", *found["FLAGS"], "-Icsrc", "-I" + sysconfig.get_paths()["include"],
       *found["CORE_SOURCES"], "-o", "ringreduce/_core" + sysconfig.get_config_var("EXT_SUFFIX"), "-lpthread", "-ldl"]
print(" ".join(cmd), file=sys.stderr)
subprocess.run(cmd, check=True)
BUILD
fi
if "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"; then
    exec "$PY" setup.py -q build_ext --inplace
fi
echo "setuptools $("$PY" -c 'import setuptools; print(setuptools.__version__)') < 77: building without pyproject.toml" >&2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
ln -s "$PWD/csrc" "$PWD/ringreduce" "$PWD/setup.py" "$scratch/"
cd "$scratch"
"$PY" setup.py -q build_ext --inplace
