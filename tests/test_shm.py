"""Shared-memory links between neighbours on one host (ringreduce/core/shm.py,
csrc/transport/shm_link.c): which links use them, results on rings that mix them
with TCP links, nothing left in /dev/shm, and offers that must be declined."""
import os
import signal
import socket
from pathlib import Path

import pytest

from ranks import run_ranks
from ringreduce.core import shm, world

# Every collective against numpy, on sizes that fill and wrap a small link.
CHECK_COLLECTIVES = """
    import ml_dtypes
    checks = {}
    n, r = rr.size(), rr.rank()
    for count in [0, 1, n - 1, 2 * n + 1, 300_001]:
        for dtype in [np.float32, np.int64, ml_dtypes.bfloat16]:
            mine = (np.arange(count) % 7 + r).astype(dtype)
            want = sum((np.arange(count) % 7 + k).astype(np.float64) for k in range(n)).astype(dtype)
            checks[("allreduce", count, np.dtype(dtype).name)] = bool(np.array_equal(rr.allreduce(mine), want))
        x = np.arange(count, dtype=np.float64) + r
        full = sum(np.arange(count, dtype=np.float64) + k for k in range(n))
        base, extra = divmod(count, n)
        lo = r * base + min(r, extra)
        hi = lo + base + (r < extra)
        checks[("reduce_scatter", count)] = bool(np.array_equal(rr.reduce_scatter(x), full[lo:hi]))
        parts = [np.full(count + k, k, dtype=np.int32) for k in range(n)]
        checks[("allgather", count)] = bool(np.array_equal(rr.allgather(parts[r]), np.concatenate(parts)))
        root = count % n
        checks[("broadcast", count)] = bool(np.array_equal(rr.broadcast(x, root=root),
                                                           np.arange(count, dtype=np.float64) + root))
    rr.barrier()
    from ringreduce.core.communicator import current as _state
    result = (_state.world.extra["links"], checks)
"""

OPT_OUT_RANK_1 = """
    import os
    if os.environ["RINGREDUCE_RANK"] == "1":
        os.environ["RINGREDUCE_SHM_BYTES"] = "0"
    rr.init()
"""


def _kinds(ranks):
    return [r.result[0] for r in ranks]


def _assert_all_correct(ranks):
    for r in ranks:
        wrong = [case for case, ok in r.result[1].items() if not ok]
        assert not wrong, f"rank {r.rank}: {wrong}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_neighbours_on_one_host_share_memory(tmp_path, n):
    ranks = run_ranks(n, CHECK_COLLECTIVES, tmp_path, timeout=120, env={"RINGREDUCE_SHM_BYTES": "65536"})
    assert _kinds(ranks) == [{"next": "shm", "prev": "shm"}] * n
    _assert_all_correct(ranks)


def test_shared_memory_can_be_turned_off(tmp_path):
    ranks = run_ranks(3, CHECK_COLLECTIVES, tmp_path, timeout=120, env={"RINGREDUCE_SHM_BYTES": "0"})
    assert _kinds(ranks) == [{"next": "tcp", "prev": "tcp"}] * 3
    _assert_all_correct(ranks)


@pytest.mark.parametrize("n", [3, 4])
def test_a_ring_mixing_shared_memory_and_tcp_links(tmp_path, n):
    """Rank 1 declines shared memory: its two links run over TCP, the rest
    over shared memory, and ranks wait on both kinds at once."""
    ranks = run_ranks(n, OPT_OUT_RANK_1 + CHECK_COLLECTIVES, tmp_path, timeout=120, init=False,
                      env={"RINGREDUCE_SHM_BYTES": "65536"})
    kinds = _kinds(ranks)
    for r, k in enumerate(kinds):
        assert k["next"] == ("tcp" if r in (0, 1) else "shm"), (r, k)
        assert k["prev"] == ("tcp" if r in (1, 2) else "shm"), (r, k)
    _assert_all_correct(ranks)


def _ours():
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith("ringreduce-")}


@pytest.mark.alone
def test_nothing_is_left_in_dev_shm_even_when_a_rank_is_killed(tmp_path):
    before = _ours()
    run_ranks(3, "rr.allreduce(np.ones(1 << 20))", tmp_path, timeout=60)
    ranks = run_ranks(3, """
        import signal
        rr.allreduce(np.ones(1 << 20))
        if rr.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            rr.allreduce(np.ones(1 << 20))
        except rr.PeerLostError as e:
            result = e.rank
    """, tmp_path, timeout=60, check=False)
    assert ranks[1].returncode == -signal.SIGKILL
    assert [ranks[0].result, ranks[2].result] == [1, 1]
    assert _ours() - before == set()


@pytest.fixture
def offer(tmp_path):
    fd, path, nonce = shm.make_file("test", 4096)
    yield {"path": path, "nonce": nonce.hex(), "host": shm.host_identity()}
    os.close(fd)
    if os.path.exists(path):
        os.unlink(path)


def test_a_genuine_offer_is_taken(offer):
    fd = shm.open_offer(offer)
    assert fd >= 0
    os.close(fd)


@pytest.mark.parametrize("forgery", ["nonce", "nonce not text", "host", "outside dev shm", "symlink", "hard link",
                                     "others may read it", "missing", "not a dict"])
def test_offers_that_cannot_be_shared_are_declined(offer, tmp_path, forgery):
    """The link then stays on TCP; nothing here raises or opens the file."""
    bad = dict(offer)
    if forgery == "nonce":
        bad["nonce"] = "00" * 32
    elif forgery == "host":
        bad["host"] = "elsewhere/1"
    elif forgery == "outside dev shm":
        bad["path"] = str(tmp_path / os.path.basename(offer["path"]))
        with open(offer["path"], "rb") as src, open(bad["path"], "wb") as dst:
            dst.write(src.read())  # the right bytes, in the wrong place
    elif forgery == "symlink":
        link = os.path.join(shm.SHM_DIR, "ringreduce-test-link-" + os.urandom(4).hex())
        os.symlink(offer["path"], link)
        bad["path"] = link
    elif forgery == "nonce not text":
        bad["nonce"] = 5
    elif forgery == "hard link":
        second = os.path.join(shm.SHM_DIR, "ringreduce-test-hard-" + os.urandom(4).hex())
        os.link(offer["path"], second)  # another name that could outlive the agreement
        bad["path"] = second
    elif forgery == "others may read it":
        os.chmod(offer["path"], 0o644)
    elif forgery == "missing":
        bad["path"] = offer["path"] + "-gone"
    else:
        bad = "ringreduce"
    try:
        assert shm.open_offer(bad) == -1
    finally:
        if forgery in ("symlink", "hard link"):
            os.unlink(bad["path"])


@pytest.mark.alone
def test_connect_agrees_on_both_links_of_a_ring_of_two(monkeypatch):
    """Two 'ranks' as threads over socket pairs: each link is shared exactly
    when both ends want it, a full /dev/shm keeps the links on TCP, every
    message is read (unread bytes make a later close a reset that drops
    data), and the files are gone from /dev/shm after."""
    import errno
    import threading

    def ring(capacities):
        a_next, b_prev = socket.socketpair()
        b_next, a_prev = socket.socketpair()
        out = [None, None]

        def run(i, to_next, from_prev):
            out[i] = shm.connect(to_next, from_prev, f"t{i}", capacities[i], world.send_msg, world.recv_msg)
        threads = [threading.Thread(target=run, args=(0, a_next, a_prev)),
                   threading.Thread(target=run, args=(1, b_next, b_prev))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for s in (a_next, b_prev, b_next, a_prev):
            with pytest.raises(BlockingIOError):
                s.recv(1, socket.MSG_DONTWAIT)  # nothing left unread
        for s in (a_next, b_prev, b_next, a_prev):
            s.close()
        fds = [fd for pair in out for fd in pair if fd >= 0]
        for fd in fds:
            os.close(fd)
        return [tuple(fd >= 0 for fd in pair) for pair in out]

    before = _ours()
    assert ring([4096, 4096]) == [(True, True), (True, True)]
    assert ring([4096, 0]) == [(False, False), (False, False)]
    assert ring([0, 4096]) == [(False, False), (False, False)]

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    assert ring([4096, 4096]) == [(False, False), (False, False)]
    assert _ours() - before == set()


@pytest.mark.alone
def test_a_link_file_left_by_a_killed_rank_is_removed_by_the_next_maker(tmp_path):
    # A rank SIGKILLed after offering its link file and before its neighbour
    # answered leaves the file under its name (elastic jobs leave such files
    # on their hosts): the next rank to make a file on this host sees its
    # maker is gone and removes it, so none stays in /dev/shm for good.
    from ringreduce.core import shm
    record = tmp_path / "made"
    ranks = run_ranks(2, f"""
        import signal, time
        from ringreduce.core import shm
        make, connect = shm.make_file, shm.connect
        def make_and_record(*a, **k):
            fd, path, nonce = make(*a, **k)
            open({str(record)!r} + str(rr_rank), "w").write(path)
            return fd, path, nonce
        def connect_then_die(to_next, from_prev, tag, capacity, send_msg, recv_msg):
            def recv_and_die(sock):
                if rr_rank == 0:
                    # Rank 1's own make sweeps stale files first: wait until it
                    # has made its file, or it may sweep ours before we look.
                    while not os.path.exists({str(record)!r} + "1"):
                        time.sleep(0.01)
                    os.kill(os.getpid(), signal.SIGKILL)  # the offer is out, the file not yet unlinked
                return recv_msg(sock)
            return connect(to_next, from_prev, tag, capacity, send_msg, recv_and_die)
        rr_rank = int(os.environ["RINGREDUCE_RANK"])
        shm.make_file, shm.connect = make_and_record, connect_then_die
        try:
            rr.init()
        except Exception as exc:
            result = type(exc).__name__
        """, tmp_path, init=False, timeout=40, check=False, env={"RINGREDUCE_TIMEOUT": "5"})
    assert ranks[0].returncode == -9
    left = Path((tmp_path / "made0").read_text())
    assert left.exists(), "the killed rank's file should still be there"
    fd, path, _ = shm.make_file("leftover", 64)  # the next maker on this host
    os.close(fd)
    os.unlink(path)
    assert not left.exists(), f"{left} was left in /dev/shm"
