"""A pod of a Kubeflow PyTorchJob or TrainJob is a world (ringreduce/core/kubernetes.py),
from exactly the variables each operator sets on it (training-operator v1
pkg/controller.v1/pytorch/envvar.go and master.go; Trainer v2
pkg/runtime/framework/plugins/torch/torch.go); ringrun in a pod makes the pod's
processes ranks node_rank * L + i of pods * L; an MPIJob launcher's hostfile
gives ringrun its hosts. A process torchrun started stays refused."""
import os
import re
import subprocess
import sys

import pytest

from ranks import REPO
from ringreduce.core import kubernetes
from ringreduce.core.world import discover
from ringreduce.errors import RingReduceError
from ringreduce.launch import ringrun

SECRET = {"RINGREDUCE_SECRET": "s3cret"}


def pytorchjob_v17(index: int, pods: int = 3) -> dict:
    """A pod of a PyTorchJob, training-operator up to v1.7: pod `index` (master 0, worker i is i + 1)."""
    return {"PYTHONUNBUFFERED": "0", "MASTER_PORT": "23456", "MASTER_ADDR": "mnist-master-0",
            "WORLD_SIZE": str(pods), "RANK": str(index)}


def pytorchjob_v18(index: int, pods: int = 3, nproc: str = "auto") -> dict:
    """Likewise from v1.8: WORLD_SIZE is pods * nprocPerNode when that is an integer, plus PET_*."""
    per = int(nproc) if nproc.isdigit() else 1
    return {**pytorchjob_v17(index, pods), "WORLD_SIZE": str(pods * per), "PET_NPROC_PER_NODE": nproc,
            "PET_NODE_RANK": str(index), "PET_NNODES": str(pods)}


def trainjob(index: int, nodes: int = 3, nproc: str = "auto") -> dict:
    """A pod of a TrainJob (Trainer v2, torch runtime) named "mnist"."""
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29400"}


@pytest.mark.parametrize("make, host, port, source", [
    (pytorchjob_v17, "mnist-master-0", 23457, "PyTorchJob pod"),
    (pytorchjob_v18, "mnist-master-0", 23457, "PyTorchJob pod"),
    (trainjob, "mnist-node-0-0.mnist", 29401, "TrainJob pod"),
])
def test_one_process_per_pod_is_the_pods_rank_of_the_pods(make, host, port, source):
    for index in range(3):
        w = discover({**make(index), **SECRET})
        assert (w.rank, w.size, w.local_rank, w.local_size) == (index, 3, 0, 1)
        # torch's port is torch's: ringreduce's rendezvous is the next one, on the master pod
        assert w.addr == (host, port) and w.secret == b"s3cret" and w.source == source


def test_ringreduce_port_overrides_the_default_next_to_torchs():
    assert discover({**trainjob(1), **SECRET, "RINGREDUCE_PORT": "4000"}).addr == ("mnist-node-0-0.mnist", 4000)
    with pytest.raises(RingReduceError, match="RINGREDUCE_PORT=70000 must be a port"):
        discover({**trainjob(1), **SECRET, "RINGREDUCE_PORT": "70000"})


@pytest.mark.parametrize("env, says", [
    # the operator fixed 4 processes per pod: a lone process would be 1 of them, not the pod
    ({**pytorchjob_v18(1, nproc="4"), **SECRET}, "PET_NPROC_PER_NODE=4 processes per pod.*ringrun -np 4"),
    ({**trainjob(1, nproc="4"), **SECRET}, "PET_NPROC_PER_NODE=4 processes per pod.*ringrun -np 4"),
    # across pods, ranks listen beyond loopback only with the job secret
    (pytorchjob_v17(1), "RINGREDUCE_SECRET is not set.*Kubernetes Secret"),
    (trainjob(0), "RINGREDUCE_SECRET is not set"),
    # an elasticPolicy: torchrun's own rendezvous, no node ranks
    ({"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "mnist-worker-0:23456", "PET_RDZV_BACKEND": "c10d", **SECRET},
     "PET_NNODES=1:4 is an elastic PyTorchJob"),
    ({**pytorchjob_v18(1), "WORLD_SIZE": "5", **SECRET}, "RANK=1 and WORLD_SIZE=5 disagree"),
    ({**trainjob(3), **SECRET}, "node rank 3 is not in 0 .. 2"),
    # Worker replicas only, no Master: the operator sets PET_NNODES and no rank
    ({"PYTHONUNBUFFERED": "0", "PET_NNODES": "3", **SECRET}, "PET_NODE_RANK is not.*without a Master replica"),
    ({**trainjob(1), "PET_NODE_RANK": "one", **SECRET}, "PET_NODE_RANK='one' is not an integer"),
])
def test_a_pod_environment_that_cannot_be_a_world_is_refused_naming_why(env, says):
    with pytest.raises(RingReduceError, match=says):
        discover(env)


def test_one_pod_is_a_world_of_one_and_needs_no_secret():
    w = discover(trainjob(0, nodes=1))
    assert (w.rank, w.size) == (0, 1)
    assert discover({"PYTHONUNBUFFERED": "0", "PET_NNODES": "1"}).size == 1  # one Worker, no Master


@pytest.mark.parametrize("env", [
    {"MASTER_ADDR": "localhost", "RANK": "0", "WORLD_SIZE": "1"},                           # no MASTER_PORT
    {"MASTER_ADDR": "localhost", "MASTER_PORT": "65535", "RANK": "0", "WORLD_SIZE": "1"},   # port + 1 is none
    {"MASTER_ADDR": "localhost", "MASTER_PORT": "any", "RANK": "0", "WORLD_SIZE": "1"},
    {**trainjob(0, nodes=1), "PET_MASTER_PORT": ""},
])
def test_a_torch_environment_of_one_process_is_a_world_of_one_whatever_its_port(env):
    """A notebook's own torch.distributed variables for one process (or a job of
    one pod): no rendezvous, so no port is needed or checked."""
    w = discover(env)
    assert (w.rank, w.size, w.addr) == (0, 1, None)


def test_a_users_own_torch_variables_for_several_processes_are_refused_saying_what_they_were_read_as():
    env = {"MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    with pytest.raises(RingReduceError, match="RINGREDUCE_SECRET is not set.*read from MASTER_ADDR=localhost, "
                                              "RANK=1 and WORLD_SIZE=2.*your own torch.distributed variables"):
        discover(env)
    with pytest.raises(RingReduceError, match="RINGREDUCE_SECRET is not set") as raised:
        discover(trainjob(1))
    assert "torch.distributed" not in str(raised.value)  # PET_* come from an operator alone


def test_torchruns_processes_stay_refused_even_in_a_pod():
    # torchrun inside a PyTorchJob pod rewrites RANK/WORLD_SIZE per process and adds LOCAL_RANK, TORCHELASTIC_*
    env = {**pytorchjob_v18(1, nproc="2"), "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "none", **SECRET}
    assert kubernetes.pod_job(env) is None
    with pytest.raises(RingReduceError, match="torchrun started 6 processes.*ringrun -np 6"):
        discover(env)


def test_ringreduces_own_variables_come_before_the_pods():
    env = {**trainjob(1), **SECRET, "RINGREDUCE_RANK": "5", "RINGREDUCE_SIZE": "6",
           "RINGREDUCE_ADDR": "mnist-node-0-0.mnist:29401"}
    w = discover(env)
    assert (w.rank, w.size, w.source) == (5, 6, "RINGREDUCE_* environment")


def test_a_half_set_ringreduce_world_in_a_pod_is_still_refused():
    with pytest.raises(RingReduceError, match="RINGREDUCE_SIZE=6 is set but RINGREDUCE_RANK is not"):
        discover({**trainjob(1), **SECRET, "RINGREDUCE_SIZE": "6"})


@pytest.mark.parametrize("make", [pytorchjob_v17, trainjob])
def test_ringrun_in_each_pod_makes_one_world_of_pods_times_its_processes(make):
    seen = []
    for index in range(3):
        envs = ringrun.pod_envs(kubernetes.pod_job({**make(index), **SECRET}), 4, "unused", 9.0)
        assert [e["RINGREDUCE_LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert {e["RINGREDUCE_LOCAL_SIZE"] for e in envs} == {"4"} and {e["RINGREDUCE_SIZE"] for e in envs} == {"12"}
        assert {e["RINGREDUCE_SECRET"] for e in envs} == {"s3cret"}
        assert {e["RINGREDUCE_TIMEOUT"] for e in envs} == {"9.0"}
        assert len({e["RINGREDUCE_ADDR"] for e in envs}) == 1
        seen += [int(e["RINGREDUCE_RANK"]) for e in envs]
        addr = envs[0]["RINGREDUCE_ADDR"]
    assert seen == list(range(12))  # node_rank * 4 + local_rank
    assert addr in ("mnist-master-0:23457", "mnist-node-0-0.mnist:29401")


def test_ringrun_in_the_only_pod_uses_loopback_and_its_own_secret():
    envs = ringrun.pod_envs(kubernetes.pod_job(trainjob(0, nodes=1)), 2, "fresh", None)
    assert [e["RINGREDUCE_ADDR"] for e in envs] == ["127.0.0.1:29401"] * 2
    assert {e["RINGREDUCE_SECRET"] for e in envs} == {"fresh"}


def run_ringrun(args, env, **kw):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RINGREDUCE_", "PET_", "OMPI_", "PMI_", "HYDRA_", "I_MPI_"))
            and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TF_CONFIG")}
    return subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", *args], capture_output=True, text=True,
                          timeout=60, env={**base, "PYTHONPATH": str(REPO), **env}, **kw)


@pytest.mark.parametrize("env, args, says", [
    ({**trainjob(0, nproc="4"), **SECRET}, ["-np", "2"], "PET_NPROC_PER_NODE=4 processes per pod, but 2 asked for"),
    (pytorchjob_v17(0), ["-np", "2"], "RINGREDUCE_SECRET is not set"),
    ({**trainjob(0), **SECRET}, ["--elastic", "-np", "2"], "--elastic inside a TrainJob pod"),
])
def test_ringrun_in_a_pod_refuses_what_cannot_join_the_job(env, args, says):
    out = run_ringrun([*args, sys.executable, "-c", "print('ran')"], env)
    assert out.returncode == 2 and re.search(re.escape(says), out.stderr), out.stderr
    assert "ran" not in out.stdout


def test_ringrun_in_a_pod_starts_its_ranks_with_their_global_ranks():
    code = "import os; print(*[os.environ[f'RINGREDUCE_{k}'] for k in ('RANK', 'SIZE', 'ADDR')])"
    out = run_ringrun(["-np", "2", sys.executable, "-c", code], {**trainjob(2), **SECRET})
    assert out.returncode == 0, out.stderr
    # lines are prefixed, and failures named, by the world's rank, as in every pod's log
    assert sorted(out.stdout.splitlines()) == ["[4] 4 6 mnist-node-0-0.mnist:29401",
                                              "[5] 5 6 mnist-node-0-0.mnist:29401"]
    fail = "import os, sys; sys.exit(3 if os.environ['RINGREDUCE_LOCAL_RANK'] == '1' else 0)"
    out = run_ringrun(["-np", "2", sys.executable, "-c", fail], {**trainjob(2), **SECRET})
    assert out.returncode == 3 and "ringrun: rank 5 exited with code 3" in out.stderr, out.stderr


# -- MPIJob: the launcher's hostfile ------------------------------------------

def test_hostfiles_of_each_mpi_implementation_become_hosts_and_slots(tmp_path):
    ompi = tmp_path / "ompi"  # MPI Operator v2, Open MPI: "<pod>.<svc>.<ns>.svc slots=N"
    ompi.write_text("pi-worker-0.pi-worker.default.svc slots=2\npi-worker-1.pi-worker.default.svc slots=2\n")
    assert ringrun.parse_hostfile(str(ompi)) == ("pi-worker-0.pi-worker.default.svc:2,"
                                                 "pi-worker-1.pi-worker.default.svc:2")
    hydra = tmp_path / "hydra"  # Intel MPI and MPICH: "<pod>.<svc>.<ns>.svc:N"; a bare host is one slot
    hydra.write_text("# workers\nw0:3\n\nw1   # one slot\nw2 slots=2 max_slots=4\n")
    assert ringrun.parse_hostfile(str(hydra)) == "w0:3,w1:1,w2:2"
    for text, says in (("w0 slots=two\n", "is not host"), ("w0 cpus=2\n", "is not slots=N"), ("# none\n", "no host")):
        (tmp_path / "bad").write_text(text)
        with pytest.raises(ValueError, match=says):
            ringrun.parse_hostfile(str(tmp_path / "bad"))


def test_ringrun_takes_its_hosts_from_the_hostfile_an_mpi_launcher_would(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    code = "import os; print(*[os.environ[f'RINGREDUCE_{k}'] for k in ('RANK', 'LOCAL_RANK', 'LOCAL_SIZE')])"
    for args, env in ((["--hostfile", str(hostfile)], {}), ([], {"OMPI_MCA_orte_default_hostfile": str(hostfile)}),
                      ([], {"HYDRA_HOST_FILE": str(hostfile)})):
        out = run_ringrun([*args, "-np", "3", sys.executable, "-c", code], env)
        assert out.returncode == 0, out.stderr
        assert sorted(line.split("] ", 1)[1] for line in out.stdout.splitlines()) == ["0 0 2", "1 1 2", "2 0 1"]
    out = run_ringrun(["-np", "4", sys.executable, "-c", code], {"OMPI_MCA_orte_default_hostfile": str(hostfile)})
    assert out.returncode != 0 and "3 slots but -np asks for 4" in out.stderr
    out = run_ringrun(["-np", "1", sys.executable, "-c", code], {"I_MPI_HYDRA_HOST_FILE": str(tmp_path / "none")})
    assert out.returncode == 2 and "I_MPI_HYDRA_HOST_FILE: cannot read the hostfile" in out.stderr
