"""Worlds that Kubernetes training operators set up: one pod per node.

A pod of a PyTorchJob (Kubeflow training-operator v1) or of a TrainJob
(Kubeflow Trainer v2, torch runtime, pods made by a JobSet) is told where it
stands by environment variables the operator sets. They describe PODS, not
processes:

  PyTorchJob, training-operator v1 (pkg/controller.v1/pytorch/envvar.go,
  master.go), on every pod when the job has a Master replica:
    MASTER_ADDR   the master pod's service, "<job>-master-0"
    MASTER_PORT   the master container's port named "pytorchjob-port" (torch's)
    RANK          the pod's index: master 0, worker i is i + 1
    WORLD_SIZE    the number of pods (up to v1.7); from v1.8 pods * nprocPerNode
                  when nprocPerNode is an integer (pods when it is "auto", the
                  default), so from v1.8 RANK and WORLD_SIZE are not of one kind
    PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE   (v1.8 on) the number of
                  pods, RANK again, and spec.nprocPerNode as written
                  ("auto", "cpu", "gpu" or an integer)
  With an elasticPolicy the operator sets PET_RDZV_* and PET_NNODES "min:max"
  instead (elastic.go): torchrun's own elastic rendezvous, no fixed ranks.

  TrainJob, Kubeflow Trainer v2 (pkg/runtime/framework/plugins/torch/torch.go,
  pkg/constants), on every pod of the "node" replicated job:
    PET_NNODES          spec.trainer.numNodes
    PET_NPROC_PER_NODE  numProcPerNode: an integer, or "auto"/"cpu"/"gpu"
    PET_NODE_RANK       the pod's Job completion index
    PET_MASTER_ADDR     "<trainjob>-node-0-0.<trainjob>" (pod 0 of the JobSet)
    PET_MASTER_PORT     29400 (the trainer container's port)

So a pod knows its node rank and the number of nodes; the processes inside
it are ringrun's business. One process per pod (no ringrun) is rank
node_rank of a world of nnodes; `ringrun -np L` in every pod starts L
processes there, ranks node_rank * L + local_rank of nnodes * L
(`rank_envs`). Either way rank 0 is the master pod's first process and the
rendezvous is the master pod's address.

The port: MASTER_PORT / PET_MASTER_PORT is torch's, and a torch process
group in the same job binds it on the master pod. ringreduce's rendezvous
takes RINGREDUCE_PORT when set, else that port + 1, never the port itself.

Trust: every pod of a job is given the same environment by the operator,
RINGREDUCE_SECRET included (from a Kubernetes Secret, secretKeyRef); ranks
accept only connections that prove they know it (world.py, the handshake).
A world spanning pods needs it: without it ranks listen on loopback only.

A process started by torchrun (LOCAL_RANK, TORCHELASTIC_*) is not a pod's
process but one of torchrun's: that world is not ringreduce's and stays
refused (world.py), whatever the pod's variables say.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import RingReduceError
from .config import env_int

# torchrun (torch.distributed.run, and torch.distributed.launch) sets these on
# each process it starts; an operator never sets them on a pod.
TORCHRUN_MARKERS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
TORCHRUN_PREFIX = "TORCHELASTIC_"

# Port offset from torch's master port, so both rendezvous fit in one pod.
PORT_OFFSET = 1


@dataclass(frozen=True)
class PodJob:
    """What the operator told this pod."""
    operator: str              # "PyTorchJob" or "TrainJob", for messages
    nnodes: int                # pods in the job
    node_rank: int             # this pod's index, 0 .. nnodes - 1
    nproc: int | None          # processes per pod the operator fixed; None: not fixed ("auto", ...)
    nproc_name: str            # the variable nproc came from, for messages
    host: str                  # the master pod's address
    port: int | None           # ringreduce's rendezvous port there (None: a lone process of one pod, no rendezvous)
    secret: str | None


def started_by_torchrun(env) -> bool:
    return any(env.get(n, "") != "" for n in TORCHRUN_MARKERS) or any(k.startswith(TORCHRUN_PREFIX) for k in env)


def pod_job(env, need_port: bool = True) -> PodJob | None:
    """The pod's place in a PyTorchJob or TrainJob, or None where the
    environment is not such a pod (or is a process torchrun started).
    Raises, naming the variable, where it is such a pod but no fixed world
    can come of it. need_port False: a job of one pod needs no rendezvous
    port (its lone process is a world of one), and gets port None."""
    if started_by_torchrun(env):
        return None
    nnodes_text = env.get("PET_NNODES", "")
    if nnodes_text != "":
        trainjob = env.get("PET_MASTER_ADDR", "") != ""
        operator = "TrainJob" if trainjob else "PyTorchJob"
        if ":" in nnodes_text:  # an elasticPolicy: min:max pods, ranks assigned by torchrun's rendezvous
            low, _, high = nnodes_text.partition(":")
            if low != high or env.get("PET_NODE_RANK", "") == "":
                raise RingReduceError(
                    f"PET_NNODES={nnodes_text} is an elastic {operator} (elasticPolicy): ringreduce needs a fixed "
                    "number of pods with a node rank each; drop elasticPolicy and give a Master replica (or use "
                    "ringrun --elastic on one launcher)")
            nnodes_text = low
        try:
            nnodes = int(nnodes_text)
        except ValueError:
            raise RingReduceError(f"PET_NNODES={nnodes_text!r} is not an integer") from None
        node_rank = env_int(env, "PET_NODE_RANK")
        if node_rank is None:  # a PyTorchJob without a Master replica gets PET_NNODES alone
            if nnodes == 1:
                return None  # the only pod: a world of one, as without the operator
            raise RingReduceError(
                f"PET_NNODES={nnodes} is set but PET_NODE_RANK is not (a PyTorchJob without a Master replica?): "
                "ringreduce needs each pod's rank; give the job a Master replica")
        host = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR", "")
        port_name = "PET_MASTER_PORT" if trainjob else "MASTER_PORT"
        nproc_text = env.get("PET_NPROC_PER_NODE", "")
        nproc_name = "PET_NPROC_PER_NODE"
    elif env.get("MASTER_ADDR", "") != "" and env.get("RANK", "") != "" and env.get("WORLD_SIZE", "") != "":
        operator = "PyTorchJob"  # training-operator up to v1.7: a pod's RANK of WORLD_SIZE pods
        nnodes, node_rank = env_int(env, "WORLD_SIZE"), env_int(env, "RANK")
        host, port_name, nproc_text, nproc_name = env["MASTER_ADDR"], "MASTER_PORT", "", ""
    else:
        return None
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise RingReduceError(f"{operator}: node rank {node_rank} is not in 0 .. {nnodes - 1} (the number of pods)")
    nproc = int(nproc_text) if nproc_text.isdigit() else None  # "auto", "cpu", "gpu": not fixed by the operator
    if nproc is not None and nproc < 1:
        raise RingReduceError(f"PET_NPROC_PER_NODE={nproc_text} must be at least 1")
    if nnodes_text and env.get("RANK", "") != "" and env.get("WORLD_SIZE", "") != "":
        # PyTorchJob v1.8 sets both: RANK is the pod's, WORLD_SIZE counts processes (pods when nproc is not fixed)
        rank, world = env_int(env, "RANK"), env_int(env, "WORLD_SIZE")
        if rank != node_rank or world != nnodes * (nproc or 1):
            raise RingReduceError(
                f"{operator}: RANK={rank} and WORLD_SIZE={world} disagree with PET_NODE_RANK={node_rank}, "
                f"PET_NNODES={nnodes} and PET_NPROC_PER_NODE={nproc_text or '(unset)'}: not one job's environment")
    if not host:
        raise RingReduceError(f"{operator}: the pod has its node rank but no master address "
                              "(MASTER_ADDR or PET_MASTER_ADDR)")
    port = rendezvous_port(env, port_name) if need_port or nnodes > 1 else None
    return PodJob(operator, nnodes, node_rank, nproc, nproc_name, host.strip("[]"), port,
                  env.get("RINGREDUCE_SECRET") or None)


def rendezvous_port(env, torch_port_name: str) -> int:
    """RINGREDUCE_PORT, else torch's master port + PORT_OFFSET."""
    own = env_int(env, "RINGREDUCE_PORT")
    if own is not None:
        if not 0 < own < 65536:
            raise RingReduceError(f"RINGREDUCE_PORT={own} must be a port of 1 .. 65535")
        return own
    torch = env_int(env, torch_port_name)
    if torch is None:
        raise RingReduceError(f"neither RINGREDUCE_PORT nor {torch_port_name} is set: where should rank 0 listen?")
    if not 0 < torch + PORT_OFFSET < 65536:
        raise RingReduceError(f"{torch_port_name}={torch} + {PORT_OFFSET} is no port: set RINGREDUCE_PORT")
    return torch + PORT_OFFSET


def check_secret(job: PodJob) -> None:
    """A world across pods needs the job secret: without it ranks listen on
    loopback only and the other pods could never join (a timeout, later)."""
    if job.nnodes > 1 and not job.secret:
        raise RingReduceError(
            f"{job.operator} of {job.nnodes} pods but RINGREDUCE_SECRET is not set: give every pod the same "
            "secret from a Kubernetes Secret (env: valueFrom: secretKeyRef), see docs/ringrun.md" + _not_a_pod(job))


def _not_a_pod(job: PodJob) -> str:
    """For an error read from MASTER_ADDR, RANK and WORLD_SIZE alone, which
    any torch.distributed program (a notebook, a script of one's own) may
    have set: what they were read as, and how to train without them."""
    if job.nproc_name:  # PET_*: only an operator sets those
        return ""
    return (f" (read from MASTER_ADDR={job.host}, RANK={job.node_rank} and WORLD_SIZE={job.nnodes}, as a PyTorchJob "
            "pod's; if these are your own torch.distributed variables, unset RANK and WORLD_SIZE for ringreduce "
            "or set RINGREDUCE_RANK, RINGREDUCE_SIZE and RINGREDUCE_ADDR, or launch with ringrun -np N)")


def addr_text(job: PodJob) -> str:
    return f"[{job.host}]:{job.port}" if ":" in job.host else f"{job.host}:{job.port}"


def rank_envs(job: PodJob, nproc: int, fresh_secret: str) -> list[dict]:
    """The RINGREDUCE_* environment of each of `nproc` processes of this pod:
    ranks node_rank * nproc + i of nnodes * nproc, rendezvous at the master pod.
    A job of one pod needs no shared secret (fresh_secret, and loopback, do)."""
    if job.nproc is not None and job.nproc != nproc:
        raise RingReduceError(f"{job.operator}: {job.nproc_name}={job.nproc} processes per pod, "
                              f"but {nproc} asked for")
    check_secret(job)
    size = job.nnodes * nproc
    addr = addr_text(job) if job.nnodes > 1 else f"127.0.0.1:{job.port}"
    return [{"RINGREDUCE_RANK": str(job.node_rank * nproc + i), "RINGREDUCE_SIZE": str(size),
             "RINGREDUCE_ADDR": addr, "RINGREDUCE_SECRET": job.secret or fresh_secret,
             "RINGREDUCE_LOCAL_RANK": str(i), "RINGREDUCE_LOCAL_SIZE": str(nproc)} for i in range(nproc)]


def lone_process(env) -> PodJob | None:
    """The pod of a process that is its pod's only one (rank node_rank of
    nnodes: world.discover), or None where the environment is not a
    PyTorchJob or TrainJob pod."""
    job = pod_job(env, need_port=False)
    if job is None:
        return None
    if job.nproc is not None and job.nproc > 1:  # the operator meant nproc processes in this pod
        raise RingReduceError(
            f"{job.operator}: {job.nproc_name}={job.nproc} processes per pod, but this process was started "
            f"alone: start them with ringrun -np {job.nproc} in each pod")
    check_secret(job)
    return job
