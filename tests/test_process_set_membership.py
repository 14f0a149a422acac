"""Horovod's process-set membership names: process_set_included_op, and
init(process_sets=...) with a list of ProcessSets or "dynamic"."""
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")

PRELUDE = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
import ringreduce.tensorflow as hvd
"""

AT_INIT = PRELUDE + """
evens, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1])
hvd.init(process_sets=[evens, odd])
r = hvd.rank()
result = {"ids": (evens.process_set_id, odd.process_set_id),
          "included": [int(hvd.process_set_included_op(i)) for i in (0, evens.process_set_id, odd.process_set_id)],
          "in_graph": int(tf.function(lambda: hvd.process_set_included_op(evens.process_set_id))()),
          "dtype": hvd.process_set_included_op(0).dtype.name}
if evens.included():
    result["sum"] = hvd.allreduce(tf.constant([float(r + 1)]), op=hvd.Sum, process_set=evens).numpy().tolist()
try:
    hvd.process_set_included_op(99)
except ValueError as e:
    result["unknown"] = str(e)
hvd.shutdown()
"""


def test_sets_given_to_init_are_registered_in_order_and_membership_reads_as_a_tensor(tmp_path):
    ranks = run_ranks(3, AT_INIT, tmp_path, init=False, timeout=120)
    for rk in ranks:
        res = rk.result
        assert res["ids"] == (1, 2)
        assert res["included"] == [1, int(rk.rank != 1), int(rk.rank == 1)]
        assert res["in_graph"] == int(rk.rank != 1)
        assert res["dtype"] == "int32"
        assert "99" in res["unknown"]
        if rk.rank != 1:
            assert res["sum"] == [4.0]  # ranks 0 and 2: 1 + 3


DYNAMIC = PRELUDE + """
hvd.init(process_sets="dynamic")
result = {"before": int(hvd.process_set_included_op(0))}
pair = hvd.add_process_set([1])
result["after_add"] = int(hvd.process_set_included_op(pair.process_set_id))
set_id = pair.process_set_id
hvd.remove_process_set(pair)
try:
    hvd.process_set_included_op(set_id)
except ValueError:
    result["removed"] = True
try:
    hvd.shutdown()
    hvd.init(process_sets="static please")
except ValueError as e:
    result["bad"] = str(e)
"""


def test_dynamic_process_sets_are_added_and_removed_after_init(tmp_path):
    ranks = run_ranks(2, DYNAMIC, tmp_path, init=False, timeout=120)
    for rk in ranks:
        assert rk.result["before"] == 1 and rk.result["after_add"] == int(rk.rank == 1)
        assert rk.result["removed"] is True
        assert "static please" in rk.result["bad"]


EARLY_EXIT = PRELUDE + """
import time
hvd.init()
members = hvd.add_process_set([0, 1])
r = hvd.rank()
result = {}
if r == 2:  # not a member, and done at once: leaves while the members go on
    hvd.shutdown()
    result["left_at"] = time.monotonic()
else:
    sums = []
    for step in range(20):
        time.sleep(0.05)
        sums.append(float(hvd.allreduce(tf.constant([float(r + step)]), op=hvd.Sum, process_set=members)[0]))
    result["sums"] = sums
    if r == 0:  # a world collective now names the rank that left, instead of hanging or adding zeros
        try:
            hvd.allreduce(tf.constant([1.0]), name="world.after")
        except Exception as e:
            result["world"] = (type(e).__name__, str(e))
    hvd.shutdown()
"""


def test_a_non_member_that_shuts_down_early_does_not_hold_up_the_set(tmp_path):
    ranks = run_ranks(3, EARLY_EXIT, tmp_path, init=False, timeout=120)
    for rk in ranks[:2]:
        assert rk.result["sums"] == [float(1 + 2 * step) for step in range(20)]
    name, text = ranks[0].result["world"]
    assert "world.after" in text and "2 of its process set have shut down" in text, text


MPI_JOB = """
import os, pickle, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
from mpi4py import MPI
import tensorflow as tf
import ringreduce.tensorflow as hvd
evens = hvd.ProcessSet([0, 2])
hvd.init(comm=MPI.COMM_WORLD, process_sets=[evens])
out = {"mpi": hvd.mpi_enabled(), "included": int(hvd.process_set_included_op(evens.process_set_id))}
if evens.included():
    out["sum"] = hvd.allreduce(tf.constant([hvd.rank() + 1.0]), op=hvd.Sum, process_set=evens).numpy().tolist()
try:
    hvd.ProcessSet(MPI.COMM_WORLD)
except NotImplementedError as e:
    out["from_comm"] = str(e)
hvd.shutdown()
with open(sys.argv[1] + f".rank{MPI.COMM_WORLD.Get_rank()}.pkl", "wb") as f:
    pickle.dump(out, f)
"""


def test_init_with_an_mpi_communicator_and_process_sets(tmp_path):
    import pickle
    import subprocess
    import sys
    from test_mpi import MPIRUN, _missing
    if _missing():
        pytest.skip(_missing())
    from ranks import REPO
    script = tmp_path / "job.py"
    script.write_text(MPI_JOB)
    proc = subprocess.run([MPIRUN, "-np", "3", sys.executable, str(script), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=180, env={**__import__("os").environ,
                                                                            "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(3):
        res = pickle.loads((tmp_path / f"out.rank{r}.pkl").read_bytes())
        assert res["mpi"] is True and res["included"] == int(r != 1)
        assert res.get("sum") == ([4.0] if r != 1 else None)
        assert "ProcessSet([0, 2])" in res["from_comm"]
