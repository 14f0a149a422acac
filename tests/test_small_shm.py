"""The host arena (csrc/schedule/host_arena.c): small allreduces and header passes
among ranks of one host meet in one shared mapping instead of going around
the ring. Results against numpy and bit-identical to the ring's small path
(the same rank-order reduction), across ranks too; mismatches named; a rank
lost while the others wait in the arena named within seconds; the arena's
file gone from /dev/shm once agreed; process sets; the fallback when the
ranks are on different hosts."""
import signal

import pytest

from ranks import run_ranks

# Every dtype and op, sizes 0, 1, < N, odd, and up to the arena's limit, once
# through the arena and once around the ring (use_arena(False)): the same
# bits, the same on every rank, close to numpy's reduction of all inputs.
CORRECTNESS = """
    import hashlib, ml_dtypes
    from ringreduce.core import collectives as c
    comm, N, r = c.communicator().comm, rr.size(), rr.rank()
    limit = c.communicator().small_limit
    assert comm.arena_slot > 0 and limit >= 256 << 10, (comm.arena_slot, limit)
    dtypes = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16,
              np.int32, np.int64]
    digest, problems = hashlib.sha256(), []

    def inputs(rank, n, dtype):
        g = np.random.default_rng(1000 * rank + n)
        if np.dtype(dtype).kind in "iu":
            return g.integers(-3 if np.dtype(dtype).kind == "i" else 0, 4, n).astype(dtype)
        return (g.random(n) + 0.5).astype(dtype)

    for dtype in dtypes:
        sizes = [0, 1, N - 1, 1001, limit // np.dtype(dtype).itemsize]
        for op in ["sum", "prod", "min", "max", "avg"]:
            for n in sizes:
                x = inputs(r, n, dtype)
                before = comm.bytes_via()[:3]  # over sockets, shared-memory links, CMA: not the arena
                got = rr.allreduce(x, op=op)
                if comm.bytes_via()[:3] != before:
                    problems.append(f"{dtype} {op} {n}: the data went around the ring")
                comm.use_arena(False)
                ring = rr.allreduce(x, op=op)
                comm.use_arena(True)
                if got.tobytes() != ring.tobytes():
                    problems.append(f"{dtype} {op} {n}: arena and ring differ")
                every = np.stack([inputs(k, n, dtype).astype(np.float64) for k in range(N)])
                want = {"sum": every.sum(0), "prod": every.prod(0), "min": every.min(0), "max": every.max(0),
                        "avg": every.mean(0)}[op]
                if np.dtype(dtype).kind in "iu":
                    want = want.astype(dtype) if op != "avg" else None  # integer avg rounds as the kernel says
                tol = {2: 2e-2, 4: 1e-5, 8: 1e-12}.get(np.dtype(dtype).itemsize, 0)
                floating = dtype is ml_dtypes.bfloat16 or np.dtype(dtype).kind == "f"
                if want is not None and floating:
                    if not np.allclose(got.astype(np.float64), want, rtol=tol * 4, atol=tol):
                        problems.append(f"{dtype} {op} {n}: off from numpy")
                elif want is not None and got.tobytes() != want.tobytes():
                    problems.append(f"{dtype} {op} {n}: differs from numpy")
                digest.update(got.tobytes())
    result = (problems, digest.hexdigest())
"""


def _assert_no_problems_and_the_same_bits(ranks):
    """Each rank's job returns (problems it found, a digest of every result)."""
    for r in ranks:
        assert r.result[0] == [], f"rank {r.rank}: {r.result[0][:5]}"
    assert len({r.result[1] for r in ranks}) == 1, "ranks ended with different bits"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_arena_matches_numpy_and_the_ring_bit_for_bit(tmp_path, n):
    ranks = run_ranks(n, CORRECTNESS, tmp_path, timeout=80)
    _assert_no_problems_and_the_same_bits(ranks)


# The arena's ways of reducing (Comm.use_arena's modes, csrc/schedule/host_arena.h):
# copy (the first version), direct (straight into the output, the rank's own
# term from its input), split (each rank folds its 1/N slice, a second round
# shares it), auto. Every dtype and op, odd sizes (slices of uneven length,
# fewer elements than ranks, a slot filled to its limit), out of place and in
# place (out=x: the own term then comes from the arena): the same bits in
# every way, on every rank, and as the ring's small path.
MODES = """
    import hashlib, ml_dtypes
    from ringreduce.core import collectives as c, shm
    comm, N, r = c.communicator().comm, rr.size(), rr.rank()
    limit = c.communicator().small_limit
    dtypes = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16,
              np.int32, np.int64]
    digest, problems = hashlib.sha256(), []

    def inputs(rank, n, dtype):
        g = np.random.default_rng(7000 * rank + n)
        if np.dtype(dtype).kind in "iu":
            return g.integers(-9 if np.dtype(dtype).kind == "i" else 0, 10, n).astype(dtype)
        x = (g.random(n) * 4 - 2).astype(dtype)
        if n > 40:  # NaN and infinities where min/max and sums must agree on them
            x[[3, 17, 29]] = np.array([np.nan, np.inf, -np.inf]).astype(dtype)[[r % 3, (r + 1) % 3, (r + 2) % 3]]
        return x

    for dtype in dtypes:
        size = np.dtype(dtype).itemsize
        for op in ["sum", "prod", "min", "max", "avg"]:
            for n in [0, 1, N - 1, N + 1, 17, 4099, (57344 // size) - 3, (65536 // size) + 5, limit // size]:
                x = inputs(r, n, dtype)
                comm.use_arena(0)
                want = rr.allreduce(x, op=op).tobytes()
                for mode in ["copy", "direct", "split", "auto"]:
                    comm.use_arena(shm.ARENA_MODES[mode])
                    got = rr.allreduce(x, op=op)
                    inplace = x.copy()
                    rr.allreduce(inplace, op=op, out=inplace)
                    for how, y in (("out of place", got), ("in place", inplace)):
                        if y.tobytes() != want:
                            problems.append(f"{dtype.__name__} {op} {n} {mode} {how}: differs from the ring")
                digest.update(want)
    comm.use_arena(shm.ARENA_MODES["auto"])
    result = (problems, digest.hexdigest())
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_way_of_reducing_in_the_arena_gives_the_same_bits(tmp_path, n):
    ranks = run_ranks(n, MODES, tmp_path, timeout=100)
    _assert_no_problems_and_the_same_bits(ranks)


def test_ranks_that_differ_in_arena_reduce_still_agree(tmp_path):
    """RINGREDUCE_ARENA_REDUCE differs by rank: the split happens only
    where every rank offers it, so nobody waits for a second round that
    never comes, and the bits are the ring's; mismatches are still named."""
    ranks = run_ranks(3, """
        os.environ["RINGREDUCE_ARENA_REDUCE"] = ["split", "direct", "auto"][int(os.environ["RINGREDUCE_RANK"])]
        rr.init()
        from ringreduce.core import collectives as c
        x = np.random.default_rng(rr.rank()).random(50001).astype(np.float32)
        got = rr.allreduce(x)
        c.communicator().comm.use_arena(0)
        want = rr.allreduce(x)
        c.communicator().comm.use_arena(1)
        try:
            rr.allreduce(np.ones(70000 if rr.rank() == 2 else 60000, np.float32))
            mismatch = "no error"
        except rr.MismatchError as e:
            mismatch = str(e)
        result = (c.communicator().comm.arena_slot > 0, got.tobytes() == want.tobytes(), mismatch)
    """, tmp_path, timeout=60, init=False)
    for r in ranks:
        in_arena, same, mismatch = r.result
        assert in_arena and same, r.result
        assert "rank 2" in mismatch, mismatch


def test_a_bad_arena_reduce_is_refused():
    from ringreduce.core import config
    with pytest.raises(ValueError, match="RINGREDUCE_ARENA_REDUCE"):
        config.Config.from_env({"RINGREDUCE_ARENA_REDUCE": "fast"})
    assert config.Config.from_env({"RINGREDUCE_ARENA_REDUCE": "split"}).arena_reduce == "split"


def test_mismatches_name_the_same_rank_everywhere(tmp_path):
    """Shape, dtype and op mismatches, and a rank whose tensor is too big for
    its slot while the others' fit: MismatchError naming rank 1 on every
    rank, and the communicator still works."""
    ranks = run_ranks(3, """
        from ringreduce.core import collectives as c
        errors = []
        cases = [lambda: rr.allreduce(np.ones(5 if rr.rank() == 1 else 4, np.float32)),
                 lambda: rr.allreduce(np.ones(4, np.float64 if rr.rank() == 1 else np.float32)),
                 lambda: rr.allreduce(np.ones(4, np.float32), op="max" if rr.rank() == 1 else "sum"),
                 lambda: rr.allreduce(np.ones((1 << 20) if rr.rank() == 1 else 4, np.float32))]
        for case in cases:
            try:
                case()
                errors.append("no error")
            except rr.MismatchError as e:
                errors.append(str(e))
        result = (c.communicator().comm.arena_slot > 0, errors, rr.allreduce(np.ones(3)).tolist())
    """, tmp_path, timeout=60)
    for r in ranks:
        in_arena, errors, after = r.result
        assert in_arena
        assert all("rank 1" in e for e in errors), f"rank {r.rank}: {errors}"
        assert after == [3.0] * 3
    assert len({tuple(r.result[1]) for r in ranks}) == 1, "ranks explained the mismatch differently"


KILLED = """
    import signal, time
    from ringreduce.core import collectives as c
    assert c.communicator().comm.arena_slot > 0
    rr.allreduce(np.ones(4))
    if rr.rank() == {victim}:
        time.sleep(0.5)  # the others are waiting in the arena by now
        os.kill(os.getpid(), signal.{how})
    t0 = time.time()
    try:
        rr.allreduce(np.ones(1000, np.float32))
        result = "no error"
    except rr.PeerLostError as e:
        result = (e.rank, str(e), time.time() - t0)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_rank_killed_mid_wait_is_named_within_seconds(tmp_path, how):
    """Rank 1 of 4 dies while the others wait for it in the arena: each of
    them (neighbours through the link's EOF, the others through rank 0's
    star) raises PeerLostError naming rank 1, long before the timeout."""
    ranks = run_ranks(4, KILLED.format(victim=1, how=how), tmp_path, timeout=60,
                      env={"RINGREDUCE_TIMEOUT": "20"}, check=False)
    assert ranks[1].returncode == -getattr(signal, how)
    for r in ranks:
        if r.rank == 1:
            continue
        assert r.returncode == 0, r.stderr[-2000:]
        lost, message, elapsed = r.result
        assert lost == 1 and "rank 1" in message, f"rank {r.rank} blamed {lost}: {message}"
        assert elapsed < 10, f"rank {r.rank} took {elapsed:.1f} s (RINGREDUCE_TIMEOUT=20)"


def test_a_silent_rank_is_named_after_the_timeout(tmp_path):
    ranks = run_ranks(3, """
        import time
        rr.allreduce(np.ones(4))
        t0 = time.time()
        if rr.rank() == 2:
            time.sleep(6)
        try:
            rr.allreduce(np.ones(4))
            result = "no error"
        except rr.PeerLostError as e:
            result = (e.rank, str(e), time.time() - t0)
    """, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "1.5"}, check=False)
    for r in ranks[:2]:
        assert r.returncode == 0, r.stderr[-2000:]
        lost, message, elapsed = r.result
        assert lost == 2 and "RINGREDUCE_TIMEOUT" in message, message
        assert 1.4 < elapsed < 6, elapsed


# The arena's file, as rank 0 made it: gone from /dev/shm as soon as every
# rank agreed, so neither shutdown nor a crash can leave it behind.
FILE_GONE = """
    import signal, time
    from ringreduce.core import shm
    made = []
    make = shm.make_file
    shm.make_file = lambda tag, *a, **k: made.append(make(tag, *a, **k)) or made[-1]
    rr.init()
    paths = [m[1] for m in made if "arena" in m[1]]
    assert (len(paths) == 1) == (rr.rank() == 0), paths
    gone = [not os.path.exists(p) for p in paths]
    rr.allreduce(np.ones(8))
    if rr.rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        rr.allreduce(np.ones(8))
    except rr.PeerLostError:
        pass
    rr.shutdown()
    result = (paths, gone)
"""


def test_the_arena_file_is_gone_after_init_and_after_a_crash(tmp_path):
    import os
    ranks = run_ranks(3, FILE_GONE, tmp_path, timeout=60, init=False, check=False)
    paths, gone = ranks[0].result
    assert len(paths) == 1 and all(gone)
    assert not os.path.exists(paths[0])
    assert ranks[2].returncode == -signal.SIGKILL


def test_ranks_on_different_hosts_keep_the_ring(tmp_path):
    """One rank claims another host: nobody takes the arena, and the small
    path still works (around the ring)."""
    ranks = run_ranks(3, """
        from ringreduce.core import shm, collectives as c
        if os.environ["RINGREDUCE_RANK"] == "1":
            shm.host_identity = lambda: "elsewhere/0"
        rr.init()
        before = sum(c.communicator().comm.bytes_via()[:3])  # over sockets, shared-memory links, CMA: not the arena
        out = rr.allreduce(np.arange(5.0) * (rr.rank() + 1))
        result = (c.communicator().comm.arena_slot, sum(c.communicator().comm.bytes_via()[:3]) > before, out.tolist())
    """, tmp_path, timeout=60, init=False)
    for r in ranks:
        assert r.result == (0, True, [0.0, 6.0, 12.0, 18.0, 24.0])


@pytest.mark.parametrize("reduce", ["auto", "split"])
def test_process_sets_get_their_own_arena(tmp_path, reduce):
    """A set's ring on one host has its own arena; sets and the world
    interleave, every result right and bit-identical among members (split:
    each set's arena takes its second round too)."""
    ranks = run_ranks(4, """
        import hashlib
        from ringreduce.core import collectives as c
        a, b = rr.add_process_set([0, 2, 3]), rr.add_process_set([1, 3])
        digests, arenas = {}, []
        for ps, members in ((a, [0, 2, 3]), (b, [1, 3])):
            if rr.rank() in members:
                arenas.append(c.ring_of(ps).comm._comm.arena_slot > 0)
        for i in range(20):
            x = np.random.default_rng(i * 10 + rr.rank()).random(1000 + i).astype(np.float32)
            for ps, members in ((a, [0, 2, 3]), (None, [0, 1, 2, 3]), (b, [1, 3])):
                if rr.rank() not in members:
                    continue
                got = rr.allreduce(x, process_set=ps)
                want = sum(np.random.default_rng(i * 10 + k).random(1000 + i).astype(np.float32) for k in members)
                assert np.allclose(got, want, rtol=1e-5), (i, members)
                digests.setdefault(repr(members), hashlib.sha256()).update(got.tobytes())
        result = (arenas, {k: v.hexdigest() for k, v in digests.items()})
    """, tmp_path, timeout=60, env={"RINGREDUCE_ARENA_REDUCE": reduce})
    for r in ranks:
        assert r.result[0] and all(r.result[0]), f"rank {r.rank}: {r.result[0]}"
    for members in ([0, 2, 3], [0, 1, 2, 3], [1, 3]):
        assert len({ranks[k].result[1][repr(members)] for k in members}) == 1, f"set {members} differs"


def test_ranks_that_disagree_on_the_arena_keep_the_ring(tmp_path):
    """Rank 2 wants no arena (RINGREDUCE_ARENA_BYTES=0) and rank 1 another
    size: nobody gets one, nobody hangs in the agreement."""
    ranks = run_ranks(3, """
        arena = {"1": "65536", "2": "0"}.get(os.environ["RINGREDUCE_RANK"])
        if arena is not None:
            os.environ["RINGREDUCE_ARENA_BYTES"] = arena
        rr.init()
        from ringreduce.core import collectives as c
        result = (c.communicator().comm.arena_slot, rr.allreduce(np.ones(3)).tolist())
    """, tmp_path, timeout=60, init=False)
    for r in ranks:
        assert r.result == (0, [3.0] * 3)


# A rank that publishes its part, finishes the round and leaves at once (its
# links closed) must not be blamed by a rank that was asleep waiting for that
# part: the waiter looks at the arena again before blaming (host_arena.c,
# has_arrived). Rank 0 comes late to every round, so rank 3 (its ring
# neighbour) is asleep when rank 0 publishes and shuts down.
LEAVING_RIGHT_AFTER_THE_ROUND = """
    import time
    r, N, ok = rr.rank(), rr.size(), 0
    for i in range(25):
        if r == 0:
            time.sleep(0.004)
        got = rr.allreduce(np.ones(8, np.float32))
        assert got[0] == N, got
        rr.shutdown()
        rr.init()
        ok += 1
    result = ok
"""


@pytest.mark.parametrize("reduce", ["auto", "split"])
def test_a_rank_leaving_right_after_its_round_is_not_blamed(tmp_path, reduce):
    """split: the round a rank leaves right after is the second one."""
    ranks = run_ranks(4, LEAVING_RIGHT_AFTER_THE_ROUND, tmp_path, timeout=150,
                      env={"RINGREDUCE_ARENA_REDUCE": reduce})
    assert [x.result for x in ranks] == [25] * 4


def test_arena_edges_zero_bytes_the_limit_and_one_rank_one_element_over(tmp_path):
    # The host arena's edges: zero bytes, exactly the limit, one element over. A tensor one element over the arena on one
    # rank only is a shape mismatch named alike everywhere, after which the
    # arena (and a process set's own arena) keeps working.
    ranks = run_ranks(3, """
        from ringreduce.core import collectives as C
        r, limit = rr.rank(), 256 << 10  # RINGREDUCE_ARENA_BYTES's default
        out = {"arena": C.communicator().comm.arena_slot > 0, "limit": C.communicator().ring.allreduce_limit == limit}
        out["zero"] = rr.allreduce(np.zeros(0, np.float32)).shape
        out["at"] = float(rr.allreduce(np.full(limit // 4, r + 1.0, np.float32)).min())
        try:
            rr.allreduce(np.ones(limit // 4 + (r == 1), np.float32))
            out["over"] = "no error"
        except rr.MismatchError as exc:
            out["over"] = str(exc)
        out["after"] = rr.allreduce(np.full(5, r + 1.0)).tolist()
        ps = rr.add_process_set([0, 2])
        if r in (0, 2):
            out["set"] = float(rr.allreduce(np.full(limit // 4, r + 1.0, np.float32), process_set=ps).max())
            out["set_arena"] = C.communicator().sets[ps.process_set_id].comm.arena_slot > 0
        result = out
        """, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "20"})
    for k in ranks:
        res = k.result
        assert res["arena"] and res["limit"] and res["zero"] == (0,) and res["at"] == 6.0, (k.rank, res)
        assert "rank 0: (65536,), rank 1: (65537,), rank 2: (65536,)" in res["over"], res["over"]
        assert res["after"] == [6.0] * 5
        if k.rank != 1:
            assert res["set"] == 4.0 and res["set_arena"], (k.rank, res)
