"""The world of an `srun` step without PMI, read from Slurm's task environment.

    srun -n 8 python train.py            # or srun inside an sbatch script, over several nodes

Every task srun starts gets (Slurm's own variables):
  rank        SLURM_PROCID
  size        SLURM_STEP_NUM_TASKS (else SLURM_NTASKS, which srun sets to the step's)
  local rank  SLURM_LOCALID
  local size  SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE), e.g. `2(x3),1`,
              at index SLURM_NODEID
  rank 0      runs on the first node of SLURM_STEP_NODELIST (srun's block, cyclic and
              plane distributions all put task 0 there; `arbitrary` need not, so it
              needs RINGREDUCE_ADDR)

Only a real step of srun counts: SLURM_STEP_ID set and not one of Slurm's
special steps (the batch script's, the extern or interactive step). A batch
script has SLURM_PROCID=0 and SLURM_NTASKS=N but no step: it is a world of one,
as is an interactive shell of salloc. srun with PMI (PMI_RANK / PMIX_RANK) never
reaches here: it is an MPI world (world.py).

Rendezvous: rank 0 listens at RINGREDUCE_ADDR if set; else on the first node of
the step at RINGREDUCE_PORT if set, else at `step_port(job, step)`, a port in
PORT_RANGE derived from SLURM_JOB_ID and SLURM_STEP_ID. Each rank reaches that
node at its NodeAddr (`scontrol show node`, the address Slurm itself uses),
else at its name.

Job secret (the handshake's key, world.py): `step_secret`, HMAC-SHA256 of the
job and step ids keyed by RINGREDUCE_SECRET if set (srun passes the
environment to every task), else by a user-private key file (KEY_FILE under
$HOME, mode 0600, made on first use). Either way each step has its own: two
steps whose derived ports meet on one node (steps of one user's jobs, that
user's RINGREDUCE_SECRET exported in every job) never pass each other's
handshake, so no rank joins another step's world. See docs/ringrun.md
"Slurm" for the trust model.

Only the task srun started is that task: a process it starts (a
subprocess.Popen of the training script, a forked worker) inherits the
same SLURM_* variables but is no task of the step. The process that reads
the step's world marks os.environ with CLAIM_ENV (job.step:pid); one that
finds the mark of another pid for the same step is refused at once, naming
the way to give it a world of its own, rather than waiting out
RINGREDUCE_START_TIMEOUT for a rank 0 that is not there (or, a child of
rank 0, listening for ranks that never come). A new srun step started from
a task (nested srun) has another step id and is a task of that step.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import shutil
import subprocess

from ..errors import RingReduceError
from .config import env_int

# Ports of derived rendezvous: below the kernel's default ephemeral range
# (32768-60999), so no connection's own port is ever handed out there. The
# span is prime: two steps (< STEP_STRIDE) of jobs fewer than 625 ids apart
# never share a port.
PORT_BASE, PORT_SPAN, STEP_STRIDE = 20000, 10007, 16
PORT_RANGE = (PORT_BASE, PORT_BASE + PORT_SPAN - 1)

# Slurm's special step ids (SLURM_MAX_NORMAL_STEP_ID = 0xfffffff0 and above):
# the batch script, the extern step, the interactive step: none is an srun step.
MAX_NORMAL_STEP_ID = 0xFFFFFFF0

KEY_FILE = os.path.join(".config", "ringreduce", "slurm.key")  # under $HOME
CLAIM_ENV = "RINGREDUCE_SLURM_TASK"  # "job.step:pid" of the process that read the step's world

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist expression, expanded in order: `node[01-03,07],gpu-[1-2]`
    -> node01 node02 node03 node07 gpu-1 gpu-2. Zero padding follows the
    range's first number; several bracket groups in one name multiply out
    (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2). A malformed expression raises ValueError."""
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        if item == "":
            if text.strip() == "":
                continue
            raise ValueError(f"hostlist {text!r} has an empty name")
        names += _expand_one(item, text)
    return names


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {text!r} nests brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {text!r} has a ']' without its '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {text!r} has a '[' without its ']'")
    items.append(text[start:])
    return [i.strip() for i in items] if text else []


def _expand_one(item: str, text: str) -> list[str]:
    open_ = item.find("[")
    if open_ < 0:
        return [item]
    close = item.index("]", open_)
    prefix, spec, rest = item[:open_], item[open_ + 1:close], item[close + 1:]
    values: list[str] = []
    for part in spec.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"hostlist {text!r}: {part!r} in [{spec}] is not a number or a range lo-hi")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"hostlist {text!r}: range {part!r} runs backwards")
        width = len(lo)
        values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    tails = _expand_one(rest, text) if rest else [""]
    return [f"{prefix}{v}{t}" for v in values for t in tails]


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks-per-node list: `2(x3),1` -> [2, 2, 2, 1]. Malformed raises ValueError."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"tasks per node {text!r}: {part!r} is not N or N(xK)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def step_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of a step, in PORT_RANGE: the same on every task."""
    return PORT_BASE + (job_id * STEP_STRIDE + step_id) % PORT_SPAN


def key_file(home: str) -> str:
    return os.path.join(home, KEY_FILE)


def user_key(home: str) -> bytes:
    """The user's private key (KEY_FILE under home), made on first use.
    Tasks on several nodes may make it at once: each writes its own, and one
    hard link (atomic, on NFS too) decides whose every task reads. A key
    another user could read or write is refused, as ssh refuses such a key."""
    path = key_file(home)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another task made it first: theirs holds
        finally:
            os.unlink(tmp)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RingReduceError(f"{path} (the key ringreduce derives Slurm job secrets from) must be yours and "
                              f"readable by you alone (chmod 600 {path}), or set RINGREDUCE_SECRET")
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < 32:
        raise RingReduceError(f"{path} holds fewer than 32 bytes: remove it (a new one is made) "
                              "or set RINGREDUCE_SECRET")
    return key


def step_secret(key: bytes, job_id: int, step_id: int) -> bytes:
    """The step's secret: the same on every task that holds the key, another for every step."""
    return hmac.new(key, f"ringreduce slurm step {job_id}.{step_id}".encode(), hashlib.sha256).hexdigest().encode()


def node_address(name: str) -> str:
    """Where to reach Slurm node `name`: its NodeAddr (`scontrol show node`),
    which is how Slurm reaches it; the name itself where scontrol is
    missing or does not know the node."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "node", "--oneliner", name], capture_output=True,
                                 text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        m = re.search(r"(?:^|\s)NodeAddr=(\S+)", out)
        if m and m.group(1) not in ("(null)", ""):
            return m.group(1)
    return name


def in_step(env) -> bool:
    """This process is a task of a real srun step (not a batch script, not salloc's shell)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    return env.get("SLURM_PROCID", "") != "" and step.isdigit() and int(step) < MAX_NORMAL_STEP_ID


def _check_not_inherited(env, rank) -> None:
    """Refuses a process that inherited the environment of the srun task
    that already read this step's world (CLAIM_ENV), being no task itself."""
    claim = env.get(CLAIM_ENV, "")
    step = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', ''))}"
    mark, _, pid = claim.rpartition(":")
    if mark == step and pid != str(os.getpid()):
        raise RingReduceError(
            f"this process (pid {os.getpid()}) inherited the srun environment of rank {rank} of Slurm step {step}, "
            f"which process {pid} already joined as rank {rank}: a process a task starts is no task of the step. "
            "Give it a world of its own (RINGREDUCE_RANK=0 RINGREDUCE_SIZE=1 in its environment), or start it with "
            "ringrun, or as a task of its own srun step")


def step_world(env, secret: bytes | None, parse_addr) -> dict | None:
    """This srun task's world, as world.World's fields (rank, size, local_rank,
    local_size, addr, secret, extra), or None outside an srun step of more than
    one task (and where RINGREDUCE_SIZE or RINGREDUCE_LOCAL_* is set: world.py
    refuses that half-set world). A step whose variables do not add up
    raises, naming them: every task training alone would be silently wrong.
    parse_addr reads RINGREDUCE_ADDR (world.py's, as for every launcher)."""
    if any(env.get(n, "") != "" for n in ("RINGREDUCE_SIZE", "RINGREDUCE_LOCAL_RANK", "RINGREDUCE_LOCAL_SIZE")):
        return None
    size = env_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if in_step(env) else None
    if size is None or size <= 1:
        tasks = env_int(env, "SLURM_STEP_NUM_TASKS")
        if env.get("SLURM_PROCID", "") != "" and tasks is not None and tasks > 1:  # no step id: half a step
            raise RingReduceError(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}) but SLURM_STEP_ID is "
                                  "missing, so their world cannot be read: run the tasks under srun itself (it sets both), "
                                  "or use srun --mpi=pmi2/pmix (and mpi4py), or one srun task running ringrun -np N")
        return None
    rank = env_int(env, "SLURM_PROCID")
    _check_not_inherited(env, rank)
    missing = [n for n in ("SLURM_JOB_ID", "SLURM_LOCALID", "SLURM_NODEID") if env.get(n, "") == ""]
    nodelist_name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
    per_node_name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(n)), None)
    missing += [] if nodelist_name else ["SLURM_STEP_NODELIST"]
    missing += [] if per_node_name else ["SLURM_STEP_TASKS_PER_NODE"]
    if missing:
        raise RingReduceError(f"srun started {size} tasks but {', '.join(missing)} is not set, so their "
                              "ringreduce world cannot be read (set RINGREDUCE_RANK, RINGREDUCE_SIZE and "
                              "RINGREDUCE_ADDR on every task, or use ringrun -np N)")
    job, step = env_int(env, "SLURM_JOB_ID"), env_int(env, "SLURM_STEP_ID", "SLURM_STEPID")
    local_rank, node_id = env_int(env, "SLURM_LOCALID"), env_int(env, "SLURM_NODEID")
    try:
        nodes = expand_hostlist(env[nodelist_name])
        per_node = expand_tasks_per_node(env[per_node_name])
    except ValueError as exc:
        raise RingReduceError(f"rank {rank}: cannot read the srun step's layout: {exc}") from None
    where = (f"SLURM_PROCID={rank}, SLURM_STEP_NUM_TASKS={size}, {nodelist_name}={env[nodelist_name]}, "
             f"{per_node_name}={env[per_node_name]}, SLURM_NODEID={node_id}, SLURM_LOCALID={local_rank}")
    if (not 0 <= rank < size or len(nodes) != len(per_node) or sum(per_node) != size
            or not 0 <= node_id < len(nodes) or not 0 <= local_rank < per_node[node_id]):
        raise RingReduceError(f"rank {rank}: the srun step's variables do not add up ({where})")

    if env.get("RINGREDUCE_ADDR"):
        addr = parse_addr(env["RINGREDUCE_ADDR"])
    else:
        if "arbitrary" in env.get("SLURM_DISTRIBUTION", ""):
            raise RingReduceError(f"rank {rank}: srun --distribution=arbitrary may start rank 0 on any node, "
                                  "so its address cannot be derived: set RINGREDUCE_ADDR=host:port")
        if rank == 0 and node_id != 0:
            raise RingReduceError(f"rank 0 runs on node {node_id} of the step, not on its first node ({nodes[0]}), "
                                  f"where every rank looks for it ({where}): set RINGREDUCE_ADDR=host:port")
        port = env_int(env, "RINGREDUCE_PORT")
        if port is not None and not 0 < port < 65536:
            raise RingReduceError(f"RINGREDUCE_PORT={port} is not a port of 1 .. 65535")
        addr = (node_address(nodes[0]), step_port(job, step) if port is None else port)

    if secret is None:
        home = env.get("HOME") or os.path.expanduser("~")
        try:
            secret = step_secret(user_key(home), job, step)
        except OSError as exc:
            raise RingReduceError(f"rank {rank}: no job secret: RINGREDUCE_SECRET is not set and the key file "
                                  f"{key_file(home)} cannot be made or read ({exc}); set RINGREDUCE_SECRET "
                                  "(the same on every task)") from None
    else:
        secret = step_secret(secret, job, step)
    env[CLAIM_ENV] = f"{job}.{step}:{os.getpid()}"  # inherited by every process this one starts
    return {"rank": rank, "size": size, "local_rank": local_rank, "local_size": per_node[node_id], "addr": addr,
            "secret": secret, "extra": {"slurm_job": job, "slurm_step": step, "nodes": nodes}}
