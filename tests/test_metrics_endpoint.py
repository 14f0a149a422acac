"""Each rank's Prometheus endpoint (ringreduce/metrics/, docs/metrics.md):
scraped over real HTTP and parsed with prometheus_client's own parser, its
byte counters are rr.stats(), its latency histograms count the collectives
run, per kind, and every sample names the rank; a bad port setting fails
init() clearly; with metrics off nothing listens and prometheus_client is
never imported."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from ranks import REPO, free_port, run_ranks

# Prepended to each rank's snippet: scrape(port) -> (text, [(name, labels, value), ...]) through urllib,
# parsed by prometheus_client's parser; listening_ports(): the TCP ports this process listens on.
HELPERS = '''
import os, socket, urllib.request
from prometheus_client.parser import text_string_to_metric_families

def scrape(port, host="127.0.0.1"):
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as reply:
        assert reply.status == 200, reply.status
        text = reply.read().decode()
    return text, [(s.name, dict(s.labels), s.value)
                  for fam in text_string_to_metric_families(text) for s in fam.samples]

def listening_ports():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for row in open(table).read().splitlines()[1:]:
                f = row.split()
                if f[3] == "0A" and f[9] in inodes:  # LISTEN, one of ours
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(ports)
'''

ON = {"RINGREDUCE_METRICS_PORT": "0", "RINGREDUCE_JOB": "metrics-test-job"}


def value(samples, name, **labels):
    """The one sample of `name` whose labels include `labels`."""
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(found) == 1, (name, labels, [(n, lab) for n, lab, _ in samples if n == name])
    return found[0]


def names(samples) -> set:
    return {n for n, _, _ in samples}


RUN_EVERY_KIND = """
x = np.arange(300_000, dtype=np.float32)  # 1.2 MB: the ring's data steps
for _ in range(3):
    rr.allreduce(x)
for _ in range(2):
    rr.allreduce(np.ones(4))             # small: the one-pass path
rr.broadcast(np.ones(10), root=1)
rr.broadcast(x, root=0)
rr.allgather(np.ones(5) * rr.rank())
rr.reduce_scatter(x)
rr.alltoall(np.ones((6, 2)))
rr.barrier()
"""
RAN = {"allreduce": 5, "broadcast": 2, "allgather": 1, "reduce_scatter": 1, "alltoall": 1, "barrier": 1}


def test_each_rank_serves_its_bytes_sent_and_a_latency_histogram_per_kind(tmp_path):
    body = HELPERS + RUN_EVERY_KIND + """
stats = rr.stats()
addr = rr.metrics.address()
text, own = scrape(addr[1])
listening = listening_ports()
ports = rr.allgather(np.array([addr[1]]))  # one more allgather, after the scrape
others = {r: scrape(int(p))[1] for r, p in enumerate(ports.tolist())} if rr.rank() == 0 else None
rr.barrier()  # the others serve on until rank 0 has scraped them
result = dict(stats=stats, addr=addr, own=own, text=text, listening=listening, others=others,
              host=socket.gethostname())
"""
    ranks = run_ranks(3, body, tmp_path, env=ON, timeout=180)
    for r in ranks:
        res = r.result
        addr, own, stats = res["addr"], res["own"], res["stats"]
        assert addr[0] == "127.0.0.1" and addr[1] > 0  # RINGREDUCE_METRICS_ADDR's default
        assert f"ringreduce: rank {r.rank} serves Prometheus metrics at http://127.0.0.1:{addr[1]}/metrics" \
            in r.stderr
        assert res["listening"] == [addr[1]]  # the endpoint, and nothing else, listens
        me = dict(rank=r.rank, local_rank=r.rank, host=res["host"], job="metrics-test-job")
        assert stats["bytes_sent"] > 0
        assert stats["bytes_received"] > 0
        for via in ("tcp", "shm", "cma", "arena", "mpi"):
            assert value(own, "ringreduce_transport_sent_bytes_total", transport=via, **me) == stats[via], via
            assert value(own, "ringreduce_transport_received_bytes_total", transport=via, **me) \
                == stats[f"received_{via}"], via
        for kind in ("ring", "blobs", "alltoall"):
            assert value(own, "ringreduce_purpose_sent_bytes_total", purpose=kind, **me) == stats[kind], kind
        for kind, n in RAN.items():
            assert value(own, "ringreduce_collective_duration_seconds_count", kind=kind, **me) == n, kind
            assert value(own, "ringreduce_collective_duration_seconds_bucket", kind=kind, le="+Inf", **me) == n
            assert value(own, "ringreduce_collective_duration_seconds_sum", kind=kind, **me) > 0
        assert value(own, "ringreduce_world_size", **me) == 3
        assert value(own, "ringreduce_elastic_generation", **me) == 0
        assert value(own, "ringreduce_elastic_resets_total", **me) == 0
        assert "ringreduce_peer_lost_total" not in names(own)  # nobody was lost
        assert "ringreduce_engine_queue_depth" not in names(own)  # no engine was started
        # every sample carries the four labels
        assert all({"rank", "local_rank", "host", "job"} <= set(lab) for _, lab, _ in own)
    # rank 0 scraped every rank's endpoint: each names itself, and counts the allgather after its scrape
    others = ranks[0].result["others"]
    for r in range(3):
        assert value(others[r], "ringreduce_collective_duration_seconds_count", kind="allgather", rank=r) == 2
        assert {lab["rank"] for _, lab, _ in others[r]} == {str(r)}


def test_ringrun_ranks_serve_on_the_port_plus_their_local_rank_labelled_with_the_job(tmp_path):
    base = free_port()
    while True:  # two free ports in a row
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            base = free_port()
    code = HELPERS + """
import json, numpy as np, ringreduce as rr
rr.init()
rr.allreduce(np.ones(10))
_, own = scrape(rr.metrics.address()[1])
jobs = {lab["job"] for _, lab, _ in own}
print("METRICS", json.dumps([rr.rank(), rr.local_rank(), rr.metrics.address()[1], os.environ["RINGREDUCE_JOB"],
                             sorted(jobs)]), flush=True)
rr.barrier()
"""
    env = {k: v for k, v in os.environ.items() if k != "RINGREDUCE_JOB"}
    env.update(RINGREDUCE_METRICS_PORT=str(base),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, "-c",
                          textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line.split("METRICS ", 1)[1]) for line in out.stdout.splitlines() if "METRICS " in line]
    assert sorted(r[0] for r in rows) == [0, 1]
    job = rows[0][3]
    assert job.startswith("ringrun-") and all(r[3] == job for r in rows)  # one id for the whole job
    for rank, local_rank, port, _, labelled in rows:
        assert port == base + local_rank
        assert labelled == [job]


@pytest.mark.parametrize("setting, says", [("ninety", "RINGREDUCE_METRICS_PORT='ninety' is not an integer"),
                                           ("70000", "RINGREDUCE_METRICS_PORT=70000 makes no sense"),
                                           ("-1", "RINGREDUCE_METRICS_PORT=-1 makes no sense")])
def test_a_bad_metrics_port_fails_init_on_every_rank_naming_the_setting(tmp_path, setting, says):
    body = """
try:
    rr.init()
    result = "initialized"
except ValueError as exc:
    result = (str(exc), rr.is_initialized())
"""
    ranks = run_ranks(2, body, tmp_path, env={"RINGREDUCE_METRICS_PORT": setting}, init=False, timeout=60)
    for r in ranks:
        assert r.result[0].startswith(says) and r.result[1] is False, r.result


def test_a_metrics_port_in_use_fails_init_naming_the_rank_and_the_address(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        body = """
try:
    rr.init()
    result = "initialized"
except OSError as exc:
    result = (str(exc), rr.is_initialized(), rr.metrics.address())
"""
        ranks = run_ranks(1, body, tmp_path, env={"RINGREDUCE_METRICS_PORT": str(port)}, init=False, timeout=60)
    message, initialized, address = ranks[0].result
    assert f"rank 0: RINGREDUCE_METRICS_PORT={port}: cannot serve metrics on 127.0.0.1:{port}" in message
    assert initialized is False and address is None  # init() left the ring again: it may be retried


def test_with_metrics_off_nothing_listens_and_prometheus_client_is_never_imported(tmp_path):
    body = HELPERS.replace("from prometheus_client.parser import text_string_to_metric_families", "") + """
import sys
rr.allreduce(np.arange(300_000, dtype=np.float32))
rr.broadcast(np.ones(3))
result = (listening_ports(), "prometheus_client" in sys.modules, "ringreduce.metrics" in sys.modules)
"""
    env = {"RINGREDUCE_METRICS_PORT": ""}  # unset, as an empty setting is
    for r in run_ranks(2, body, tmp_path, env=env, timeout=60):
        assert r.result == ([], False, False)
        assert "Prometheus" not in r.stderr


def test_the_engine_queue_depth_and_cycles(tmp_path):
    flag = tmp_path / "scraped"
    body = HELPERS + f"""
import time
from ringreduce.engine import engine
port = rr.metrics.address()[1]
if rr.rank() == 0:
    h = engine().enqueue("w", np.ones(8))  # rank 1 holds it back until rank 0 has scraped
    _, waiting = scrape(port)
    open({str(flag)!r}, "w").close()
else:
    while not os.path.exists({str(flag)!r}):
        time.sleep(0.01)
    h = engine().enqueue("w", np.ones(8))
    waiting = None
reduced = engine().wait(h)
_, done = scrape(port)
result = dict(waiting=waiting, done=done, reduced=reduced.tolist())
"""
    ranks = run_ranks(2, body, tmp_path, env=ON, timeout=120)
    assert value(ranks[0].result["waiting"], "ringreduce_engine_queue_depth", rank=0) == 1
    for r in ranks:
        done = r.result["done"]
        assert r.result["reduced"] == [1.0] * 8  # avg of ones
        assert value(done, "ringreduce_engine_queue_depth", rank=r.rank) == 0
        assert value(done, "ringreduce_engine_cycles_total", rank=r.rank) >= 1
        assert value(done, "ringreduce_engine_cycle_seconds_total", rank=r.rank) > 0
        assert value(done, "ringreduce_engine_last_cycle_seconds", rank=r.rank) > 0
        assert value(done, "ringreduce_engine_negotiation_passes_total", rank=r.rank) >= 1
        # the engine's allreduce ran as a collective (one bucket: one ring allreduce)
        assert value(done, "ringreduce_collective_duration_seconds_count", kind="allreduce", rank=r.rank) == 1


def test_the_engines_straggler_scores_are_scraped_on_every_rank(tmp_path):
    """The default score source is the engine's straggler report: a scrape of
    each rank of a 2-rank engine job holds one ringreduce_straggler_score per
    rank, the report's own, and rank 1 (busy longer between cycles) scores lower."""
    body = HELPERS + """
import time
from ringreduce.engine import engine
port = rr.metrics.address()[1]
for i in range(12):
    if rr.rank() == 1:
        time.sleep(0.05)  # rank 1 computes longer between two collectives
    engine().wait(engine().enqueue(f"g{i}", np.ones(4)))
rr.barrier()  # no engine cycle after this: the report and the scrape see the same window
report = rr.straggler_report()
_, scraped = scrape(port)
result = dict(scores={x["rank"]: x["score"] for x in report["ranks"]}, scraped=scraped)
"""
    env = {**ON, "RINGREDUCE_STRAGGLER_WINDOW": "8", "RINGREDUCE_STRAGGLER_THRESHOLD": "off"}
    for r in run_ranks(2, body, tmp_path, env=env, timeout=120):
        scores = {int(k): v for k, v in r.result["scores"].items()}
        assert sorted(scores) == [0, 1]
        scraped = {int(lab["peer"]): v for n, lab, v in r.result["scraped"] if n == "ringreduce_straggler_score"}
        assert scraped == pytest.approx(scores)
        assert scraped[0] == 1.0 and scraped[1] < 0.9


def test_a_lost_peer_is_counted_once_naming_it(tmp_path):
    body = HELPERS + """
rr.barrier()
if rr.rank() == 1:
    os._exit(7)
try:
    rr.allreduce(np.ones(1 << 20, dtype=np.float32))
    result = "no error"
except rr.PeerLostError as exc:
    _, got = scrape(rr.metrics.address()[1])
    result = (exc.rank, got)
"""
    ranks = run_ranks(2, body, tmp_path, env={**ON, "RINGREDUCE_TIMEOUT": "20"}, timeout=120, check=False)
    assert ranks[1].returncode == 7
    lost_rank, got = ranks[0].result
    assert lost_rank == 1
    assert value(got, "ringreduce_peer_lost_total", peer=1, rank=0) == 1
    assert value(got, "ringreduce_collective_errors_total", kind="allreduce", error="PeerLostError") == 1
    assert value(got, "ringreduce_collective_duration_seconds_count", kind="barrier") == 1  # failures: not timed
    assert ("ringreduce_collective_duration_seconds_count", "allreduce") not in {
        (n, lab.get("kind")) for n, lab, _ in got}


def test_a_peer_lost_while_the_engine_negotiates_is_counted_once_as_the_engines(tmp_path):
    body = HELPERS + """
from ringreduce.engine import engine
rr.barrier()
if rr.rank() == 1:
    os._exit(7)
h = engine().enqueue("w", np.ones(8))  # rank 1 never offers it: the negotiation pass meets its death
try:
    engine().wait(h)
    result = "no error"
except rr.PeerLostError as exc:
    _, got = scrape(rr.metrics.address()[1])
    result = (exc.rank, got)
"""
    ranks = run_ranks(2, body, tmp_path, env={**ON, "RINGREDUCE_TIMEOUT": "20"}, timeout=120, check=False)
    assert ranks[1].returncode == 7
    lost_rank, got = ranks[0].result
    assert lost_rank == 1
    assert value(got, "ringreduce_peer_lost_total", peer=1, rank=0) == 1
    assert [(lab["kind"], lab["error"], v) for n, lab, v in got if n == "ringreduce_collective_errors_total"] == \
        [("engine", "PeerLostError", 1.0)]


def test_serve_by_hand_stop_and_the_straggler_score_source(tmp_path):
    body = HELPERS + """
import urllib.error
problems = []
for bad in (-1, 65536, "9400", True):
    try:
        rr.metrics.serve(bad)
    except ValueError as exc:
        problems.append(str(exc))
port = rr.metrics.serve(0)
try:
    rr.metrics.serve(0)
except RuntimeError as exc:
    problems.append(str(exc))
rr.allreduce(np.ones(3))
_, plain = scrape(port)
rr.metrics.set_straggler_source(lambda: {0: 0.25, 1: 1.5})
_, scored = scrape(port)
def broken():
    raise RuntimeError("no scores yet")
rr.metrics.set_straggler_source(broken)
_, unscored = scrape(port)
rr.metrics.set_straggler_source(None)
rr.metrics.stop()
try:
    scrape(port)
    stopped = False
except urllib.error.URLError:
    stopped = True
result = dict(port=port, problems=problems, plain=plain, scored=scored, unscored=unscored, stopped=stopped,
              listening=listening_ports())
"""
    res = run_ranks(1, body, tmp_path, timeout=60)[0].result
    assert len(res["problems"]) == 5
    assert all("metrics port must be an integer 0 .. 65535" in p for p in res["problems"][:4])
    assert f"already serves metrics on http://127.0.0.1:{res['port']}/metrics" in res["problems"][4]
    assert value(res["plain"], "ringreduce_collective_duration_seconds_count", kind="allreduce", rank=0) == 1
    assert "ringreduce_straggler_score" not in names(res["plain"])  # no engine ran here: nothing scored
    assert value(res["scored"], "ringreduce_straggler_score", peer=0, rank=0) == 0.25
    assert value(res["scored"], "ringreduce_straggler_score", peer=1, rank=0) == 1.5
    assert "ringreduce_straggler_score" not in names(res["unscored"])  # a failing source: the scrape goes on
    assert res["stopped"] and res["listening"] == []


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_elastic_worker_serves_its_generation_resets_and_lost_peers():
    from test_elastic import JOB, ElasticRun, killer
    run = ElasticRun(["-np", "3", "--min-np", "2", sys.executable, JOB, "80", "0.03"], kill_when=killer(8, 1),
                     env={"RINGREDUCE_METRICS_PORT": "0"}, timeout=140)
    assert run.proc.returncode == 0 and run.kills, run.stderr[-3000:]
    done = run.done()
    jobs = set()
    for d in done:  # the survivors, and the restarted worker if it joined before the end
        m = d["metrics"]
        assert value(m, "ringreduce_elastic_generation", rank=d["rank"]) == d["generation"] >= 2
        assert value(m, "ringreduce_elastic_resets_total", rank=d["rank"]) == d["resets"]
        assert value(m, "ringreduce_world_size", rank=d["rank"]) == d["size"]
        jobs |= {lab["job"] for _, lab, _ in m}
    assert len(jobs) == 1 and jobs.pop().startswith("ringrun-")  # one id for the whole job, restarts too
    survivors = [d for d in done if d["resets"] >= 1]  # rank 1 lost at step 8: reset, and again if it came back
    assert len(survivors) == 2
    for d in survivors:
        lost = [(lab["peer"], v) for n, lab, v in d["metrics"] if n == "ringreduce_peer_lost_total"]
        assert lost == [("1", 1.0)], lost  # counted once, naming the rank killed
        assert sum(v for n, lab, v in d["metrics"]
                   if n == "ringreduce_collective_errors_total" and lab["error"] == "PeerLostError") == 1
