"""Runs a snippet on N local ranks, each in its own process, under a timeout.

    results = run_ranks(4, "result = rr.allreduce(np.ones(3)).tolist()", tmp_path)

The snippet runs after `import numpy as np, ringreduce as rr; rr.init()`
(unless init=False) and may set `result`, which comes back per rank. A rank
that fails or a job that outlives `timeout` fails the test, showing each
rank's stderr; every process is killed either way.
"""
from __future__ import annotations

import os
import pickle
import secrets
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ringreduce.core import world as _world

REPO = Path(__file__).resolve().parent.parent

# Every rank process started here, so a test that ends early (pytest-timeout
# fires, an assertion fails between start and collect) leaves none behind
# (conftest.py kills what is still alive after each test).
started: list[subprocess.Popen] = []


def kill_leftovers() -> None:
    while started:
        p = started.pop()
        if p.poll() is None:
            p.kill()
            p.wait()

PRELUDE = """\
import os, pickle, sys
import numpy as np
import ringreduce as rr
result = None
"""

EPILOGUE = """
with open(os.environ["RR_TEST_RESULT"], "wb") as _f:
    pickle.dump(result, _f)
"""


@dataclass
class Rank:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    result: object


def free_port() -> int:
    return _world.free_port("127.0.0.1")


def rank_env(rank: int, size: int, port: int, secret: str, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(RINGREDUCE_RANK=str(rank), RINGREDUCE_SIZE=str(size), RINGREDUCE_ADDR=f"127.0.0.1:{port}",
               RINGREDUCE_SECRET=secret, RINGREDUCE_LOCAL_RANK=str(rank), RINGREDUCE_LOCAL_SIZE=str(size),
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]), OPENBLAS_NUM_THREADS="1")
    env.update(extra or {})
    return env


def start_ranks(n: int, body: str, tmp_path: Path, env: dict | None = None, init: bool = True,
                port: int | None = None, secret: str | None = None) -> list[tuple[subprocess.Popen, Path]]:
    script = tmp_path / f"job_{secrets.token_hex(4)}.py"
    script.write_text(PRELUDE + ("rr.init()\n" if init else "") + textwrap.dedent(body) + EPILOGUE)
    port = port or free_port()
    secret = secret or secrets.token_hex(16)
    procs = []
    for r in range(n):
        out = tmp_path / f"{script.stem}_rank{r}.pkl"
        e = rank_env(r, n, port, secret, env)
        e["RR_TEST_RESULT"] = str(out)
        p = subprocess.Popen([sys.executable, str(script)], env=e, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        started.append(p)
        procs.append((p, out))
    return procs


def collect(procs, timeout: float, check: bool = True) -> list[Rank]:
    deadline = time.monotonic() + timeout
    ranks, timed_out = [], False
    for r, (p, out) in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q, _ in procs:
                q.kill()
            stdout, stderr = p.communicate()
        result = pickle.loads(out.read_bytes()) if out.exists() else None
        ranks.append(Rank(r, p.returncode, stdout, stderr, result))
    if timed_out or (check and any(x.returncode != 0 for x in ranks)):
        report = "\n".join(f"--- rank {x.rank} (exit {x.returncode})\n{x.stderr[-3000:]}" for x in ranks)
        pytest.fail(("job timed out after %.0f s" % timeout if timed_out else "a rank failed") + "\n" + report)
    return ranks


def run_ranks(n: int, body: str, tmp_path: Path, timeout: float = 120, env: dict | None = None,
              check: bool = True, init: bool = True) -> list[Rank]:
    return collect(start_ranks(n, body, tmp_path, env, init), timeout, check)
