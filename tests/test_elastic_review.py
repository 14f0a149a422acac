"""Defects found by a hostile review of elastic training (ringrun --elastic,
ringreduce.elastic, the rendezvous), each with the test that showed it."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from ranks import REPO
from test_elastic import ElasticRun

RAISES = """
    import numpy as np
    import ringreduce as rr
    from ringreduce import elastic
    rr.init()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 1000:
            rr.allreduce(np.ones(3), name="g")
            state.step += 1
            if state.step == 3 and rr.rank() == {who}:
                raise ValueError("a bug in the training script")
            state.commit()
    train(state)
"""


@pytest.mark.timeout(40)
@pytest.mark.parametrize("who", ["rr.rank()", "1"], ids=["every-rank", "one-rank"])
def test_an_exception_in_the_training_function_ends_the_job(tmp_path, who):
    """A program error is not a lost worker: restarting it would loop (the
    old code restarted it with back-off, up to 100 times, for ~50 minutes)."""
    job = tmp_path / "raises.py"
    job.write_text(textwrap.dedent(RAISES.replace("{who}", who)))
    started = time.monotonic()
    run = ElasticRun(["-np", "3", "--min-np", "2", sys.executable, str(job)], timeout=30)
    assert run.proc.returncode == 1, run.stderr[-3000:]
    assert time.monotonic() - started < 25
    assert "restarting it" not in run.stderr, run.stderr[-3000:]
    assert "raised ValueError: a bug in the training script" in run.stderr, run.stderr[-3000:]
