"""The wheel that `pip install .` builds, installed with its [tf,metrics] extras
into a clean venv and used from a directory outside the source tree: every module
imports, and ringrun runs a 2-rank allreduce and a 2-rank Keras step."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ranks import REPO

# Building the wheel and installing tensorflow into a fresh venv dominate: the
# first test pays for it, so each gets a budget of its own, above the default.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # building the wheel's venv alone takes minutes

WHEEL_MUST_HOLD = ["ringreduce/__init__.py", "ringreduce/__main__.py", "ringreduce/core/cuda.py",
                   "ringreduce/tensorflow/__init__.py", "ringreduce/tensorflow/optimizer.py",
                   "ringreduce/csrc/kernels/cuda/reduce.cu", "ringreduce/csrc/kernels/reduce_math.h",
                   "ringreduce/csrc/tf/async_call.cc", "ringreduce/tensorflow/async_op.py"]
# Extras left out (ray: hundreds of MB) must make their modules say which extra to install.
INSTALLED_EXTRAS = ("tf", "metrics")


def run(cmd, timeout, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(python, env, workdir) of a fresh venv holding the wheel and its INSTALLED_EXTRAS."""
    tmp = tmp_path_factory.mktemp("wheel")
    # A copy of the sources, so no earlier build/ or installed files of this checkout leak into the wheel.
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "*.so", ".pytest_cache", "*.fatbin"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp / "dist", src], timeout=400)
    (wheel,) = (tmp / "dist").glob("ringreduce-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in WHEEL_MUST_HOLD if n not in names]
    assert not missing, f"the wheel lacks {missing}: it holds {sorted(names)}"
    assert not [n for n in names if n.startswith("tests/")], "the tests are not part of the package"

    run([sys.executable, "-m", "venv", "--without-pip", tmp / "venv"], timeout=120)
    python = tmp / "venv" / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", f"{wheel}[{','.join(INSTALLED_EXTRAS)}]"], timeout=400)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RINGREDUCE_")}
    env.update(PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="3",
               OPENBLAS_NUM_THREADS="1")
    work = tmp / "elsewhere"
    work.mkdir()
    return python, env, work


def rank_results(stdout: str, n: int) -> list:
    """Each rank prints `RESULT <json>`; ringrun prefixes its lines with `[rank] `."""
    found = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition(" ")
        if rest.startswith("RESULT "):
            found[int(head.strip("[]"))] = json.loads(rest[len("RESULT "):])
    assert sorted(found) == list(range(n)), stdout
    return [found[r] for r in range(n)]


def test_every_module_imports_from_the_installed_wheel(venv):
    python, env, work = venv
    out = run([python, "-c", textwrap.dedent("""
        import importlib, json, pkgutil, ringreduce, ringreduce.core.cuda
        names = sorted(m.name for m in pkgutil.walk_packages(ringreduce.__path__, "ringreduce."))
        missing = {}
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                missing[name] = str(exc)
        print(json.dumps({"file": ringreduce.__file__, "modules": names, "missing": missing,
                          "kernel_source": str(ringreduce.core.cuda.kernel_source())}))
    """)], timeout=180, env=env, cwd=work)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for name, message in res["missing"].items():
        extra = message.partition("pip install 'ringreduce[")[2].partition("]")[0]
        assert extra and extra not in INSTALLED_EXTRAS, f"{name} does not import from the wheel: {message}"
    site = Path(python).parent.parent
    assert Path(res["file"]).is_relative_to(site), f"imported {res['file']}, not the installed wheel"
    for name in ["ringreduce.tensorflow", "ringreduce.tensorflow.optimizer", "ringreduce.tensorflow.callbacks",
                 "ringreduce.tensorflow.ops", "ringreduce.tensorflow.overlap", "ringreduce.tensorflow.compression",
                 "ringreduce.core.cuda", "ringreduce.launch.ringrun", "ringreduce.__main__", "ringreduce._core"]:
        assert name in res["modules"], (name, res["modules"])
    kernel = Path(res["kernel_source"])
    assert kernel.is_relative_to(site) and (kernel.parent.parent / "reduce_math.h").exists(), kernel


def test_ringrun_allreduce_on_two_ranks_from_the_installed_wheel(venv, tmp_path):
    python, env, work = venv
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import json
        import numpy as np
        import ringreduce as rr
        rr.init()
        x = rr.allreduce(np.arange(5, dtype=np.float32) * (rr.rank() + 1), op="sum")
        print("RESULT", json.dumps({"size": rr.size(), "sum": x.tolist()}))
    """))
    ringrun = Path(python).parent / "ringrun"
    for launcher in ([ringrun], [python, "-m", "ringreduce"]):
        out = run([*launcher, "-np", "2", python, tmp_path / "job.py"], timeout=120, env=env, cwd=work)
        for res in rank_results(out.stdout, 2):
            assert res == {"size": 2, "sum": [0.0, 3.0, 6.0, 9.0, 12.0]}, (launcher, res)


def test_keras_training_step_on_two_ranks_from_the_installed_wheel(venv, tmp_path):
    python, env, work = venv
    (tmp_path / "keras_step.py").write_text(textwrap.dedent("""
        import json
        import numpy as np, keras
        import ringreduce.tensorflow as rrtf
        rrtf.init()
        keras.utils.set_random_seed(rrtf.rank())  # different starts: the broadcast makes them one
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        x = np.full((4, 3), rrtf.rank() + 1.0, dtype=np.float32)
        history = model.fit(x, np.ones((4, 2), np.float32), batch_size=4, epochs=1, verbose=0,
                            callbacks=[rrtf.BroadcastGlobalVariablesCallback(0)])
        print("RESULT", json.dumps({"loss": history.history["loss"][0], "steps": int(model.optimizer.iterations),
                                    "weights": [w.tolist() for w in model.get_weights()]}))
    """))
    out = run([Path(python).parent / "ringrun", "-np", "2", python, tmp_path / "keras_step.py"], timeout=240,
              env=env, cwd=work)
    results = rank_results(out.stdout, 2)
    assert all(r["steps"] == 1 and r["loss"] == r["loss"] and abs(r["loss"]) < 1e6 for r in results), results
    assert results[0]["weights"] == results[1]["weights"], "the ranks' weights differ after a synchronous step"


def test_tf1_session_collectives_on_two_ranks_from_the_installed_wheel(venv, tmp_path):
    """The TF1 op is compiled on first use from the source the wheel ships."""
    python, env, work = venv
    (tmp_path / "tf1_step.py").write_text(textwrap.dedent("""
        import json
        import tensorflow as tf
        import ringreduce.tensorflow as rrtf
        from ringreduce.tensorflow import async_op
        rrtf.init()
        r = rrtf.rank()
        with tf.Graph().as_default():
            order = range(6) if r == 0 else reversed(range(6))
            outs = {i: rrtf.allreduce(tf.fill([3], float(r + 10 * i)), op=rrtf.Sum, name=f"t{i}") for i in order}
            with tf.compat.v1.Session() as sess:
                got = sess.run([outs[i] for i in range(6)])
        print("RESULT", json.dumps({"sums": [g.tolist() for g in got], "source": str(async_op.source()),
                                    "library": str(async_op.library_path())}))
    """))
    ops_dir = tmp_path / "tf_ops"
    out = run([Path(python).parent / "ringrun", "-np", "2", python, tmp_path / "tf1_step.py"], timeout=300,
              env={**env, "RINGREDUCE_TF_OPS_DIR": str(ops_dir)}, cwd=work)
    site = Path(python).parent.parent
    for res in rank_results(out.stdout, 2):
        assert res["sums"] == [[1.0 + 20 * i] * 3 for i in range(6)], res
        assert Path(res["source"]).is_relative_to(site), res["source"]
        assert Path(res["library"]).parent == ops_dir and Path(res["library"]).exists(), res["library"]
