"""World discovery from each launcher's environment, and the GIL."""
import json
import threading
import time

import numpy as np
import pytest

from ringreduce.errors import RingReduceError
from ringreduce.core.world import discover
from ranks import run_ranks


def test_ringreduce_variables_come_first():
    w = discover({"RINGREDUCE_RANK": "2", "RINGREDUCE_SIZE": "4", "RINGREDUCE_ADDR": "10.0.0.1:1234",
                  "RINGREDUCE_SECRET": "s", "RINGREDUCE_LOCAL_RANK": "0", "RINGREDUCE_LOCAL_SIZE": "2",
                  "RINGREDUCE_TIMEOUT": "5", "OMPI_COMM_WORLD_RANK": "9", "TF_CONFIG": "{}"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.addr, w.secret) == (2, 4, 0, 2, ("10.0.0.1", 1234), b"s")
    assert w.config.timeout == 5.0 and w.source == "RINGREDUCE_* environment"


def test_bad_ringreduce_variables_say_what_is_wrong():
    with pytest.raises(RingReduceError, match="RINGREDUCE_ADDR"):
        discover({"RINGREDUCE_RANK": "0", "RINGREDUCE_SIZE": "2"})
    with pytest.raises(RingReduceError, match="RINGREDUCE_SIZE"):
        discover({"RINGREDUCE_RANK": "3", "RINGREDUCE_SIZE": "2", "RINGREDUCE_ADDR": "h:1"})


def test_tf_config_ring_is_chief_then_workers():
    cluster = {"chief": ["hostA:2222"], "worker": ["hostA:2223", "hostB:2222", "hostB:2223"]}
    ranks = []
    for task in [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]:
        w = discover({"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task[0], "index": task[1]}})})
        ranks.append((w.rank, w.size, w.local_rank, w.local_size, w.addr))
    assert ranks == [(0, 4, 0, 2, ("hostA", 2222)), (1, 4, 1, 2, ("hostA", 2222)),
                     (2, 4, 0, 2, ("hostA", 2222)), (3, 4, 1, 2, ("hostA", 2222))]


def test_tf_config_parameter_servers_are_not_ring_members():
    cfg = {"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "ps", "index": 0}}
    with pytest.raises(RingReduceError, match="not a chief or worker"):
        discover({"TF_CONFIG": json.dumps(cfg)})


def test_mpirun_environment_is_recognised():
    w = discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    assert (w.rank, w.size, w.source) == (0, 1, "mpirun")
    w = discover({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert (w.rank, w.size, w.source) == (0, 1, "mpirun")


def test_no_launcher_means_one_rank():
    w = discover({})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.addr) == (0, 1, 0, 1, None)


def test_the_gil_is_released_during_a_collective(tmp_path):
    """Another Python thread keeps running while a large allreduce is in C.
    With a long switch interval the main thread never hands the GIL over by
    itself, so the other thread can only run if the C core releases it."""
    ranks = run_ranks(2, """
        import sys, threading, time
        sys.setswitchinterval(0.5)
        counter = [0]
        stop = threading.Event()
        def spin():
            while not stop.is_set():
                counter[0] += 1
        x = np.ones(32 << 20, dtype=np.float32)
        rr.allreduce(x)
        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.05)
        before = counter[0]
        rr.allreduce(x)
        during = counter[0] - before
        stop.set()
        t.join()
        result = during
    """, tmp_path)
    for r in ranks:
        assert r.result > 1000, f"rank {r.rank}: the other thread advanced only {r.result} times"
