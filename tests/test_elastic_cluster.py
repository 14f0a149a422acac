"""Elastic training across emulated hosts (one network namespace each): one
host's link goes down mid-training; the survivors on the other host notice
by RINGREDUCE_TIMEOUT, go on as a smaller world, lose no committed step and
end bit-identical. ringrun runs inside the first host's namespace and starts
the workers of the others over a fake ssh (ip netns exec)."""
import subprocess
import sys
import time

import pytest

from ranks import REPO
from test_elastic import JOB, ElasticRun
from test_launcher import _fake_ssh

sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import Cluster, can_build  # noqa: E402

REASON = can_build()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cannot make network namespaces here: {REASON}")

TIMEOUT = 3.0  # ringrun --timeout: RINGREDUCE_TIMEOUT of the workers and how long the rendezvous waits for them
STEPS, DOWN_AT = 100, 15


def link_down_at(cluster: Cluster, host: int, step: int, downs: list):
    """A kill_when that sets `host`'s link down once one of its workers committed `step`."""
    def watch(line):
        prefix, _, rest = line.partition("] ")
        words = rest.split()
        if (not downs and prefix.startswith(f"[{cluster.addresses[host]}#") and words[:1] == ["committed"]
                and int(words[1]) >= step and words[7] == "4"):  # (under load the first world may be 2, then 4)
            subprocess.run(["ip", "-n", cluster.namespaces[host], "link", "set", "eth0", "down"], check=True)
            downs.append(time.time())
        return None
    return watch


@pytest.mark.timeout(90)
@pytest.mark.parametrize("local_first", [True, False], ids=["local-and-remote", "all-over-ssh"])
def test_a_host_whose_link_goes_down_is_lost_and_the_other_goes_on(tmp_path, local_first):
    with Cluster(2) as cluster:
        ssh = _fake_ssh(tmp_path, dict(zip(cluster.addresses, cluster.namespaces)))
        first = "localhost" if local_first else cluster.addresses[0]
        hosts = f"{first}:2,{cluster.addresses[1]}:2"
        downs: list = []
        run = ElasticRun(["-np", "4", "--min-np", "2", "-H", hosts, "--ssh", ssh, "--timeout", str(TIMEOUT),
                          sys.executable, JOB, str(STEPS), "0.03"],
                         kill_when=link_down_at(cluster, 1, DOWN_AT, downs), timeout=80,
                         prefix=["ip", "netns", "exec", cluster.namespaces[0]])
    assert cluster.leftovers() == []
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert downs, "the link was never set down\n" + run.stderr[-3000:]
    done = run.done()
    # the two workers of the host still connected finish, as a world of 2, with the same bits
    assert len(done) == 2, run.stderr[-3000:]
    assert {d["worker"].split("#")[0] for d in done} == {first}
    assert len({d["sha"] for d in done}) == 1
    for d in done:
        assert d["steps"] == STEPS and d["uniform"] and d["w0"] == d["expected"], d
        assert d["size"] == 2 and d["links"] == {"next": "shm", "prev": "shm"}
    sizes = done[0]["sizes"]
    assert 4 in sizes and sizes[-1] == 2, sizes
    # the lost host counts as lost: the rendezvous saw its workers' connections go (keepalive unanswered)
    events = [e for e in run.stderr.splitlines() if e.startswith("ringrun: rendezvous:")]
    remote = {w for w in (e.split()[3] for e in events if "registered" in e) if w.startswith(cluster.addresses[1])}
    lost = {e.split()[3] for e in events if ", member)" in e or "did not come back" in e} & remote
    assert len(remote) == 2 and lost == remote, "\n".join(events)
    # no committed step lost or repeated across the reset, by the survivors (the cut-off host's workers
    # still print: one may have finished the allreduce its peers did not, and committed a step alone)
    by_gen: dict = {}
    for line in run.lines:
        words = line.split()
        if line.startswith(f"[{first}#") and words[1:2] == ["committed"]:
            by_gen.setdefault(int(words[4]), set()).add(int(words[2]))
    gens = sorted(by_gen)
    assert len(gens) >= 2, by_gen
    for a, b in zip(gens, gens[1:]):
        assert min(by_gen[b]) == max(by_gen[a]) + 1, (a, b, sorted(by_gen[a])[-5:], sorted(by_gen[b])[:5])
    # recovery: link down to the first commit of the smaller world (a figure for docs/elastic.md, not a bound)
    first_small = min(float(line.split()[-1]) for line in run.lines
                      if "committed" in line and " size 2 " in line and float(line.split()[-1]) > downs[0])
    print(f"\nrecovery after the link went down: {first_small - downs[0]:.2f} s (--timeout {TIMEOUT:g})")


@pytest.mark.timeout(120)
def test_when_the_link_comes_back_the_host_rejoins_and_the_world_is_4_again(tmp_path):
    steps = 800
    with Cluster(2) as cluster:
        ssh = _fake_ssh(tmp_path, dict(zip(cluster.addresses, cluster.namespaces)))
        downs, ups = [], []
        down = link_down_at(cluster, 1, DOWN_AT, downs)

        def watch(line):
            down(line)
            words = line.split("] ", 1)[-1].split()
            # back up once the survivors trained a while as a world of 2
            if downs and not ups and words[:1] == ["committed"] and words[7] == "2" and time.time() - downs[0] > 6:
                subprocess.run(["ip", "-n", cluster.namespaces[1], "link", "set", "eth0", "up"], check=True)
                ups.append(time.time())
        run = ElasticRun(["-np", "4", "--min-np", "2", "-H", f"localhost:2,{cluster.addresses[1]}:2", "--ssh", ssh,
                          "--timeout", str(TIMEOUT), sys.executable, JOB, str(steps), "0.03"],
                         kill_when=watch, timeout=110, prefix=["ip", "netns", "exec", cluster.namespaces[0]])
    assert cluster.leftovers() == []
    assert run.proc.returncode == 0, run.stderr[-3000:]
    assert downs and ups, run.stderr[-3000:]
    # the cut-off workers learn on reconnection that ringrun dropped them, end, and are started again there
    assert f"worker {cluster.addresses[1]}#" in run.stderr and "restarting it" in run.stderr
    done = run.done()
    assert len(done) == 4, run.stderr[-3000:]
    assert sorted(d["worker"].split("#")[0] for d in done) == sorted(["localhost"] * 2 + [cluster.addresses[1]] * 2)
    assert len({d["sha"] for d in done}) == 1
    for d in done:
        assert d["steps"] == steps and d["uniform"] and d["w0"] == d["expected"] and d["size"] == 4, d
    sizes = done[0]["sizes"]
    assert 2 in sizes and sizes[-1] == 4, sizes
