"""Bad input on one rank (a name that is not a str, a float root, splits
beyond int64, a dtype too long for a header, an unknown op...): that rank
raises its own TypeError/ValueError, every other rank a MismatchError naming
it, never a hang; and the next collective pairs as written on every rank.
Through the numpy API, the background engine, process sets and the eager
TensorFlow layer."""
import pytest

from ranks import run_ranks


# One rank passes a name that is not a str (or cannot be sent: a lone
# surrogate, over 1 MiB): that rank refuses it (its own TypeError or
# ValueError), every other rank raises naming it, and the collective after
# that pairs as written (never one rank's next collective paired with the
# others' current one, every later collective one off).
BAD_NAMES = """
r = rr.rank()
good = np.ones(4, np.float32)
bad = {"int": 5, "bytes": b"x", "surrogate": "\\udc80", "huge": "y" * ((1 << 20) + 1)}[os.environ["BAD"]]
calls = {
    "allreduce": lambda n: rr.allreduce(good, name=n),
    "reduce_scatter": lambda n: rr.reduce_scatter(good, name=n),
    "allgather": lambda n: rr.allgather(good, name=n),
    "broadcast": lambda n: rr.broadcast(good, name=n),
    "alltoall": lambda n: rr.alltoall(np.arange(3.0 * rr.size()), name=n),
    "barrier": lambda n: rr.barrier(name=n),
}
result = {}
for kind, call in calls.items():
    try:
        call(bad if r == 1 else "x")
        got = "returned"
    except (TypeError, ValueError) as e:  # the rank at fault: its own error
        got = ("own", type(e).__name__)
    except rr.MismatchError as e:
        got = ("mismatch", "rank 1" in str(e) and "name" in str(e))
    except Exception as e:
        got = ("other", type(e).__name__, str(e)[:200])
    after = rr.allreduce(np.full(3, r + 1.0, np.float32), name="after " + kind).tolist()
    result[kind] = (got, after)
"""


@pytest.mark.parametrize("bad", ["int", "bytes", "surrogate", "huge"])
def test_a_bad_name_on_one_rank_is_refused_on_every_rank(tmp_path, bad):
    ranks = run_ranks(3, BAD_NAMES, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "10", "BAD": bad})
    for x in ranks:
        for kind, (got, after) in x.result.items():
            want = ("own", "TypeError" if bad in ("int", "bytes") else "ValueError") if x.rank == 1 else ("mismatch", True)
            assert got == want, (x.rank, kind, got)
            assert after == [6.0] * 3, (x.rank, kind, after)


# broadcast(root=0.0): a root that is not an integer is a TypeError on every
# rank, whether or not a rank has a header for root 0 cached (0.0 == 0 as a
# cache key), and the next call pairs; numpy integers stay welcome.
FLOAT_ROOT = """
r = rr.rank()
x = np.full(3, r, np.float32)
result = {}
if os.environ["CACHED"] == "1":  # rank 0 caches a header for root 0, rank 1 for root 1
    try:
        rr.broadcast(x, root=r)
    except rr.MismatchError:
        pass
try:
    rr.broadcast(x, root=float(os.environ["ROOT"]))
    result["bcast"] = "returned"
except TypeError as e:
    result["bcast"] = ("TypeError", "root" in str(e))
except rr.MismatchError as e:
    result["bcast"] = ("MismatchError", "root" in str(e))
except Exception as e:
    result["bcast"] = ("other", type(e).__name__, str(e)[:200])
result["after"] = rr.allreduce(np.full(2, r + 1.0), name="after").tolist()
result["bcast_np_int"] = rr.broadcast(x, root=np.int64(1)).tolist()  # numpy integers stay welcome
"""


@pytest.mark.parametrize("cached", ["0", "1"])
@pytest.mark.parametrize("root", ["0", "1"])
def test_a_float_root_is_a_type_error_on_every_rank_and_the_next_call_pairs(tmp_path, cached, root):
    ranks = run_ranks(2, FLOAT_ROOT, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "10", "CACHED": cached,
                                                              "ROOT": root})
    for x in ranks:
        assert x.result["bcast"] in (("TypeError", True), ("MismatchError", True)), (x.rank, x.result)
        assert x.result["after"] == [3.0, 3.0], (x.rank, x.result)
        assert x.result["bcast_np_int"] == [1.0] * 3


# alltoall splits of uint64 holding 2**63 on one rank (an integer dtype, yet
# beyond int64): that rank's ValueError and the others' MismatchError naming
# it, and the next calls pair (never two unnamed allreduces of one shape
# silently swapped).
HUGE_SPLITS = """
r = rr.rank()
result = {}
try:
    rr.alltoall(np.arange(4.0), splits=np.array([2**63, 4], np.uint64) if r == 1 else [2, 2])
    result["a2a"] = "returned"
except ValueError as e:
    result["a2a"] = ("ValueError", "int64" in str(e))
except rr.MismatchError as e:
    result["a2a"] = ("MismatchError", "rank 1" in str(e) and "int64" in str(e))
except Exception as e:
    result["a2a"] = ("other", type(e).__name__, str(e)[:200])
result["next"] = rr.allreduce(np.full(2, 10.0 * (r + 1))).tolist()
result["next2"] = rr.allreduce(np.full(2, 100.0 * (r + 1))).tolist()
"""


def test_alltoall_splits_beyond_int64_on_one_rank_are_refused_and_the_next_calls_pair(tmp_path):
    ranks = run_ranks(2, HUGE_SPLITS, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "10"})
    assert ranks[1].result["a2a"] == ("ValueError", True), ranks[1].result
    assert ranks[0].result["a2a"] == ("MismatchError", True), ranks[0].result
    for x in ranks:
        assert x.result["next"] == [30.0, 30.0] and x.result["next2"] == [300.0, 300.0], (x.rank, x.result)


# A structured dtype too long to describe in a header (over 64 KiB of text)
# on one rank: that rank refuses it up front (TypeError), the others raise
# MismatchError naming it, and the next calls pair.
HUGE_DTYPE = """
r = rr.rank()
huge = np.dtype([(f"field{i}", "u1") for i in range(6000)])
x = np.zeros(2, huge) if r == 1 else np.zeros(2, np.uint8)
result = {}
try:
    rr.allgather(x)
    result["ag"] = "returned"
except TypeError as e:
    result["ag"] = ("TypeError", "too complex" in str(e))
except rr.MismatchError as e:
    result["ag"] = ("MismatchError", "rank 1" in str(e) and "too complex" in str(e))
except Exception as e:
    result["ag"] = ("other", type(e).__name__, str(e)[:200])
result["next"] = rr.allreduce(np.full(2, 10.0 * (r + 1))).tolist()
result["next2"] = rr.allreduce(np.full(2, 100.0 * (r + 1))).tolist()
"""


def test_a_dtype_too_long_for_the_header_on_one_rank_is_refused_and_the_next_calls_pair(tmp_path):
    ranks = run_ranks(2, HUGE_DTYPE, tmp_path, timeout=60, env={"RINGREDUCE_TIMEOUT": "10"})
    assert ranks[1].result["ag"] == ("TypeError", True), ranks[1].result
    assert ranks[0].result["ag"] == ("MismatchError", True), ranks[0].result
    for x in ranks:
        assert x.result["next"] == [30.0, 30.0] and x.result["next2"] == [300.0, 300.0], (x.rank, x.result)


# An unnamed eager TF collective refused on one rank before the op is made
# (root_rank not a rank, op=Adasum, splits of floats) still takes its number
# in that rank's per-kind numbering (naming.collective_name) and is refused
# under it: the others raise MismatchError naming it at once, and the next
# broadcast pairs with the others' next one (never returning the wrong
# tensor without an error).
TF_EAGER_REFUSAL = """
import threading
import tensorflow as tf
import ringreduce.tensorflow as hvd
hvd.init()
r = hvd.rank()
result = {}
def attempt(tag, f):
    try:
        result[tag] = f()
    except hvd.MismatchError as e:
        result[tag] = ("mismatch", "rank 1" in str(e) and "bad input" in str(e))
    except (ValueError, TypeError, NotImplementedError) as e:
        result[tag] = ("own", type(e).__name__)
attempt("root", lambda: hvd.broadcast(tf.constant([1.0 + r]), root_rank=5 if r == 1 else 0).numpy().tolist())
attempt("bcast2", lambda: hvd.broadcast(tf.constant([10.0 + r]), root_rank=1).numpy().tolist())
attempt("bcast3", lambda: hvd.broadcast(tf.constant([20.0 + r]), root_rank=1).numpy().tolist())
attempt("adasum", lambda: hvd.allreduce(tf.constant([1.0]), op=hvd.Adasum if r == 1 else hvd.Sum).numpy().tolist())
attempt("allreduce2", lambda: hvd.allreduce(tf.constant([1.0 + r]), op=hvd.Sum).numpy().tolist())
attempt("splits", lambda: hvd.alltoall(tf.constant([1.0, 2.0]), splits=tf.constant([1.0, 1.0]) if r == 1
                                       else tf.constant([1, 1]))[0].numpy().tolist())
attempt("alltoall2", lambda: hvd.alltoall(tf.constant([1.0 + r, 5.0 + r])).numpy().tolist())
attempt("object_root", lambda: hvd.broadcast_object({"r": r}, root_rank=5 if r == 1 else 0))
attempt("object2", lambda: hvd.broadcast_object({"second": r}, root_rank=1))
attempt("object3", lambda: hvd.broadcast_object({"third": r}, root_rank=1))
attempt("unpicklable", lambda: hvd.allgather_object(threading.Lock() if r == 1 else r))
attempt("gathered", lambda: hvd.allgather_object(r))
"""


def test_an_eager_tf_collective_refused_on_one_rank_keeps_the_numbering_in_step(tmp_path):
    pytest.importorskip("tensorflow")
    ranks = run_ranks(2, TF_EAGER_REFUSAL, tmp_path, timeout=180, env={"RINGREDUCE_TIMEOUT": "20"})
    # A refused argument is hvd.InvalidArgumentError (a ValueError and TypeError, caught as such above).
    want_own = {"root": ("own", "InvalidArgumentError"), "adasum": ("own", "NotImplementedError"),
                "splits": ("own", "InvalidArgumentError")}
    for x in ranks:
        for tag in want_own:
            assert x.result[tag] == (want_own[tag] if x.rank == 1 else ("mismatch", True)), (x.rank, tag, x.result)
        assert x.result["bcast2"] == [11.0] and x.result["bcast3"] == [21.0], (x.rank, x.result)
        assert x.result["allreduce2"] == [3.0], (x.rank, x.result)
        assert x.result["alltoall2"] == ([1.0, 2.0] if x.rank == 0 else [5.0, 6.0]), (x.rank, x.result)
        assert x.result["object_root"] == (("own", "InvalidArgumentError") if x.rank == 1 else ("mismatch", True))
        assert x.result["object2"] == {"second": 1} and x.result["object3"] == {"third": 1}, (x.rank, x.result)
        assert x.result["unpicklable"] == (("own", "InvalidArgumentError") if x.rank == 1 else ("mismatch", True))
        assert x.result["gathered"] == [0, 1], (x.rank, x.result)


# Bad input on one rank only: that rank raises its own TypeError/ValueError
# before any data moves. The others must not pair their collective with that
# rank's next one (it ran ahead): they raise MismatchError naming it, and the
# ring stays usable for the next collective on every rank.
ONE_RANK_MISTAKES = {
    "unknown op": "rr.allreduce(np.ones(3), op='mean' if bad else 'sum')",
    "unsupported dtype": "rr.allreduce(np.ones(3, np.complex64 if bad else np.float32))",
    "wrong out": "rr.allreduce(np.ones(3), out=np.ones(4) if bad else None)",
    "read-only out": "rr.allreduce(np.ones(3), out=ro if bad else None)",
    "ragged list": "rr.allreduce([[1.0], [2.0, 3.0]] if bad else np.ones(2))",
    "large unsupported dtype": "rr.allreduce(np.ones(100_000, np.uint32 if bad else np.float32))",
    "reduce_scatter op": "rr.reduce_scatter(np.ones(4), op='avg ' if bad else 'avg')",
    "allgather object": "rr.allgather(np.array([None], object) if bad else np.ones(1))",
    "broadcast root": "rr.broadcast(np.ones(3), root=7 if bad else 0)",
    "alltoall 0-d": "rr.alltoall(np.float32(1) if bad else np.ones(rr.size()))",
    "alltoall float splits": "rr.alltoall(np.ones(2), splits=[1.0, 1.0] if bad else [1, 1])",
}


@pytest.mark.parametrize("mistake", sorted(ONE_RANK_MISTAKES))
def test_bad_input_on_one_rank_raises_on_every_rank(tmp_path, mistake):
    call = ONE_RANK_MISTAKES[mistake]
    results = run_ranks(2, f"""
        bad = rr.rank() == 1
        ro = np.ones(3)
        ro.flags.writeable = False
        try:
            {call}
            first = "no error"
        except rr.MismatchError as e:
            first = "MismatchError: " + str(e)
        except (TypeError, ValueError) as e:
            first = "own: " + type(e).__name__
        after = rr.allreduce(np.full(2, rr.rank() + 1.0), name="after").tolist()
        result = first, after
    """, tmp_path, timeout=60)
    (good, good_after), (bad, bad_after) = (r.result for r in results)
    assert bad.startswith("own: "), bad
    assert good.startswith("MismatchError: ") and "rank 1" in good, good
    assert good_after == bad_after == [3.0, 3.0]


def test_same_bad_input_on_every_rank_raises_the_same_error_everywhere(tmp_path):
    results = run_ranks(2, """
        try:
            rr.allreduce(np.ones(3), op="mean")
        except ValueError as e:
            first = str(e)
        result = first, rr.allreduce(np.ones(2)).tolist()
    """, tmp_path, timeout=60)
    assert [r.result for r in results] == [("unknown op 'mean'; choose one of sum, prod, min, max, avg", [2.0, 2.0])] * 2


ENGINE_MISTAKES = {
    "unsupported dtype": "e.enqueue('g', np.ones(3, np.complex64 if bad else np.float32), op='avg')",
    "unknown op": "e.enqueue('g', np.ones(3), op='mean' if bad else 'avg')",
    "broadcast root": "e.enqueue('g', np.ones(3), kind='broadcast', root=5 if bad else 0)",
}


@pytest.mark.parametrize("mistake", sorted(ENGINE_MISTAKES))
def test_bad_input_on_one_rank_fails_at_once_in_the_engine(tmp_path, mistake):
    """The same through the background engine (the TF layer's path): the
    others fail that tensor at once, naming the rank, not after waiting
    RINGREDUCE_TIMEOUT for a tensor "never submitted"."""
    results = run_ranks(2, f"""
        import time
        from ringreduce.engine import engine
        e = engine()
        bad = rr.rank() == 1
        t0 = time.monotonic()
        try:
            e.wait({ENGINE_MISTAKES[mistake]})
            first = "no error"
        except rr.MismatchError as exc:
            first = "MismatchError: " + str(exc)
        except (TypeError, ValueError) as exc:
            first = "own: " + type(exc).__name__
        took = time.monotonic() - t0
        after = e.wait(e.enqueue("after", np.full(2, rr.rank() + 1.0), op="sum")).tolist()
        result = first, took, after
    """, tmp_path, timeout=90, env={"RINGREDUCE_TIMEOUT": "30"})
    (good, took, good_after), (bad, _, bad_after) = (r.result for r in results)
    assert bad.startswith("own: "), bad
    assert good.startswith("MismatchError: ") and "rank 1" in good, good
    assert took < 15, took
    assert good_after == bad_after == [3.0, 3.0]


def test_the_same_bad_input_on_every_rank_leaves_the_engine_working(tmp_path):
    results = run_ranks(2, """
        from ringreduce.engine import engine
        e = engine()
        try:
            e.enqueue("g", np.ones(3), op="mean")
        except ValueError as exc:
            first = str(exc)
        result = first, e.wait(e.enqueue("g", np.ones(2), op="sum")).tolist()
    """, tmp_path, timeout=60)
    assert [r.result for r in results] == [("unknown op 'mean'; choose one of sum, prod, min, max, avg", [2.0, 2.0])] * 2


def test_bad_input_on_one_member_of_a_process_set_raises_on_the_others(tmp_path):
    results = run_ranks(3, """
        ps = rr.add_process_set([0, 1])
        if ps.included():
            try:
                rr.allreduce(np.ones(3, np.complex64 if rr.rank() == 1 else np.float32), process_set=ps)
                first = "no error"
            except rr.MismatchError as exc:
                first = "MismatchError: " + str(exc)
            except TypeError:
                first = "own"
        else:
            first = "not a member"
        result = first, rr.allreduce(np.ones(2)).tolist()
    """, tmp_path, timeout=60)
    got = [r.result for r in results]
    assert got[0][0].startswith("MismatchError: ") and "rank 1" in got[0][0], got
    assert [g[0] for g in got[1:]] == ["own", "not a member"]
    assert all(g[1] == [3.0, 3.0] for g in got)
