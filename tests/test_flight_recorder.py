"""The flight recorder (ringreduce/core/flight_recorder.py): what each rank
keeps of its collectives, the bound K, the off switch, and the dumps it
writes on a failure, on SIGUSR1 (chained to the program's own handler, and
while the rank waits inside a C collective) and on request."""
import json
import signal
import subprocess
import sys

import pytest

from ranks import REPO, run_ranks
from ringreduce.core import flight_recorder
from ringreduce.core.config import Config


def test_each_collective_is_recorded_with_its_number_name_and_outcome(tmp_path):
    body = f"""
    import json
    from ringreduce.engine import engine
    x = np.arange(6, dtype=np.float32)
    rr.flight_recorder.set_step(41)
    for _ in range(3):
        rr.allreduce(x, op="max", name="w")
    rr.broadcast(x, root=1, name="b")
    rr.allgather(x[:2])
    rr.reduce_scatter(x)
    rr.alltoall(x)
    rr.barrier()
    pair = rr.add_process_set([0, 1])
    if pair.included():
        rr.allreduce(x, process_set=pair)
    rr.flight_recorder.set_step(42)
    e = engine()
    handles = [e.enqueue("grad/a", x), e.enqueue("grad/b", x.astype(np.float64))]
    [e.wait(h) for h in handles]
    e.wait(e.enqueue("ids", x, kind="allgather"))
    path = rr.flight_recorder.dump(reason="test")
    result = json.load(open(path))
    """
    ranks = run_ranks(3, body, tmp_path, env={"RINGREDUCE_FLIGHT_DIR": str(tmp_path / "d")})
    for r in ranks:
        d = r.result
        member = r.rank < 2
        assert d["rank"] == r.rank and d["size"] == 3 and d["reason"] == "test" and d["capacity"] == 2000
        assert d["process_sets"] == {"1": [0, 1]}
        got = [(e["kind"], e["seq"], e["name"], e["state"], e["process_set"]) for e in d["entries"]]
        assert got[:8 + member] == [
            ("allreduce", 1, "w", "done", 0), ("allreduce", 2, "w", "done", 0), ("allreduce", 3, "w", "done", 0),
            ("broadcast", 1, "b", "done", 0), ("allgather", 1, None, "done", 0),
            ("reduce_scatter", 1, None, "done", 0), ("alltoall", 1, None, "done", 0), ("barrier", 1, None, "done", 0),
            ("allreduce", 1, None, "done", 1)][:8 + member], "the set's own numbers, on its members only"
        first = d["entries"][0]
        assert (first["bytes"], first["dtype"], first["op"], first["step"], first["generation"]) == \
               (24, "float32", "max", 41, 0)
        assert first["t_enqueue"] is None and first["t_start"] <= first["t_end"]
        assert abs(first["wall_start"] - (first["t_start"] - d["monotonic"] + d["wall"])) < 1e-3
        engine_entries = {e["name"]: e for e in d["entries"][8 + member:]}
        a, b, ids = engine_entries["grad/a"], engine_entries["grad/b"], engine_entries["ids"]
        # through the engine: its names, enqueue times, and the number of the core collective that ran each
        assert a["kind"] == "allreduce" and a["state"] == "done" and a["step"] == 42 and a["op"] == "avg"
        assert a["t_enqueue"] <= a["t_start"] <= a["t_end"] and (a["dtype"], b["dtype"]) == ("float32", "float64")
        assert {a["seq"], b["seq"]} == {4, 5}, "two dtypes: two fused buckets, the world's allreduces 4 and 5"
        assert ids["kind"] == "allgather" and ids["seq"] == 2
        assert len(d["entries"]) == 11 + member, "an engine request is one entry, not two"


def test_k_bounds_what_a_rank_keeps(tmp_path):
    body = """
    for i in range(20):
        rr.allreduce(np.ones(2), name=f"t{i}")
    result = rr.flight_recorder.snapshot()["entries"]
    """
    for r in run_ranks(2, body, tmp_path, env={"RINGREDUCE_FLIGHT_RECORDER": "5"}):
        assert [e["seq"] for e in r.result] == [16, 17, 18, 19, 20]
        assert [e["name"] for e in r.result] == [f"t{i}" for i in range(15, 20)]


def test_off_switch_records_and_dumps_nothing(tmp_path):
    body = """
    import os, signal
    rr.allreduce(np.ones(2), name="a")
    try:
        rr.allreduce(np.ones(2), name="a" if rr.rank() == 0 else "b")
    except rr.MismatchError:
        pass
    result = (rr.flight_recorder.snapshot()["entries"], rr.flight_recorder.dump(),
              signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, os.listdir(os.environ["RINGREDUCE_FLIGHT_DIR"]))
    """
    where = tmp_path / "dumps"
    where.mkdir()
    for r in run_ranks(2, body, tmp_path, env={"RINGREDUCE_FLIGHT_RECORDER": "0",
                                               "RINGREDUCE_FLIGHT_DIR": str(where)}):
        assert r.result == ([], None, True, [])


@pytest.mark.parametrize("text", ["-1", "lots", "20000000"])
def test_a_nonsense_k_is_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match="RINGREDUCE_FLIGHT_RECORDER"):
        Config.from_env({"RINGREDUCE_FLIGHT_RECORDER": text})
    assert Config.from_env({"RINGREDUCE_FLIGHT_RECORDER": "0"}).flight_recorder == 0
    assert Config.from_env({}).flight_recorder == flight_recorder.DEFAULT_CAPACITY


def test_a_mismatch_dumps_every_rank_with_the_failed_entry(tmp_path):
    body = """
    import json, os
    rr.allreduce(np.ones(2), name="ok")
    try:
        rr.allreduce(np.ones(2), name="a" if rr.rank() == 0 else "b")
    except rr.MismatchError:
        pass
    path = os.path.join(os.environ["RINGREDUCE_FLIGHT_DIR"], f"flight_rank{rr.rank()}.json")
    mismatch = json.load(open(path))
    try:  # rank 0's own bad input (a name that is no str): refused there, a mismatch on rank 1; both dump
        rr.allreduce(np.ones(2), name=5 if rr.rank() == 0 else "c")
    except (TypeError, rr.MismatchError):
        pass
    result = mismatch, json.load(open(path))
    """
    for r in run_ranks(2, body, tmp_path, env={"RINGREDUCE_FLIGHT_DIR": str(tmp_path / "d")}):
        mismatch, refused = r.result
        last = mismatch["entries"][-1]
        assert mismatch["reason"].startswith("MismatchError") and last["state"] == "failed"
        assert last["seq"] == 2 and last["error"].startswith("MismatchError: ranks disagree on the name")
        assert mismatch["entries"][0]["state"] == "done"
        last = refused["entries"][-1]
        assert (last["seq"], last["name"], last["state"]) == (3, "5" if r.rank == 0 else "c", "failed")
        assert last["error"].startswith("TypeError" if r.rank == 0 else "MismatchError: a rank refused")


def test_sigusr1_dumps_and_calls_the_programs_own_handler(tmp_path):
    # rank 0's own handler, set before init: chained, still called; rank 1 has none: the recorder's alone
    body = """
    import json, os, signal, time
    seen = []
    if os.environ["RINGREDUCE_RANK"] == "0":
        signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    rr.init()
    rr.allreduce(np.ones(2), name="before")
    pids = rr.allgather(np.array([os.getpid()]))
    path = os.path.join(os.environ["RINGREDUCE_FLIGHT_DIR"], f"flight_rank{rr.rank()}.json")
    if rr.rank() == 1:
        while not os.path.exists(os.environ["RINGREDUCE_FLIGHT_DIR"] + "/go"):
            time.sleep(0.01)
        time.sleep(0.5)  # rank 0 is waiting inside the C allreduce by now
        os.kill(int(pids[0]), signal.SIGUSR1)  # dumps there, within ~100 ms, while it still waits for us
        deadline = time.monotonic() + 30
        while not os.path.exists(os.environ["RINGREDUCE_FLIGHT_DIR"] + "/flight_rank0.json"):
            assert time.monotonic() < deadline, "rank 0 never dumped"
            time.sleep(0.01)
        during = json.load(open(os.environ["RINGREDUCE_FLIGHT_DIR"] + "/flight_rank0.json"))
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)  # the handler runs at the next bytecode
        rr.allreduce(np.ones(2), name="stuck")
        result = (during, json.load(open(path)), signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL)
    else:
        open(os.environ["RINGREDUCE_FLIGHT_DIR"] + "/go", "w").close()
        rr.allreduce(np.ones(2), name="stuck")
        result = seen
    """
    where = tmp_path / "d"
    where.mkdir()
    ranks = run_ranks(3, body, tmp_path, env={"RINGREDUCE_FLIGHT_DIR": str(where)}, init=False)
    assert ranks[0].result == [signal.SIGUSR1], "rank 0's own handler still ran"
    during, own, installed = ranks[1].result
    assert during["reason"] == "SIGUSR1" and during["rank"] == 0
    assert [(e["name"], e["state"]) for e in during["entries"][-1:]] == [("stuck", "started")]
    assert own["reason"] == "SIGUSR1" and own["rank"] == 1 and installed


def test_keras_fit_with_the_broadcast_callback_records_each_steps_number(tmp_path):
    body = """
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import ringreduce.tensorflow as rrtf
    rrtf.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = np.ones((12, 4), np.float32), np.zeros((12, 2), np.float32)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[rrtf.BroadcastGlobalVariablesCallback(0)])
    result = [(e["kind"], e["step"]) for e in rr.flight_recorder.snapshot()["entries"]]
    """
    for r in run_ranks(2, body, tmp_path, timeout=240, init=False):
        steps = [step for kind, step in r.result if kind == "allreduce"]
        assert sorted(set(steps)) == [0, 1, 2, 3, 4, 5], r.result  # 2 epochs of 3 batches, counted on


def test_an_ignored_sigusr1_stays_ignored_and_a_default_one_gets_the_handler():
    code = ("import signal; from ringreduce.core import flight_recorder as f\n"
            "print(f.install_signal_handler(), signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)\n"
            "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
            "print(f.install_signal_handler(), signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True False", "False True"]
