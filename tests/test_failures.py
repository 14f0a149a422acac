"""Every failure provoked for real: each must raise a clear Python exception on
every rank, never hang. Each job runs under a timeout."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ranks import collect, free_port, rank_env, run_ranks, start_ranks


def test_killed_rank_is_named_on_every_survivor(tmp_path):
    ranks = run_ranks(4, """
        import os, signal, time
        x = np.ones(4 << 20, dtype=np.float32)
        for i in range(2):
            rr.allreduce(x)
        t0 = time.time()
        try:
            for i in range(1000):
                if rr.rank() == 2 and i == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                rr.allreduce(x)
            result = "no error"
        except rr.PeerLostError as e:
            elapsed = time.time() - t0
            try:
                rr.allreduce(x)
                after = "usable"
            except rr.RingReduceError as e2:
                after = str(e2)
            result = (e.rank, str(e), elapsed, after)
    """, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "20"}, check=False)
    assert ranks[2].returncode == -signal.SIGKILL
    for r in ranks:
        if r.rank == 2:
            continue
        assert r.returncode == 0, r.stderr
        lost, message, elapsed, after = r.result
        assert lost == 2 and "rank 2" in message, (r.rank, message)
        assert elapsed < 10, f"rank {r.rank} took {elapsed:.1f} s to notice"
        assert "unusable" in after and "rank 2" in after, after


@pytest.mark.parametrize("silent", [0, 2])
def test_silent_rank_times_out_and_is_named(tmp_path, silent):
    ranks = run_ranks(4, f"""
        import time
        rr.allreduce(np.ones(10))
        t0 = time.time()
        if rr.rank() == {silent}:
            time.sleep(12)
            result = "slept"
        else:
            try:
                rr.allreduce(np.ones(1000))
                result = "no error"
            except rr.PeerLostError as e:
                result = (e.rank, str(e), time.time() - t0)
    """, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "3"})
    for r in ranks:
        if r.rank == silent:
            continue
        lost, message, elapsed = r.result
        assert lost == silent and f"rank {silent}" in message, (r.rank, message)
        assert 3 <= elapsed < 10, elapsed
        assert "RINGREDUCE_TIMEOUT" in message


MISMATCHES = {
    "shape": "rr.allreduce(np.ones(10 + rr.rank()))",
    "shape, small vs large": "rr.allreduce(np.ones(5 if rr.rank() else 5_000_000, dtype=np.float32))",
    "dtype": "rr.allreduce(np.ones(10, dtype=np.float32 if rr.rank() else np.float64))",
    "op": "rr.allreduce(np.ones(10), op='max' if rr.rank() == 1 else 'sum')",
    "name": "rr.allreduce(np.ones(10), name=f'grad{rr.rank() % 2}')",
    "root": "rr.broadcast(np.ones(10), root=rr.rank() % 2)",
    "allgather trailing dims": "rr.allgather(np.ones((2, 3 + rr.rank())))",
    "collective": "rr.allreduce(np.ones(10)) if rr.rank() else rr.broadcast(np.ones(10))",
}


@pytest.mark.parametrize("what", list(MISMATCHES))
def test_mismatch_raises_on_every_rank(tmp_path, what):
    ranks = run_ranks(3, f"""
        try:
            {MISMATCHES[what]}
            result = "no error"
        except rr.MismatchError as e:
            try:
                rr.allreduce(np.ones(3))
                after = "usable"
            except rr.RingReduceError as e2:
                after = str(e2)
            result = (str(e), after)
    """, tmp_path, timeout=60)
    for r in ranks:
        assert r.result != "no error", f"rank {r.rank} raised nothing for a {what} mismatch"
        message, after = r.result
        assert "disagree" in message and "rank 0" in message and "rank 1" in message, message
        assert "unusable" in after, after
    assert len({r.result[0] for r in ranks}) == 1, "ranks explain the mismatch differently"


def test_unsupported_dtypes_raise_before_communication(tmp_path):
    ranks = run_ranks(3, """
        raised = []
        for bad in [np.array([object(), 1], dtype=object), np.ones(3, dtype=np.complex64),
                    np.ones(3, dtype=bool), np.array(["a", "b"]), np.ones(3, dtype=np.uint16)]:
            for call in [rr.allreduce, rr.allgather, rr.broadcast, rr.reduce_scatter]:
                try:
                    call(bad)
                    raised.append(False)
                except TypeError as e:
                    raised.append("dtype" in str(e))
        result = (all(raised), rr.allreduce(np.ones(4)).tolist())
    """, tmp_path, timeout=60)
    for r in ranks:
        assert r.result == (True, [3.0] * 4)


def _pester(addr, stop):
    """Connects to a rank's port over and over: silent sockets, garbage, and
    a forged handshake."""
    held = []
    while not stop.is_set():
        for payload in [None, b"GET / HTTP/1.0\r\n\r\n", b"RRHS1" + os.urandom(64), os.urandom(4096)]:
            try:
                s = socket.create_connection(addr, timeout=0.5)
                if payload:
                    s.sendall(payload)
                held.append(s)
            except OSError:
                pass
        time.sleep(0.05)
    for s in held:
        s.close()


def test_stray_connections_during_rendezvous(tmp_path):
    port = free_port()
    stop = threading.Event()
    pest = threading.Thread(target=_pester, args=(("127.0.0.1", port), stop))
    procs = start_ranks(3, """
        import time
        # Rank 0 binds late and rank 2 joins later still: the pest knocks
        # before the port opens and all through the rendezvous.
        time.sleep({"0": 0.5, "1": 0.0, "2": 2.0}[os.environ["RINGREDUCE_RANK"]])
        rr.init()
        time.sleep(0.1)
        result = float(rr.allreduce(np.full(100_000, rr.rank() + 1.0))[0])
    """, tmp_path, init=False, port=port)
    pest.start()
    try:
        ranks = collect(procs, timeout=90)
    finally:
        stop.set()
        pest.join()
    assert [r.result for r in ranks] == [6.0, 6.0, 6.0]
    assert "refused a connection" in ranks[0].stderr


def test_wrong_secret_never_joins(tmp_path):
    port = free_port()
    script = tmp_path / "impostor.py"
    script.write_text("import ringreduce as rr\nrr.init()\nprint('joined')\n")
    impostor = subprocess.Popen([sys.executable, str(script)],
                                env=rank_env(1, 3, port, "not-the-secret", {"RINGREDUCE_START_TIMEOUT": "10"}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = start_ranks(3, """
        import time
        if os.environ["RINGREDUCE_RANK"] == "1":
            time.sleep(1.5)     # the impostor knocks first
        rr.init()
        result = float(rr.allreduce(np.full(10, rr.rank() + 1.0))[0])
    """, tmp_path, init=False, port=port, secret="the-real-secret")
    try:
        out, err = impostor.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        impostor.kill()
        pytest.fail("the impostor hung instead of failing")
    ranks = collect(procs, timeout=60)
    assert impostor.returncode != 0 and "joined" not in out
    assert "SECRET" in err or "secret" in err, err[-2000:]
    assert [r.result for r in ranks] == [6.0, 6.0, 6.0]
