"""An elastic training job for tests/test_elastic.py and benchmarks/elastic_soak.py.

    ringrun --elastic -np 4 --min-np 2 python tests/elastic_job.py STEPS SLEEP

Each step adds allreduce(sum) of (step + 1 + rank) minus what the ranks
added, i.e. size * (step + 1), to every weight: the committed history of
sizes then says exactly what the weights must be. Prints, per commit,
`committed STEP gen G rank R size N pid P t T`; at the end `done {json}`.
"""
import hashlib
import json
import os
import sys
import threading
import time

import numpy as np

import ringreduce as rr
from ringreduce import elastic

steps, pause = int(sys.argv[1]), float(sys.argv[2])
n = int(os.environ.get("ELASTIC_JOB_ELEMENTS", "20001"))  # over the small-message limit: the ring path
rr.init()
resources = []  # (descriptors but the control star's, threads) after each reset: must not grow


def after_reset():
    fds = os.listdir("/proc/self/fd")
    control = (rr.size() - 1 if rr.rank() == 0 else 1) if rr.size() > 1 else 0  # rank 0 holds the star
    resources.append((len(fds) - control, threading.active_count()))
    if os.environ.get("ELASTIC_JOB_DEBUG"):
        print("fds", sorted((int(f), _target(f)) for f in fds), flush=True)


def _target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


state = elastic.ObjectState(step=0, w=np.zeros(n), sizes=[])
state.register_reset_callbacks([after_reset])


@elastic.run
def train(state):
    while state.step < steps:
        g = np.full(n, float(state.step + 1)) + rr.rank()
        state.w += rr.allreduce(g, op="sum", name="g") - sum(range(rr.size()))
        state.sizes.append(rr.size())
        state.step += 1
        time.sleep(pause)
        try:
            state.commit()  # saves, then may raise HostsUpdatedInterrupt (or lose a peer) on its check
        finally:
                print(f"committed {state.step} gen {elastic.generation()} rank {rr.rank()} size {rr.size()} "
                  f"pid {os.getpid()} t {time.time():.4f}", flush=True)


after_reset()  # the first world's count, to compare the later ones with
train(state)
expected = float(sum(size * (i + 1) for i, size in enumerate(state.sizes)))
scraped = None
if os.environ.get("RINGREDUCE_METRICS_PORT"):  # this worker's own endpoint, over HTTP (tests/test_metrics_endpoint.py)
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % rr.metrics.address()[1], timeout=30) as reply:
        scraped = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(reply.read().decode())
                   for s in fam.samples]
print("done " + json.dumps({"rank": rr.rank(), "size": rr.size(), "steps": state.step, "sizes": state.sizes,
                            "w0": float(state.w[0]), "expected": expected,
                            "uniform": bool((state.w == state.w[0]).all()),
                            "sha": hashlib.sha256(state.w.tobytes()).hexdigest(), "resources": resources,
                            "worker": os.environ.get("RINGREDUCE_WORKER_ID"),
                            "links": rr.core.communicator().world.extra.get("links"),
                            "generation": elastic.generation(), "resets": elastic.resets(),
                            "metrics": scraped}), flush=True)
