"""How an elastic job ends: a script that fails at start ends the job with
its error, as a plain ringrun does; work after `elastic.run` returns (a
checkpoint, a results file) is never cut short; only workers still waiting to
join a ring are stopped when training is over."""
import os
import sys
import textwrap

import pytest

from test_elastic import ElasticRun

FAILS_AFTER_INIT = """
    import sys
    import ringreduce as rr
    rr.init()
    {fail}
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fail, code, says", [
    ("raise RuntimeError('a bug right after init')", 1, "RuntimeError: a bug right after init"),
    ("sys.exit(7)", 7, "exited with code 7"),
], ids=["raises", "exits-7"])
def test_every_worker_failing_alike_before_a_commit_ends_the_job_with_their_error(tmp_path, fail, code, says):
    job = tmp_path / "fails.py"
    job.write_text(textwrap.dedent(FAILS_AFTER_INIT.format(fail=fail)))
    # restarted, this would run until --elastic-timeout (600 s); it must end within seconds
    run = ElasticRun(["-np", "4", "--min-np", "2", sys.executable, str(job)], timeout=90)
    assert run.proc.returncode == code, run.stderr[-3000:]
    assert says in run.stderr, run.stderr[-3000:]
    assert f"every worker (all 4) exited with code {code} before any commit: not restarted" in run.stderr, \
        run.stderr[-3000:]


FAILS_AFTER_A_COMMIT = """
    import os
    import numpy as np
    import ringreduce as rr
    from ringreduce import elastic
    rr.init()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        rr.allreduce(np.ones(3), name="g")
        state.step += 1
        state.commit()
        os._exit(3)  # every worker, every time, but after a commit: the job had trained
    train(state)
"""


@pytest.mark.timeout(120)
def test_workers_failing_alike_after_a_commit_are_restarted(tmp_path):
    job = tmp_path / "fails_late.py"
    job.write_text(textwrap.dedent(FAILS_AFTER_A_COMMIT))
    run = ElasticRun(["-np", "2", "--min-np", "1", "--max-restarts", "2", sys.executable, str(job)], timeout=90)
    assert "restarting it" in run.stderr and "before any commit" not in run.stderr, run.stderr[-3000:]
    assert run.proc.returncode == 1 and "with no restart left" in run.stderr, run.stderr[-3000:]


SAVES_AFTER_TRAINING = """
    import os, time
    import numpy as np
    import ringreduce as rr
    from ringreduce import elastic, rendezvous
    rr.init()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 5:
            rr.allreduce(np.ones(3), name="g")
            state.step += 1
            state.commit()
    train(state)
    if rr.rank() == 0:
        # its connection to ringrun ends before the process does (as at interpreter
        # teardown); the process still has work to do
        rendezvous.client().sock.close()
        time.sleep(4)
        with open({out!r} + ".tmp", "w") as f:
            f.write("saved at step %d" % state.step)
        os.replace({out!r} + ".tmp", {out!r})
        print("saved", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_finished_worker_saving_after_training_is_waited_for_not_stopped(tmp_path):
    out = tmp_path / "model.txt"
    job = tmp_path / "saves.py"
    job.write_text(textwrap.dedent(SAVES_AFTER_TRAINING.format(out=str(out))))
    run = ElasticRun(["-np", "2", sys.executable, str(job)], timeout=90)
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert out.read_text() == "saved at step 5", run.stderr[-3000:]
    assert "stopping" not in run.stderr and "still waited to join" not in run.stderr, run.stderr[-3000:]


NEWCOMER_NEVER_LET_IN = """
    import os, time
    import numpy as np
    import ringreduce as rr
    from ringreduce import elastic
    rr.init()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 3:
            rr.allreduce(np.ones(3), name="g")
            state.step += 1
            if state.step == 2 and rr.rank() == 2 and elastic.generation() == 1:
                os._exit(9)  # lost: restarted, it waits for a commit to be let in
            state.commit()
        time.sleep(5)  # no commit any more: the restarted worker waits to join until the end
    train(state)
    print("finished", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_worker_still_waiting_to_join_when_training_ends_is_stopped(tmp_path):
    job = tmp_path / "newcomer.py"
    job.write_text(textwrap.dedent(NEWCOMER_NEVER_LET_IN))
    run = ElasticRun(["-np", "3", "--min-np", "2", sys.executable, str(job)], timeout=90)
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert sum(line.endswith("] finished") for line in run.lines) == 2, run.stderr[-3000:]
    # the one waiting to join, and not the members that finished (closing their connections, exiting)
    assert "training finished; 1 worker(s) still waited to join; stopping them" in run.stderr, run.stderr[-3000:]
