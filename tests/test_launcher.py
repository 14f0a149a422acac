"""ringrun: environment per rank, prefixed output, failure propagation, -H,
and no rank outliving ringrun however it ends."""
import os
import secrets
import select
import shlex
import signal
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
    return subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", *args], capture_output=True, text=True,
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


def test_a_lone_failing_rank_has_nobody_to_stop():
    out = ringrun("-np", "1", sys.executable, "-c", "raise SystemExit(3)")
    assert out.returncode == 3
    assert out.stderr.strip().splitlines()[-1] == "ringrun: rank 0 exited with code 3; no rank left to stop"


def test_a_rank_failing_after_another_exited_0_names_both():
    code = "import os, sys, time\nif os.environ['RINGREDUCE_RANK'] == '1': time.sleep(1); sys.exit(2)"
    out = ringrun("-np", "2", sys.executable, "-c", code)
    assert out.returncode == 2
    assert "ringrun: rank 1 exited with code 2 (after rank(s) 0 exited with code 0)" in out.stderr


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
                "links = rr.core.communicator().world.extra['links']\n"
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


# -- ringrun ending in every way leaves no rank behind -------------------------

RANK_UP_THEN_SPIN = "import os, time\nprint('up', flush=True)\nwhile True: time.sleep(0.05)"


def processes_with(marker: str) -> list:
    """Pids of live processes whose command line holds marker (zombies count as gone)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(pid))
    return found


def leftovers(marker: str, within: float = 10.0) -> list:
    """What still runs with marker after `within` seconds; killed then, so no test leaks."""
    deadline = time.monotonic() + within
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def start_ringrun(np_: int, *ringrun_args: str, code: str | None = RANK_UP_THEN_SPIN, command=None):
    """ringrun running np_ ranks of code (or of command), each with a unique marker in
    its command line, once every rank has said 'up'."""
    marker = f"rrmarker{secrets.token_hex(6)}"
    command = command or [sys.executable, "-c", code, marker]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RINGREDUCE_SECRET", None)
    p = subprocess.Popen([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", str(np_), *ringrun_args, *command],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    seen, deadline = b"", time.monotonic() + 30
    while seen.count(b"] up\n") < np_:
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            p.kill()
            pytest.fail(f"ranks did not start: {seen!r}")
        seen += os.read(p.stdout.fileno(), 4096)
    return p, marker


def finish(p: subprocess.Popen):
    """ringrun's exit status and stderr (it must end within 20 s)."""
    try:
        _, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"ringrun did not end: {err.decode()}")
    return p.returncode, err.decode()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_ringrun_stops_every_rank_and_says_so(sig):
    p, marker = start_ringrun(2)
    p.send_signal(sig)
    code, err = finish(p)
    assert leftovers(marker) == []
    assert code == -sig, "ringrun ends by the signal it got, as a shell expects"
    assert err.strip().splitlines() == [f"ringrun: got {sig.name}; stopping 2 rank(s)"]


def test_sigkill_to_ringrun_still_stops_every_rank():
    p, marker = start_ringrun(3)
    p.kill()
    code, _ = finish(p)
    assert code == -signal.SIGKILL
    assert leftovers(marker) == [], "the guards see their control pipe close and stop their ranks"


def test_sigkill_to_ringrun_stops_the_children_of_a_shell_rank():
    # The rank is a shell whose python is its child (`; true` keeps sh from exec'ing it).
    marker = f"rrmarker{secrets.token_hex(6)}"
    script = f"{shlex.join([sys.executable, '-c', RANK_UP_THEN_SPIN, marker])}; true"
    p, _ = start_ringrun(2, code=None, command=["sh", "-c", script])
    p.kill()
    finish(p)
    assert leftovers(marker) == []


def test_a_guard_killed_alone_takes_its_rank_with_it_and_fails_the_job():
    p, marker = start_ringrun(2)
    guards = [pid for pid in processes_with(marker) if b"guard.py" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(guards) == 2
    os.kill(guards[0], signal.SIGKILL)
    code, err = finish(p)
    assert code == 128 + signal.SIGKILL and "was killed by SIGKILL; stopping the other 1 rank(s)" in err
    assert leftovers(marker) == [], "PR_SET_PDEATHSIG ends the rank whose guard died"


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace():
    code = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
            "while True: time.sleep(0.05)")
    p, marker = start_ringrun(2, code=code)
    p.send_signal(signal.SIGTERM)
    code, _ = finish(p)
    assert code == -signal.SIGTERM
    assert leftovers(marker, within=2) == []


def test_closed_stdout_stops_the_job_quietly_and_promptly():
    marker = f"rrmarker{secrets.token_hex(6)}"
    loop = "import itertools\nfor i in itertools.count(): print('line', i)"
    ringrun_cmd = shlex.join([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, "-c", loop,
                              marker])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-c", f"set -o pipefail; {ringrun_cmd} | head -1"], capture_output=True,
                         text=True, timeout=40, env=env)
    assert time.monotonic() - t0 < 20
    assert leftovers(marker) == []
    assert out.returncode == 128 + signal.SIGPIPE, "like any command whose reader went away"
    assert out.stdout.startswith("[") and out.stdout.count("\n") == 1
    assert out.stderr.strip().splitlines() == ["ringrun: stdout was closed; stopping 2 rank(s)"]


def _fake_remote_ssh(tmp_path):
    """An 'ssh' that runs the remote command in a session of its own, out of
    ringrun's reach as on another host: only the connection (stdin) links them."""
    script = tmp_path / "fake_remote_ssh"
    script.write_text('#!/bin/sh\nshift\nexec setsid -w sh -c "$1"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_over_ssh_end_with_ringrun(tmp_path, sig):
    p, marker = start_ringrun(2, "-H", "nodeA:1,nodeB:1", "--ssh", _fake_remote_ssh(tmp_path))
    p.send_signal(sig)
    code, _ = finish(p)
    assert code == -sig
    assert leftovers(marker) == []


# ringrun --elastic-timeout nan (a deadline no comparison ever passes; nan < 0
# is false) is refused, as --timeout nan is.
def test_ringrun_refuses_an_elastic_timeout_of_nan():
    import subprocess
    import sys
    from ranks import REPO
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "ringreduce", "--elastic", "-np", "1", "--elastic-timeout", "nan",
                          "true"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--elastic-timeout" in out.stderr, out


@pytest.mark.parametrize("args, says", [
    (["-np", "2", "--max-restarts", "3", "true"], "--max-restarts needs --elastic"),
    (["-np", "2", "--elastic-timeout", "5", "true"], "--elastic-timeout needs --elastic"),
    (["--elastic", "-np", "2", "--max-np", "1", "true"], "-np (2) <= --max-np (1)"),
    (["--elastic", "-np", "2", "--min-np", "two", "true"], "--min-np: invalid int value: 'two'"),
    (["--elastic", "-np", "2", "--max-restarts", "-1", "true"], "must not be negative"),
])
def test_elastic_flags_are_checked(args, says):
    """An elastic flag without --elastic (--max-restarts, --elastic-timeout)
    is refused, never silently ignored (the user would believe the job
    elastic); values out of range too."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", *args], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 2 and says in out.stderr, out.stderr


class _Ended:
    """A rank's process that has already ended with `code`."""

    def __init__(self, code):
        self.returncode, self.stdin, self.pid = code, None, -1

    def poll(self):
        return self.returncode

    def wait(self):
        return self.returncode


def test_ringrun_names_the_rank_that_failed_first_not_the_lowest(capsys):
    """Rank 2 fails; ranks 0 and 1 fail a few ms later (PeerLostError), inside
    one of ringrun's 50 ms polls: ringrun must blame rank 2, whose output says
    why, not rank 0, whose output only says it lost a peer."""
    from ringreduce.launch import ringrun as run
    job = run.Job()
    job.ranks = [run.Rank(i, False, _Ended(code)) for i, code in enumerate([1, 1, 3])]
    for i in (2, 0, 1):  # the order they ended in
        job.wait_for(job.ranks[i])
    assert run.watch(job).code == 3
    assert capsys.readouterr().err == "ringrun: rank 2 exited with code 3; no rank left to stop\n"


@pytest.mark.parametrize("args, says", [(["--timeout", "-1"], "--timeout"), (["-H", "localhost:x"], "-H"),
                                        (["-H", "localhost:0"], "-H"), (["-H", ":2"], "-H")])
def test_ringrun_refuses_bad_arguments_up_front(args, says):
    out = ringrun("-np", "2", *args, sys.executable, "-c", "pass")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "ringrun: error:" in out.stderr and says in out.stderr, out.stderr


def test_ringrun_with_a_script_but_no_interpreter_says_to_add_python(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = ringrun("-np", "2", str(script))
    assert out.returncode == 127
    assert "ringrun -np N python" in out.stderr, out.stderr
