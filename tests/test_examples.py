"""The README's main job: the digits example trains to a good accuracy on 4 ranks."""
import os
import re
import subprocess
import sys

from ranks import REPO


def test_train_digits_on_four_ranks():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.run", "-np", "4", sys.executable,
                          str(REPO / "examples" / "train_digits.py")],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out.stdout).group(1))
    assert accuracy > 0.9
    assert "weights identical on every rank: True" in out.stdout
    assert re.search(r"64 MiB float32: [0-9.]+ ms, busbw [0-9.]+ GB/s", out.stdout)
