"""Kubernetes operators' jobs end to end, with two network namespaces standing in
for two pods (benchmarks/cluster.py): each pod gets exactly the environment its
operator sets (tests/test_kubernetes_discovery.py names the sources) and the
job secret, as a Kubernetes Secret would give it. One process per pod, and
`ringrun -np 2` in each pod (a world of 4), allreduce correctly and end
bit-identical; a torch process group holding MASTER_PORT on the master pod
is no obstacle. An MPIJob's launcher runs ringrun with the operator's hostfile
and reaches the worker pods over (fake) ssh."""
import json
import os
import secrets
import subprocess
import sys

import pytest

from ranks import REPO
from test_kubernetes_discovery import pytorchjob_v18, trainjob
from test_launcher import _fake_ssh

sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import Cluster, can_build  # noqa: E402

REASON = can_build()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cannot make network namespaces here: {REASON}")

# Each rank: its place, and the allreduce of values exact in float32 (checked
# against the sum) and of random ones (whose bits must agree on every rank).
# On the master pod's first process, a stand-in for torch's process group
# holds MASTER_PORT first, as init_process_group's TCPStore would.
JOB = """
import hashlib, json, os, socket, numpy as np, ringreduce as rr
torch_store = None
if os.environ.get("HOLD_TORCH_PORT") and os.environ.get("RINGREDUCE_LOCAL_RANK", "0") == "0":
    torch_store = socket.create_server(("0.0.0.0", int(os.environ["HOLD_TORCH_PORT"])))
rr.init()
r = rr.rank()
exact = rr.allreduce(np.arange(1 << 16, dtype=np.float32) % 7 + r)
rand = rr.allreduce(np.random.default_rng(r).standard_normal(1 << 18).astype(np.float32))
print(json.dumps({"rank": r, "size": rr.size(), "local": [rr.local_rank(), rr.local_size()],
                  "exact": bool((exact == (np.arange(1 << 16) % 7) * rr.size() + sum(range(rr.size()))).all()),
                  "sha": hashlib.sha256(rand.tobytes()).hexdigest(), "first": float(rand[0])}))
"""

CLEAN = ("RINGREDUCE_", "PET_", "OMPI_", "PMI_", "PMIX_", "HYDRA_", "I_MPI_", "TORCHELASTIC_", "SLURM_")


def pod_env(operator_env: dict, secret: str, **extra) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)
            and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TF_CONFIG")}
    return {**base, "PYTHONPATH": str(REPO), **operator_env, "RINGREDUCE_SECRET": secret, **extra}


def operator_envs(operator: str, cluster: Cluster) -> list:
    """What the operator sets on pod 0 and pod 1, the master's address being pod 0's."""
    if operator == "PyTorchJob":
        envs = [pytorchjob_v18(i, pods=2) for i in range(2)]
        for env in envs:
            env.update(MASTER_ADDR=cluster.addresses[0], MASTER_PORT="23456")
        return envs
    envs = [trainjob(i, nodes=2) for i in range(2)]
    for env in envs:
        env["PET_MASTER_ADDR"] = cluster.addresses[0]
    return envs


def results(procs) -> list:
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), [o[1][-2000:] for o in outs]
    rows = [json.loads(line.split("] ", 1)[-1]) for out, _ in outs for line in out.splitlines() if "{" in line]
    return sorted(rows, key=lambda row: row["rank"])


def check_world(rows, size: int, per_pod: int):
    assert [row["rank"] for row in rows] == list(range(size))
    assert all(row["size"] == size and row["exact"] for row in rows), rows
    assert [row["local"] for row in rows] == [[i % per_pod, per_pod] for i in range(size)]
    assert len({row["sha"] for row in rows}) == 1, "every rank ends with the same bits"
    rng = [__import__("numpy").random.default_rng(r).standard_normal(1 << 18).astype("float32")[0] for r in range(size)]
    assert abs(rows[0]["first"] - float(sum(map(float, rng)))) < 1e-4


@pytest.mark.timeout(150)
@pytest.mark.parametrize("operator", ["PyTorchJob", "TrainJob"])
def test_one_process_per_pod_is_a_world_of_the_pods(operator):
    secret = secrets.token_hex(16)
    with Cluster(2) as cluster:
        envs = operator_envs(operator, cluster)
        torch_port = envs[0].get("MASTER_PORT") or envs[0]["PET_MASTER_PORT"]
        procs = [cluster.popen(i, [sys.executable, "-c", JOB],
                               pod_env(env, secret, **({"HOLD_TORCH_PORT": torch_port} if i == 0 else {})),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, env in enumerate(envs)]
        rows = results(procs)
    assert cluster.leftovers() == []
    check_world(rows, 2, 1)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("operator", ["PyTorchJob", "TrainJob"])
def test_ringrun_np_2_in_each_pod_is_one_world_of_4(operator):
    secret = secrets.token_hex(16)
    with Cluster(2) as cluster:
        envs = operator_envs(operator, cluster)
        torch_port = envs[0].get("MASTER_PORT") or envs[0]["PET_MASTER_PORT"]
        procs = [cluster.popen(i, [sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2",
                                   sys.executable, "-c", JOB],
                               pod_env(env, secret, **({"HOLD_TORCH_PORT": torch_port} if i == 0 else {})),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
                 for i, env in enumerate(envs)]
        rows = results(procs)
    assert cluster.leftovers() == []
    check_world(rows, 4, 2)


@pytest.mark.timeout(150)
def test_an_mpijob_launcher_runs_ringrun_on_the_workers_in_its_hostfile(tmp_path):
    with Cluster(2) as cluster:
        hostfile = tmp_path / "hostfile"  # as MPI Operator v2 writes it for Open MPI, addresses for names
        hostfile.write_text("".join(f"{a} slots=2\n" for a in cluster.addresses))
        ssh = _fake_ssh(tmp_path, dict(zip(cluster.addresses, cluster.namespaces)))
        launcher = subprocess.Popen([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "4", "--ssh", ssh,
                                     sys.executable, "-c", JOB],
                                    env=pod_env({"OMPI_MCA_orte_default_hostfile": str(hostfile),
                                                 "OMPI_MCA_orte_keep_fqdn_hostnames": "true"}, ""),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
        rows = results([launcher])
    assert cluster.leftovers() == []
    check_world(rows, 4, 2)
