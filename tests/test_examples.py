"""The README's main job: the digits example trains to a good accuracy on 4 ranks."""
import os
import re
import subprocess
import sys

import pytest

from ranks import REPO


def test_train_digits_on_four_ranks():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "4", sys.executable,
                          str(REPO / "examples" / "train_digits.py")],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out.stdout).group(1))
    assert accuracy > 0.9
    assert "weights identical on every rank: True" in out.stdout
    assert re.search(r"64 MiB float32: [0-9.]+ ms, busbw [0-9.]+ GB/s", out.stdout)


def test_keras_digits_full_flow_on_four_ranks(tmp_path):
    pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "4", sys.executable,
                          str(REPO / "examples" / "keras_digits.py"), "--epochs", "6", "--warmup-epochs", "2",
                          "--checkpoint-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "weights identical on every rank: True" in out.stdout, out.stdout
    accuracy = float(re.search(r"test accuracy=([0-9.]+)", out.stdout).group(1))
    assert accuracy > 0.9, out.stdout
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"epoch{e:02d}.keras" for e in range(1, 7)]
    assert not re.search(r"^\[[123]\]", out.stdout, re.M), "only rank 0 may print"


def test_horovod_keras_script_runs_with_only_its_import_line_changed(tmp_path):
    pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")
    script = REPO / "examples" / "horovod_keras_digits.py"
    # A Horovod user's script: ringreduce appears on the import line and nowhere else.
    lines = [line for line in script.read_text().splitlines() if "ringreduce" in line]
    assert lines == ["import ringreduce.tensorflow.keras as hvd"], lines
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, str(script), "4",
                          str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out.stdout).group(1))
    assert accuracy > 0.85, out.stdout
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{e}.keras" for e in range(1, 5)]
    assert out.stdout.count("test accuracy") == 1, "only rank 0 evaluates and prints"


def test_balanced_batches_example_trains_the_same_model_as_equal_shares():
    """examples/balanced_batches.py: equal and balanced shares of each global
    batch (one rank 4x slower, by a sleep) reach the same accuracy at the
    same step: the weighted average makes every step one global batch's,
    whatever the shares."""
    import json
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    results = {}
    for mode in ("equal", "balanced"):
        out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable,
                              str(REPO / "examples" / "balanced_batches.py"), "--mode", mode, "--steps", "40",
                              "--every", "5", "--ms-per-sample", "0.2", "--slowdown", "4", "--target", "0.75"],
                             capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        results[mode] = json.loads(next(ln[4:] for ln in out.stdout.splitlines() if ln.startswith("[0] {")))
    equal, balanced = results["equal"], results["balanced"]
    assert equal["final_shares"] == [120, 120] and sum(balanced["final_shares"]) == 240
    assert balanced["changes"] >= 1 and balanced["final_shares"][1] < 120  # the slow rank's share fell
    assert equal["steps_to_target"] == balanced["steps_to_target"] is not None
    assert abs(equal["final_accuracy"] - balanced["final_accuracy"]) <= 1 / 4000  # float rounding: at most 1 row
