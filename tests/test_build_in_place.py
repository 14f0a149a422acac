"""scripts/build_inplace.sh: the C extensions built in place in a checkout with
whatever setuptools the Python has (benchmarks/gpu_check.sh builds so on a GPU
machine whose Python was not set up by this project). A setuptools older than
pyproject.toml's requirement refuses the project's metadata before compiling:
the script then builds without pyproject.toml, into the same place."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import setuptools

REPO = Path(__file__).resolve().parent.parent


def test_a_checkout_builds_in_place_and_imports(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "csrc", tree / "csrc")
    shutil.copytree(REPO / "ringreduce", tree / "ringreduce",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.fatbin"))
    (tree / "scripts").mkdir()
    for name in ["setup.py", "pyproject.toml", "scripts/build_inplace.sh"]:
        shutil.copy(REPO / name, tree / name)
    env = {k: v for k, v in os.environ.items() if k not in ("MPICC", "RINGREDUCE_CUDA")}
    out = subprocess.run(["bash", "scripts/build_inplace.sh", os.path.relpath(sys.executable, tree)], cwd=tree,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    old = int(setuptools.__version__.split(".")[0]) < 77
    assert ("building without pyproject.toml" in out.stderr) is old, out.stderr[-2000:]
    assert list((tree / "ringreduce").glob("_core*.so")), sorted(p.name for p in (tree / "ringreduce").iterdir())
    got = subprocess.run([sys.executable, "-c", "import ringreduce, ringreduce._core as c; print(c.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**env, "PYTHONPATH": str(tree)})
    assert got.returncode == 0 and str(tree) in got.stdout, got.stderr[-2000:]
