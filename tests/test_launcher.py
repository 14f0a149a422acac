"""ringrun: environment per rank, prefixed output, failure propagation, -H."""
import os
import stat
import subprocess
import sys
import time

import pytest

from ranks import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import Cluster, can_build  # noqa: E402


def ringrun(*args, timeout=60, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RINGREDUCE_SECRET", None)
    return subprocess.run([sys.executable, "-m", "ringreduce.run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def lines_of(out: str, rank: int) -> list:
    return [line[len(f"[{rank}] "):] for line in out.splitlines() if line.startswith(f"[{rank}] ")]


def test_each_rank_gets_its_environment_and_prefix():
    code = ("import os; print(*[os.environ[k] for k in ['RINGREDUCE_RANK', 'RINGREDUCE_SIZE', 'RINGREDUCE_ADDR',"
            " 'RINGREDUCE_SECRET', 'RINGREDUCE_LOCAL_RANK', 'RINGREDUCE_LOCAL_SIZE', 'RINGREDUCE_TIMEOUT']])")
    out = ringrun("-np", "3", "--timeout", "7", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    fields = [lines_of(out.stdout, r)[0].split() for r in range(3)]
    assert [f[0] for f in fields] == ["0", "1", "2"] and {f[1] for f in fields} == {"3"}
    assert len({f[2] for f in fields}) == 1 and fields[0][2].startswith("127.0.0.1:")
    assert len({f[3] for f in fields}) == 1 and len(fields[0][3]) == 64, "one fresh secret per job"
    assert [f[4] for f in fields] == ["0", "1", "2"] and {f[5] for f in fields} == {"3"}
    assert {f[6] for f in fields} == {"7.0"}


def test_a_real_job_runs_and_output_lines_stay_whole():
    code = ("import numpy as np, ringreduce as rr; rr.init()\n"
            "y = rr.allreduce(np.full(100_000, rr.rank() + 1.0))\n"
            "[print('x' * 500) for _ in range(200)]\n"
            "print('sum', y[0])")
    out = ringrun("-np", "4", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    for r in range(4):
        mine = lines_of(out.stdout, r)
        assert mine[-1] == "sum 10.0" and mine[:-1] == ["x" * 500] * 200
    assert all(line[:1] == "[" for line in out.stdout.splitlines())


def test_failing_rank_stops_the_others():
    code = "import os, sys, time\nif os.environ['RINGREDUCE_RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    t0 = time.time()
    out = ringrun("-np", "3", sys.executable, "-c", code)
    assert out.returncode == 3
    assert time.time() - t0 < 15
    assert "rank 1 exited with code 3" in out.stderr


def test_killed_rank_makes_ringrun_fail():
    code = "import os, signal, time\nif os.environ['RINGREDUCE_RANK'] == '0': os.kill(os.getpid(), 9)\ntime.sleep(60)"
    out = ringrun("-np", "2", sys.executable, "-c", code)
    assert out.returncode == 128 + 9 and "SIGKILL" in out.stderr


def test_a_rank_raising_inside_a_collective_job_fails_the_job():
    code = ("import numpy as np, ringreduce as rr; rr.init()\n"
            "if rr.rank() == 2: raise ValueError('boom')\n"
            "rr.allreduce(np.ones(10))")
    out = ringrun("-np", "3", sys.executable, "-c", code)
    assert out.returncode != 0 and "boom" in out.stderr


def test_usage_errors():
    assert ringrun("-np", "2").returncode != 0
    out = ringrun("-np", "3", "-H", "a:1,b:1", "true")
    assert out.returncode != 0 and "slots" in out.stderr


def _fake_ssh(tmp_path, mapping):
    """An 'ssh' that runs the remote command inside the namespace of the host."""
    script = tmp_path / "fake_ssh"
    cases = "\n".join(f'  {host}) ns={ns};;' for host, ns in mapping.items())
    script.write_text(f'#!/bin/sh\nhost="$1"; shift\ncase "$host" in\n{cases}\n  *) exit 255;;\nesac\n'
                      'exec ip netns exec "$ns" sh -c "$*"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.skipif(can_build() is not None, reason=f"no network namespaces here: {can_build()}")
def test_two_hosts_over_ssh_in_network_namespaces(tmp_path):
    with Cluster(2) as cluster:
        ssh = _fake_ssh(tmp_path, dict(zip(cluster.addresses, cluster.namespaces)))
        hosts = ",".join(f"{a}:2" for a in cluster.addresses)
        code = ("import os, numpy as np, ringreduce as rr; rr.init()\n"
                "y = rr.allreduce(np.full(1 << 18, rr.rank() + 1.0, dtype=np.float32))\n"
                "from ringreduce.collectives import _state\n"
                "links = _state.world.extra['links']\n"
                "print(rr.rank(), rr.local_rank(), rr.local_size(), os.environ['RINGREDUCE_ADDR'], y[0],\n"
                "      links['next'], links['prev'])")
        out = ringrun("-np", "4", "-H", hosts, "--ssh", ssh, sys.executable, "-c", code, timeout=120,
                      cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    rows = sorted(lines_of(out.stdout, r)[0].split() for r in range(4))
    assert [row[:3] for row in rows] == [["0", "0", "2"], ["1", "1", "2"], ["2", "0", "2"], ["3", "1", "2"]]
    assert {row[3] for row in rows} == {cluster.addresses[0] + ":" + rows[0][3].split(":")[1]}
    assert {row[4] for row in rows} == {"10.0"}
    # Shared memory within a host only: 0 -> 1 and 2 -> 3; 1 -> 2 and 3 -> 0 cross hosts.
    assert [row[5:] for row in rows] == [["shm", "tcp"], ["tcp", "shm"], ["shm", "tcp"], ["tcp", "shm"]]
    assert cluster.leftovers() == []
