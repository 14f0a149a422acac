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


def checkout(tmp_path):
    """The files a build in place reads, copied (no built files)."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "csrc", tree / "csrc")
    shutil.copytree(REPO / "ringreduce", tree / "ringreduce",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.fatbin"))
    (tree / "scripts").mkdir()
    for name in ["setup.py", "pyproject.toml", "scripts/build_inplace.sh"]:
        shutil.copy(REPO / name, tree / name)
    return tree


def imports_from(tree, python, cwd, env):
    got = subprocess.run([python, "-c", "import ringreduce._core as c; print(c.__file__)"],
                         cwd=cwd, capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(tree)})
    return got.returncode == 0 and str(tree) in got.stdout, got.stderr[-2000:]


def test_a_checkout_builds_in_place_and_imports(tmp_path):
    tree = checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("MPICC", "RINGREDUCE_CUDA")}
    out = subprocess.run(["bash", "scripts/build_inplace.sh", os.path.relpath(sys.executable, tree)], cwd=tree,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    old = int(setuptools.__version__.split(".")[0]) < 77
    assert ("building without pyproject.toml" in out.stderr) is old, out.stderr[-2000:]
    assert list((tree / "ringreduce").glob("_core*.so")), sorted(p.name for p in (tree / "ringreduce").iterdir())
    ok, why = imports_from(tree, sys.executable, tmp_path, env)
    assert ok, why


def test_a_python_without_setuptools_builds_the_core_alone(tmp_path):
    """A bare environment (no setuptools, as Python 3.12+ venvs are): the
    core is compiled with the C compiler from setup.py's sources and flags,
    and imports."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    python = tmp_path / "bare" / "bin" / "python"
    assert subprocess.run([python, "-c", "import setuptools"], capture_output=True).returncode != 0
    tree = checkout(tmp_path)
    out = subprocess.run(["bash", "scripts/build_inplace.sh", str(python)], cwd=tree, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no setuptools" in out.stderr
    [built] = (tree / "ringreduce").glob("_core*.so")
    load = ("import importlib.util as u, sys; s = u.spec_from_file_location('ringreduce._core', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.Comm)")  # the package needs numpy: not here
    got = subprocess.run([python, "-c", load, str(built)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and "Comm" in got.stdout, got.stderr[-2000:]


def test_asked_for_the_core_alone_it_builds_without_setuptools(tmp_path):
    """RINGREDUCE_BUILD_CORE_ONLY=1 (benchmarks/gpu_check.sh's last resort
    where the setuptools build failed): the core compiled with the C
    compiler alone, even with setuptools here, and the package imports it."""
    tree = checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("MPICC", "RINGREDUCE_CUDA")}
    out = subprocess.run(["bash", "scripts/build_inplace.sh", sys.executable], cwd=tree, capture_output=True,
                         text=True, timeout=600, env={**env, "RINGREDUCE_BUILD_CORE_ONLY": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RINGREDUCE_BUILD_CORE_ONLY=1: compiling ringreduce._core with the C compiler alone" in out.stderr
    assert [p.name.split(".")[0] for p in (tree / "ringreduce").glob("*.so")] == ["_core"]
    ok, why = imports_from(tree, sys.executable, tmp_path, env)
    assert ok, why
