"""ringreduce under a real Slurm (tests/slurm_cluster.py: munged, slurmctld and
two slurmd daemons, nodes n1 and n2, on this machine): `srun -N2 -n4` trains
to the same weights, bit for bit, as `ringrun -np 4`, with no PMI; so does
srun in an sbatch script, whose own step is a world of one; so is salloc's
shell; ringrun inside an allocation starts its ranks on the allocation's
nodes over srun. Without slurm-wlm and munge these tests skip, but under CI
(CI=true; .ci/run installs them) they fail."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringreduce.core import slurm

import slurm_cluster

REPO = Path(__file__).resolve().parent.parent
JOB = [sys.executable, str(REPO / "tests" / "slurm_job.py")]
RINGRUN = [sys.executable, "-m", "ringreduce"]

pytestmark = pytest.mark.slow  # each test, alone, starts the cluster (about 10 s) and trains twice


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm_cluster.why_not()
    action = slurm_cluster.when_missing(why, os.environ)
    if action == "fail":
        pytest.fail(f"CI must run the Slurm tests: {why}")
    if action == "skip":
        pytest.skip(why)
    c = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    c.env.update(HOME=str(tmp_path_factory.mktemp("home")), PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    yield c
    c.stop()


def run(argv, env, timeout=180):
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert p.returncode == 0, f"{argv} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def results(out: Path, n: int) -> list[dict]:
    found = sorted(out.glob("rank*.npz"))
    assert len(found) == n, f"{n} ranks should have written their weights, found {[f.name for f in found]}"
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(n)]


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def ringrun_weights(cluster, tmp_path_factory):
    """The weights of `ringrun -np 4` on this machine, outside Slurm: what every Slurm way must give."""
    out = tmp_path_factory.mktemp("ringrun")
    env = {k: v for k, v in cluster.env.items() if not k.startswith("SLURM")}
    run([*RINGRUN, "-np", "4", *JOB, str(out)], env)
    ranks = results(out, 4)
    assert all(same_bits(r["w"], ranks[0]["w"]) for r in ranks)
    return ranks[0]["w"]


def test_srun_without_pmi_trains_like_ringrun(cluster, ringrun_weights, tmp_path):
    run(["srun", "-N2", "-n4", *JOB, str(tmp_path)], cluster.env)
    ranks = results(tmp_path, 4)
    assert [str(r["source"]) for r in ranks] == ["srun"] * 4
    assert [str(r["node"]) for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert [(int(r["size"]), int(r["local_rank"]), int(r["local_size"])) for r in ranks] == [
        (4, 0, 2), (4, 1, 2), (4, 0, 2), (4, 1, 2)]
    for r in ranks:
        assert same_bits(r["w"], ringrun_weights)
    assert (Path(cluster.env["HOME"]) / slurm.KEY_FILE).exists()  # the secret came from the user's key


def test_srun_in_an_sbatch_script_trains_like_ringrun_and_the_script_is_a_world_of_one(cluster, ringrun_weights,
                                                                                     tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -e\n"
                      f"{sys.executable} -c 'import ringreduce as rr; rr.init(); print(\"script world\", rr.size())'\n"
                      f"srun {' '.join(JOB)} {tmp_path}\n")
    log = tmp_path / "job.out"
    job = run(["sbatch", "--parsable", "-N2", "-n4", f"--output={log}", str(script)], cluster.env).stdout.strip()
    state = cluster.wait_for_job(job.split(";")[0], timeout=180)  # sooner than sbatch --wait's polling
    assert state == ("COMPLETED", "0:0"), f"{state}\n{log.read_text() if log.exists() else ''}"
    assert "script world 1" in log.read_text()
    ranks = results(tmp_path, 4)
    assert [str(r["node"]) for r in ranks] == ["n1", "n1", "n2", "n2"]
    for r in ranks:
        assert same_bits(r["w"], ringrun_weights)


def test_an_interactive_allocation_without_srun_is_a_world_of_one(cluster):
    p = run(["salloc", "-N2", "-n4", sys.executable, "-c",
             "import os, ringreduce as rr; rr.init(); print('world', rr.size(), os.environ['SLURM_JOB_ID'])"],
            cluster.env)
    assert "world 1 " in p.stdout


def test_ringrun_in_an_allocation_starts_ranks_on_its_nodes(cluster, ringrun_weights, tmp_path):
    run(["salloc", "-N2", "-n4", *RINGRUN, "-np", "4", *JOB, str(tmp_path)], cluster.env)
    ranks = results(tmp_path, 4)
    assert [str(r["node"]) for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert [str(r["source"]) for r in ranks] == ["RINGREDUCE_* environment"] * 4
    assert [(int(r["local_rank"]), int(r["local_size"])) for r in ranks] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    for r in ranks:
        assert same_bits(r["w"], ringrun_weights)


def test_the_hostlist_parser_agrees_with_scontrol(cluster):
    text = "node[01-04,07],gpu-[1-2],x[8-10],y[098-101],r[1-2]n[1-2],solo"
    p = run(["scontrol", "show", "hostnames", text], cluster.env)
    assert slurm.expand_hostlist(text) == p.stdout.split()


def test_a_nodes_address_is_its_nodeaddr(cluster, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    assert slurm.node_address("n2") == "127.0.0.1"
    assert slurm.node_address("no-such-node") == "no-such-node"


def test_no_rank_outlives_ringrun_in_an_allocation(cluster, tmp_path):
    """ringrun killed by SIGKILL inside the allocation (which lives on): its
    ranks, started over srun on both nodes, end too (the guard's stdin, passed
    by srun, closes), and their steps with them."""
    job = tmp_path / "sleeper.py"
    job.write_text("import os, sys, time, ringreduce as rr\nrr.init()\n"
                   f"open(os.path.join({str(tmp_path)!r}, f'pid{{rr.rank()}}'), 'w').write(str(os.getpid()))\n"
                   "time.sleep(300)\n")
    script = f"""
{' '.join(RINGRUN)} -np 4 {sys.executable} {job} &
for i in $(seq 120); do [ $(ls {tmp_path} | grep -c '^pid') = 4 ] && break; sleep 0.5; done
echo ranks up: $(ls {tmp_path} | grep -c '^pid')
kill -9 $!
pids=$(cat {tmp_path}/pid*)
for i in $(seq 60); do
    alive=0; for p in $pids; do kill -0 $p 2>/dev/null && alive=1; done
    [ $alive = 0 ] && [ -z "$(squeue -h -s -j $SLURM_JOB_ID)" ] && break
    sleep 0.5
done
echo alive: $alive steps: $(squeue -h -s -j $SLURM_JOB_ID | wc -l)
"""
    p = run(["salloc", "-N2", "-n4", "bash", "-c", script], cluster.env)
    assert "ranks up: 4" in p.stdout, p.stdout + p.stderr
    assert "alive: 0 steps: 0" in p.stdout, p.stdout + p.stderr
