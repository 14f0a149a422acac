"""`python -m ringreduce` is ringrun: the same arguments, output and exit code."""
import os
import subprocess
import sys

from ranks import REPO


def launch(module, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RINGREDUCE_SECRET", None)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60, env=env)


def test_python_m_ringreduce_runs_ranks_like_ringrun():
    code = "import os; print('rank', os.environ['RINGREDUCE_RANK'], 'of', os.environ['RINGREDUCE_SIZE'])"
    out = launch("ringreduce", "-np", "2", sys.executable, "-c", code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(line for line in out.stdout.splitlines() if "rank" in line) == ["[0] rank 0 of 2", "[1] rank 1 of 2"]


def test_python_m_ringreduce_exits_with_ringruns_code():
    failing = "import os, sys; sys.exit(3 if os.environ['RINGREDUCE_RANK'] == '1' else 0)"
    for args in (["-np", "2", sys.executable, "-c", failing], []):  # a failing rank; no arguments at all
        want, got = launch("ringreduce.launch.ringrun", *args), launch("ringreduce", *args)
        assert want.returncode != 0 and got.returncode == want.returncode, (args, want.returncode, got.returncode)
        # the first line names the failure (whether rank 0 had already exited varies from run to run)
        assert [line.split(";")[0].split(" (after")[0] for line in got.stderr.splitlines()[:1]] == \
            [line.split(";")[0].split(" (after")[0] for line in want.stderr.splitlines()[:1]], (got.stderr, want.stderr)
