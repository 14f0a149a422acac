"""TF1 graphs (tf.compat.v1 Session, graph mode outside tf.function): every
collective is an asynchronous op (ringreduce/tensorflow/async_op.py) that
holds no TensorFlow thread while it waits, paired across ranks by name.

The case that deadlocked the blocking hand-over: more independent
collectives than the Session has inter-op threads, started in a different
order on each rank (12 allreduces on 2 threads here; the blocking
numpy_function hand-over hangs on it)."""
import os
import textwrap

import numpy as np
import pytest

from ranks import run_ranks

tf = pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

PRELUDE = """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import ringreduce.tensorflow as rrtf
    rrtf.init()
    r, n = rr.rank(), rr.size()
    # Two inter-op threads, fewer than the collectives in flight: a
    # collective that held its thread while waiting would deadlock.
    CONFIG = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)
"""
NAMED = 12


def session_cxx() -> dict:
    """The session's compiler command (conftest.py: one compile of the op per run), for a child given an env of its own."""
    return {k: os.environ[k] for k in ("CXX", "RR_TEST_CXX_CACHE") if k in os.environ}


def job(body: str) -> str:
    return textwrap.dedent(PRELUDE) + textwrap.dedent(body)


@pytest.fixture(scope="module", autouse=True)
def built_op():
    """Compiles the op once here, so the ranks' time limits do not pay for it."""
    from ringreduce.tensorflow import async_op
    return async_op.build()


def expected(r: int, n: int) -> dict:
    """What every rank must get, from numpy alone."""
    ranks = range(n)
    gathered = np.concatenate([np.full((q + 1, 3), q * 1000 - 7, np.int16) for q in ranks])
    rows = 7  # reducescatter: 7 rows split over n ranks, the first 7 % n get one more
    base, extra = divmod(rows, n)
    lo = r * base + min(r, extra)
    hi = lo + base + (1 if r < extra else 0)
    summed = sum(np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * (q + 1) for q in ranks)
    out = {f"named{i}": np.full(100 + i, float(sum(q + 10 * i for q in ranks)), np.float32) for i in range(NAMED)}
    out.update(
        gathered=gathered,
        broadcast=np.array([[True, False, True]]) if (1 % n) % 2 else np.array([[False, True, False]]),
        average_int=np.full(5, sum(3 * q + 1 for q in ranks) // n, np.int32),
        scattered=summed[lo:hi],
        grouped_max=[np.full(4, n - 1, np.int32), np.full(2, float(n - 1), np.float64)],
        # rank q sends q + 1 + p rows of value 100 q + p to rank p
        alltoall=np.concatenate([np.full((q + 1 + r, 2), 100 * q + r, np.float32) for q in ranks]),
        alltoall_splits=np.array([q + 1 + r for q in ranks], np.int32),
        uint16_sum=np.full(3, sum(q * 1000 for q in ranks), np.uint16),
    )
    if n == 3 and r != 1:
        out["evens"] = np.full(2, 4.0, np.float32)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_independent_collectives_in_a_session_pair_by_name_in_any_order(tmp_path, n):
    ranks = run_ranks(n, job(f"""
        NAMED = {NAMED}
        with tf.Graph().as_default():
            fetch = {{}}
            # Named collectives, created (and so started) in a different order on each rank.
            order = list(range(NAMED))
            order = order[r * 5 % NAMED:] + order[:r * 5 % NAMED]
            if r % 2:
                order.reverse()
            for i in order:
                x = tf.fill([100 + i], float(r + 10 * i))
                fetch[f"named{{i}}"] = rrtf.allreduce(x, op=rrtf.Sum, name=f"named{{i}}")
            # Unnamed ones: named by their place in the graph, built in the same order everywhere.
            fetch["gathered"] = rrtf.allgather(tf.fill([r + 1, 3], tf.constant(r * 1000 - 7, tf.int16)))
            mine = tf.constant([[True, False, True]] if r % 2 else [[False, True, False]])
            fetch["broadcast"] = rrtf.broadcast(mine, root_rank=1 % n)
            fetch["average_int"] = rrtf.allreduce(tf.fill([5], 3 * r + 1), op=rrtf.Average)
            fetch["scattered"] = rrtf.reducescatter(tf.reshape(tf.range(14, dtype=tf.float64), [7, 2]) * (r + 1),
                                                    op=rrtf.Sum)
            fetch["grouped_max"] = rrtf.grouped_allreduce(
                [tf.fill([4], r), tf.fill([2], tf.constant(float(r), tf.float64))], op=rrtf.Max)
            splits = tf.constant([r + 1 + p for p in range(n)], tf.int32)
            rows = tf.concat([tf.fill([r + 1 + p, 2], float(100 * r + p)) for p in range(n)], 0)
            fetch["alltoall"], fetch["alltoall_splits"] = rrtf.alltoall(rows, splits)
            fetch["uint16_sum"] = rrtf.allreduce(tf.fill([3], tf.constant(r * 1000, tf.uint16)), op=rrtf.Sum)
            if n == 3:  # a process set of ranks 0 and 2: rank 1 builds nothing for it
                evens = rrtf.add_process_set([0, 2])
                if r != 1:
                    fetch["evens"] = rrtf.allreduce(tf.fill([2], float(r + 1)), op=rrtf.Sum, process_set=evens)
            static = {{k: v.shape.as_list() for k, v in fetch.items() if hasattr(v, "shape")}}
            with tf.compat.v1.Session(config=CONFIG) as sess:
                steps = [sess.run(fetch) for _ in range(3)]  # repeated: the engine's cache in use
        result = (steps, static)
    """), tmp_path, init=False, timeout=240)
    for rank in ranks:
        steps, static = rank.result
        want = expected(rank.rank, n)
        for step in steps:
            assert sorted(step) == sorted(want)
            for key, value in want.items():
                got = step[key]
                for g, w in (zip(got, value) if isinstance(value, list) else [(got, value)]):
                    assert g.dtype == w.dtype and g.shape == w.shape, (rank.rank, key, g.dtype, g.shape, w.shape)
                    assert np.array_equal(g, w), (rank.rank, key, g, w)
        # Shapes TensorFlow knows before running: kept from the inputs, dim 0 unknown where ranks may differ.
        assert static["named3"] == [103] and static["gathered"] == [None, 3] and static["broadcast"] == [1, 3]
        assert static["alltoall"] == [None, 2] and static["alltoall_splits"] == [n]
    # Every rank ends with bit-identical results where they must agree.
    for key in ("gathered", "broadcast", "average_int", "uint16_sum"):
        assert all(np.array_equal(r.result[0][0][key], ranks[0].result[0][0][key]) for r in ranks)


@pytest.mark.slow
def test_gradients_in_a_tf1_graph_are_horovods(tmp_path):
    n = 3
    ranks = run_ranks(n, job("""
        with tf.Graph().as_default():
            x = tf.fill([4], float(r + 1))
            rows = tf.fill([r + 1, 2], float(r))
            weights = tf.reshape(tf.range(2 * sum(range(1, n + 1)), dtype=tf.float32), [-1, 2])
            table = tf.reshape(tf.range(12, dtype=tf.float32), [6, 2])
            splits = tf.constant([1] * n, tf.int32)
            losses = {
                "allreduce_sum": tf.reduce_sum(rrtf.allreduce(x, op=rrtf.Sum) * (r + 1)),
                "allreduce_avg": tf.reduce_sum(rrtf.allreduce(x, op=rrtf.Average) * (r + 1)),
                "allgather": tf.reduce_sum(rrtf.allgather(rows) * weights),
                "broadcast": tf.reduce_sum(rrtf.broadcast(x, root_rank=1) * (r + 1)),
                "reducescatter": tf.reduce_sum(rrtf.reducescatter(table, op=rrtf.Sum) * (r + 1)),
            }
            inputs = {"allreduce_sum": x, "allreduce_avg": x, "allgather": rows, "broadcast": x,
                      "reducescatter": table}
            grads = {k: tf.compat.v1.gradients(losses[k], inputs[k])[0] for k in inputs}
            a2a_in = tf.fill([n, 2], float(r))
            grads["alltoall"] = tf.compat.v1.gradients(tf.reduce_sum(
                rrtf.alltoall(a2a_in, splits, name="a2a_grad")[0]
                * tf.reshape(tf.range(2 * n, dtype=tf.float32), [n, 2]) * (r + 1)), a2a_in)[0]
            with tf.compat.v1.Session(config=CONFIG) as sess:
                result = sess.run(grads)
    """), tmp_path, init=False, timeout=240)
    mean_scale = sum(q + 1 for q in range(n)) / n  # every rank's dy, averaged
    weights = np.arange(2 * sum(range(1, n + 1)), dtype=np.float32).reshape(-1, 2)
    for rank in ranks:
        r, g = rank.rank, rank.result
        # allreduce: the same allreduce of dy (Sum: summed over ranks; Average: averaged)
        assert np.array_equal(g["allreduce_sum"], np.full(4, sum(q + 1 for q in range(n)), np.float32))
        assert np.allclose(g["allreduce_avg"], np.full(4, mean_scale))
        # allgather: dy averaged over ranks, this rank's rows
        start = sum(q + 1 for q in range(r))
        assert np.allclose(g["allgather"], weights[start:start + r + 1])
        # broadcast: dy averaged over ranks at the root, zeros elsewhere
        assert np.allclose(g["broadcast"], np.full(4, mean_scale if r == 1 else 0.0))
        # reducescatter (Sum): every rank's dy gathered, times size
        assert np.allclose(g["reducescatter"], np.repeat([(q + 1) * n for q in range(n)], [2] * n)[:, None]
                           * np.ones((6, 2)))
        # alltoall: every row's gradient goes home; row p of rank r went to rank p, landing at its row r
        want = np.stack([np.arange(2 * n, dtype=np.float32).reshape(n, 2)[r] * (p + 1) for p in range(n)])
        assert np.array_equal(g["alltoall"], want), (r, g["alltoall"], want)


@pytest.mark.slow
def test_a_mismatch_raises_failed_precondition_and_the_session_goes_on(tmp_path):
    ranks = run_ranks(2, job("""
        @tf.function
        def summed(a, b):  # tf.function keeps its own path (numpy_function in program order)
            return rrtf.allreduce(a, op="sum"), rrtf.allreduce(b, op="sum")
        a, b = summed(tf.fill([5], float(r)), tf.fill([5], 10.0 * (r + 1)))
        in_function = (a.numpy().tolist(), b.numpy().tolist())

        with tf.Graph().as_default():
            bad = rrtf.allreduce(tf.ones([2 + r]), name="bad")
            good = rrtf.allreduce(tf.fill([3], float(r)), op=rrtf.Sum, name="good")
            gathered = rrtf.allgather(tf.fill([1], r))
            with tf.compat.v1.Session(config=CONFIG) as sess:
                try:
                    sess.run(bad)
                    caught = "no error"
                except tf.errors.FailedPreconditionError as e:
                    caught = (type(e).__name__, rrtf.is_mismatch(e), str(e))
                after = sess.run([good, gathered])
        result = (in_function, caught, [a.tolist() for a in after])
    """), tmp_path, init=False, timeout=240)
    for rank in ranks:
        in_function, caught, after = rank.result
        assert in_function == ([1.0] * 5, [30.0] * 5), in_function
        assert caught != "no error"
        name, is_mismatch, message = caught
        assert is_mismatch, name  # TensorFlow's class for the op's status: is_mismatch says what it is
        assert "bad" in message and "shape" in message, message
        assert after == [[1.0] * 3, [0, 1]], after


@pytest.mark.slow
def test_a_dead_peer_fails_the_session_run_naming_it(tmp_path):
    ranks = run_ranks(3, job("""
        import time
        with tf.Graph().as_default():
            outs = [rrtf.allreduce(tf.fill([1000], float(r)), op=rrtf.Sum, name=f"t{i}") for i in range(4)]
            with tf.compat.v1.Session(config=CONFIG) as sess:
                first = sess.run(outs)[0][0]
                if r == 1:
                    os._exit(0)  # dies without a word
                time.sleep(0.5)
                t0 = time.time()
                try:
                    sess.run(outs)
                    result = "no error"
                except tf.errors.OpError as e:
                    result = (first, type(e).__name__, str(e), time.time() - t0)
        with open(os.environ["RR_TEST_RESULT"], "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    """), tmp_path, init=False, timeout=240, env={"RINGREDUCE_TIMEOUT": "20"}, check=False)
    for rank in (ranks[0], ranks[2]):
        assert rank.returncode == 0, rank.stderr[-3000:]
        assert rank.result != "no error"
        first, name, message, elapsed = rank.result
        assert first == 3.0
        assert "rank 1" in message and "PeerLostError" in message, message
        assert elapsed < 15, elapsed


@pytest.mark.slow
def test_broadcast_global_variables_and_the_session_hook(tmp_path):
    ranks = run_ranks(2, job("""
        with tf.Graph().as_default():
            a = tf.compat.v1.get_variable("a", initializer=tf.fill([3], float(r + 1)))
            b = tf.compat.v1.Variable(tf.fill([2, 2], 10 * r), name="b")
            step = tf.compat.v1.assign_add(a, tf.ones([3]))
            bcast = rrtf.broadcast_global_variables(1)
            with tf.compat.v1.Session(config=CONFIG) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                before = sess.run([a, b])
                sess.run(bcast)
                after = sess.run([a, b])
            hook = rrtf.BroadcastGlobalVariablesHook(0)
            with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:  # initialises, then the hook broadcasts
                sess.run(step)
                hooked = sess.run([a, b])
        result = [[x.tolist() for x in v] for v in (before, after, hooked)]
    """), tmp_path, init=False, timeout=240)
    for rank in ranks:
        before, after, hooked = rank.result
        r = rank.rank
        assert before == [[r + 1.0] * 3, [[10 * r] * 2] * 2]
        assert after == [[2.0] * 3, [[10] * 2] * 2]  # rank 1's
        assert hooked == [[2.0] * 3, [[0] * 2] * 2]  # rank 0's fresh values, then one step


@pytest.mark.slow
def test_eager_execution_disabled_join_cond_and_tf_function(tmp_path):
    """tf.compat.v1.disable_eager_execution(): ops go into the default graph
    (TF1 mode). Rank 0 joins at once; rank 1's allreduces complete with rank
    0 adding zeros (avg divides by both ranks), then rank 1 joins too.
    Collectives inside a tf.cond branch and a tf.function work there too."""
    ranks = run_ranks(2, """
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
        tf.compat.v1.disable_eager_execution()
        import ringreduce.tensorflow as rrtf
        rrtf.init()
        r = rrtf.rank()
        summed = rrtf.allreduce(tf.fill([3], 4.0), op=rrtf.Sum, name="s")
        averaged = rrtf.allreduce(tf.fill([3], 4.0), op=rrtf.Average, name="a")
        joined = rrtf.join()
        # In a tf.cond branch (a graph of its own, gone once built) and a tf.function.
        flag = tf.compat.v1.placeholder(tf.bool, [])
        branched = tf.cond(flag, lambda: rrtf.allgather(tf.fill([1], r)), lambda: tf.constant([-1, -1]))
        in_function = tf.function(lambda t: rrtf.allreduce(t, op=rrtf.Max))(tf.fill([2], float(r)))
        import gc
        gc.collect()
        with tf.compat.v1.Session() as sess:
            got = sess.run([summed, averaged]) if r == 1 else []
            last = sess.run(joined)
            again = sess.run(summed)  # after join, as before
            inner = sess.run([branched, in_function], {flag: True})
        result = ([g.tolist() for g in got], int(last), again.tolist(), [x.tolist() for x in inner])
    """, tmp_path, init=False, timeout=240)
    assert ranks[1].result[0] == [[4.0] * 3, [2.0] * 3]
    for rank in ranks:
        assert rank.result[1:] == (1, [8.0] * 3, [[0, 1], [1.0, 1.0]]), rank.result


@pytest.mark.slow
def test_building_without_a_compiler_says_what_is_missing(tmp_path):
    from ranks import REPO
    import subprocess
    import sys
    code = ("import ringreduce as rr\nfrom ringreduce.tensorflow import async_op\n"
            "try:\n    async_op.build()\nexcept rr.RingReduceError as e:\n    print('ERROR', e)\n")
    env = {"CXX": str(tmp_path / "no-such-c++"), "RINGREDUCE_TF_OPS_DIR": str(tmp_path / "cache"),
           "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR" in out.stdout and "C++ compiler" in out.stdout and "CXX" in out.stdout, out.stdout
    assert not list((tmp_path / "cache").glob("*.so")) if (tmp_path / "cache").exists() else True


@pytest.mark.slow
def test_python_m_async_op_builds_the_op_ahead(tmp_path):
    """docs/tensorflow.md's way to build the op for a read-only image: run as
    __main__ after the package imported the module, it must not register the
    op's gradient twice."""
    from ranks import REPO
    import subprocess
    import sys
    env = {"RINGREDUCE_TF_OPS_DIR": str(tmp_path / "ops"), "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **session_cxx()}
    out = subprocess.run([sys.executable, "-m", "ringreduce.tensorflow.async_op"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    built = list((tmp_path / "ops").glob("*.so"))
    assert len(built) == 1 and out.stdout.strip() == str(built[0]), (out.stdout, built)


def test_cxx_with_arguments_is_split_like_a_shell_would(monkeypatch):
    """CXX="ccache g++" or "g++ -m64" is common; it names a command and its
    arguments, not a file called "ccache g++"."""
    import shutil
    from pathlib import Path
    from ringreduce.tensorflow import async_op
    cxx = shutil.which("c++") or shutil.which("g++")
    monkeypatch.setenv("CXX", f"{cxx} -DRINGREDUCE_FROM_CXX=1")
    cmd = async_op.build_command(Path("out.so"))
    assert cmd[:2] == [cxx, "-DRINGREDUCE_FROM_CXX=1"], cmd[:3]


def test_an_unwritable_op_cache_says_where_and_what_to_do(monkeypatch, tmp_path):
    """A read-only home (or cache dir) where the op is not built yet: a
    RingReduceError naming the directory and the way out, not a bare OSError."""
    import ringreduce as rr
    from ringreduce.tensorflow import async_op
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory under a file cannot be made, even by root
    monkeypatch.setenv("RINGREDUCE_TF_OPS_DIR", str(blocker / "ops"))
    with pytest.raises(rr.RingReduceError, match="RINGREDUCE_TF_OPS_DIR") as caught:
        async_op.build()
    assert str(blocker / "ops") in str(caught.value)


@pytest.mark.slow
def test_a_timeout_or_session_close_ends_a_collective_left_waiting(tmp_path):
    """Rank 0 runs collectives rank 1 never starts. A RunOptions timeout, and
    Session.close from another thread, must end the step (the op registers
    with the step's cancellation) instead of waiting for ever; the session
    and the engine go on."""
    ranks = run_ranks(2, job("""
        import threading, time
        with tf.Graph().as_default():
            lonely = [rrtf.allreduce(tf.fill([3], 1.0), op=rrtf.Sum, name=f"lonely{i}") for i in range(2)]
            both = rrtf.allreduce(tf.fill([3], 1.0), op=rrtf.Sum, name="both")
            sess = tf.compat.v1.Session(config=CONFIG)
            timed_out = closed = None
            if r == 0:
                t0 = time.time()
                try:
                    sess.run(lonely[0], options=tf.compat.v1.RunOptions(timeout_in_ms=1000))
                except tf.errors.OpError as e:
                    timed_out = (type(e).__name__, time.time() - t0)
            after = sess.run(both).tolist()
            if r == 0:
                def run():
                    global closed
                    try:
                        sess.run(lonely[1])
                    except tf.errors.OpError as e:
                        closed = f"{type(e).__name__}: {e}"
                t = threading.Thread(target=run)
                t.start()
                time.sleep(1.0)
                sess.close()
                t.join(20)
                closed = (closed, t.is_alive())
            else:
                sess.close()
        result = (timed_out, after, closed)
    """), tmp_path, init=False, timeout=120)
    timed_out, after, closed = ranks[0].result
    assert timed_out is not None and timed_out[0] == "DeadlineExceededError" and timed_out[1] < 10, timed_out
    assert after == [2.0] * 3 and ranks[1].result[1] == [2.0] * 3
    assert closed[0] is not None and "Error" in closed[0] and closed[1] is False, closed


@pytest.mark.slow
def test_a_damaged_op_library_in_the_cache_is_built_again(tmp_path):
    """A file under the library's name that does not load (truncated by a
    full disk, a bad copy of the cache) is replaced, not a dead end."""
    from ranks import REPO
    import subprocess
    import sys
    code = ("from ringreduce.tensorflow import async_op\n"
            "path = async_op.library_path()\npath.parent.mkdir(parents=True)\npath.write_bytes(b'\\x7fELF half')\n"
            "async_op.load()\nprint('LOADED', path.read_bytes()[:4] == b'\\x7fELF' and path.stat().st_size > 1000)\n")
    env = {"RINGREDUCE_TF_OPS_DIR": str(tmp_path / "ops"), "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **session_cxx()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "LOADED True" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
def test_a_cache_without_file_locks_still_builds(monkeypatch, tmp_path):
    """Some network filesystems refuse flock (ENOLCK): the op is still built
    (ranks may then compile it twice; each writes a file of its own and
    renames it into place, so none sees half a library)."""
    import errno
    from ringreduce.tensorflow import async_op

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(async_op.fcntl, "flock", no_locks)
    monkeypatch.setenv("RINGREDUCE_TF_OPS_DIR", str(tmp_path / "ops"))
    path = async_op.build()
    assert path.exists() and path.read_bytes()[:4] == b"\x7fELF"


def test_broadcast_returns_values_and_tapes_build_in_a_tf1_graph_then_eagerly(tmp_path):
    """broadcast_ returns the updated values in a TF1 graph too (`a, b =
    hvd.broadcast_([a, b], 0)`); a DistributedGradientTape step built in a
    TF1 graph, then eagerly, then in a tf.function and in a second TF1 graph
    works in each (each graph has its own helper variable)."""
    ranks = run_ranks(2, job("""
        import keras
        got = {}
        def tape_step(w):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * float(r + 1))
            return rrtf.DistributedGradientTape(tape).gradient(loss, [w])[0]
        for g in range(2):
            with tf.Graph().as_default():
                a = tf.compat.v1.Variable([float(r)])
                b = tf.compat.v1.Variable([float(r), 5.0 + r])
                a_value, b_value = rrtf.broadcast_([a, b], 1)
                one = rrtf.broadcast_(tf.compat.v1.Variable([7.0 + r]), 0)
                grad = tape_step(tf.compat.v1.Variable([1.0, 2.0]))
                with tf.compat.v1.Session(config=CONFIG) as s:
                    s.run(tf.compat.v1.global_variables_initializer())
                    got[f"graph {g}"] = (s.run([a_value, b_value, one]), s.run(grad), s.run(a))
        got["eager"] = tape_step(tf.Variable([1.0, 2.0])).numpy()
        got["tf.function"] = tf.function(tape_step)(tf.Variable([1.0, 2.0])).numpy()
        v = tf.Variable([1.0, 2.0])
        opt = rrtf.DistributedOptimizer(keras.optimizers.SGD(1.0))
        @tf.function
        def opt_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v * float(r + 1))
            opt.apply(tape.gradient(loss, [v]), [v])
        opt_step()
        got["optimizer"] = v.numpy()
        values = rrtf.broadcast_([tf.Variable([float(r)]), tf.Variable([float(r)])], 1)
        got["eager broadcast_"] = [type(x).__name__ for x in values], [x.numpy() for x in values]
        result = got
    """), tmp_path, timeout=300, init=False)
    for rk in ranks:
        got = rk.result
        for g in range(2):
            (a_value, b_value, one), grad, a_after = got[f"graph {g}"]
            np.testing.assert_array_equal(a_value, [1.0])
            np.testing.assert_array_equal(b_value, [1.0, 6.0])
            np.testing.assert_array_equal(one, [7.0])
            np.testing.assert_array_equal(a_after, [1.0])  # the variable itself was assigned
            np.testing.assert_allclose(grad, [1.5, 1.5])
        np.testing.assert_allclose(got["eager"], [1.5, 1.5])
        np.testing.assert_allclose(got["tf.function"], [1.5, 1.5])
        np.testing.assert_allclose(got["optimizer"], [-0.5, 0.5])
        kinds, values = got["eager broadcast_"]
        assert kinds == ["EagerTensor", "EagerTensor"] and [v.tolist() for v in values] == [[1.0], [1.0]]
