"""ringrun: start N ranks of a command and watch them.

    ringrun -np 4 python train.py
    ringrun -np 4 -H node1:2,node2:2 python train.py      # over ssh
    salloc -N 2 -n 8 ringrun -np 8 python train.py        # the allocation's nodes, over srun
    ringrun --elastic -np 4 --min-np 2 python train.py    # elastic (elastic_launcher.py)
    ringrun -np 8 --hostfile /etc/mpi/hostfile python train.py   # hosts and slots from a file

Where the hosts come from: -H, else --hostfile, else (inside a Kubeflow
PyTorchJob or TrainJob pod) the pod's place in the job: `ringrun -np L` in
every pod makes one world of pods * L ranks (ringreduce/core/kubernetes.py),
else the hostfile an MPI launcher names (OMPI_MCA_orte_default_hostfile,
I_MPI_HYDRA_HOST_FILE, HYDRA_HOST_FILE: an MPIJob's launcher pod), else this
host.

Each rank gets RINGREDUCE_RANK/SIZE/ADDR/SECRET/LOCAL_RANK/LOCAL_SIZE,
RINGREDUCE_JOB (the job's id, the `job` label of its metrics: ringrun's own
RINGREDUCE_JOB, else one made up per run) and RINGREDUCE_TIMEOUT with --timeout; every output line is prefixed with its
rank. Every rank runs under a guard (guard.py) that ends it when ringrun goes
away, however ringrun ends. When any rank exits non-zero or is killed, when
ringrun gets SIGINT/SIGTERM/SIGHUP, or when its stdout or stderr is closed,
ringrun stops every rank, says why in one line on stderr and exits saying why
too: no job lingers half-dead.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from ..core import kubernetes, slurm
from ..core.world import free_port
from ..errors import RingReduceError
from . import elastic_launcher, postmortem
from .processes import (GRACE_SECONDS, LOCAL_HOSTS, STOP_SIGNALS, Ending, Job, Rank, ask_for_dumps, describe, rank_argv,
                        say)
from .report_dir import ENV as REPORT_DIR_ENV, close_report_dir, open_report_dir

STRAGGLER_FILE = "stragglers.json"  # rank 0's engine writes it there (ringreduce/engine/stragglers.py REPORT_FILE)


def parse_hosts(spec: str | None, np_: int) -> list[str]:
    """'a:2,b:2' -> ['a', 'a', 'b', 'b'] (one host name per rank)."""
    if not spec:
        return ["localhost"] * np_
    hosts = []
    for item in spec.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not (slots.isdigit() and int(slots) > 0)):
            raise ValueError(f"{item.strip()!r} is not host or host:slots (slots a whole number > 0)")
        hosts += [name] * (int(slots) if slots else 1)
    if len(hosts) < np_:
        raise SystemExit(f"ringrun: -H gives {len(hosts)} slots but -np asks for {np_}")
    return hosts[:np_]


# The variables MPI launchers read their default hostfile from (the MPI
# Operator sets the one of its MPI implementation on an MPIJob's launcher).
HOSTFILE_VARS = ("OMPI_MCA_orte_default_hostfile", "I_MPI_HYDRA_HOST_FILE", "HYDRA_HOST_FILE")


def parse_hostfile(path: str) -> str:
    """An MPI hostfile as a -H spec: Open MPI's `host slots=N` lines and
    MPICH/Intel MPI's `host:N`, a bare `host` being one slot; `#` comments.
    ('a slots=2' and 'b:2' -> 'a:2,b:2')."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the hostfile {path}: {exc.strerror}") from None
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, _, slots = words[0].partition(":")
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots" and not slots:
                slots = value
            elif key != "max_slots":
                raise ValueError(f"{path} line {number}: {word!r} is not slots=N")
        if not host or (slots and not (slots.isdigit() and int(slots) > 0)):
            raise ValueError(f"{path} line {number}: {line.strip()!r} is not host, host slots=N or host:N")
        items.append(f"{host}:{slots or 1}")
    if not items:
        raise ValueError(f"the hostfile {path} names no host")
    return ",".join(items)


def env_hostfile(env) -> tuple[str, str] | None:
    """(variable, path) of the hostfile an MPI launcher would use, if any."""
    for name in HOSTFILE_VARS:
        if env.get(name):
            return name, env[name]
    return None


def allocation_hosts(env, np_: int) -> list[str] | None:
    """Inside a Slurm allocation (salloc's shell, a batch script), not in an srun
    step: one node name per rank, filling the allocation's nodes in order
    (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE). None elsewhere, and in a batch
    script whose allocation is its own node alone (ranks start here, as many
    as -np asks: `sbatch -c 8` then `ringrun -np 4`)."""
    if not env.get("SLURM_JOB_ID") or slurm.in_step(env):
        return None
    nodelist, per_node = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"), env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not per_node:
        return None
    try:
        nodes, counts = slurm.expand_hostlist(nodelist), slurm.expand_tasks_per_node(per_node)
    except ValueError as exc:
        raise SystemExit(f"ringrun: cannot read the Slurm allocation: {exc}") from None
    if len(nodes) != len(counts):
        raise SystemExit(f"ringrun: the Slurm allocation does not add up: SLURM_JOB_NODELIST={nodelist} names "
                         f"{len(nodes)} nodes, SLURM_TASKS_PER_NODE={per_node} counts {len(counts)}")
    if nodes == [env.get("SLURMD_NODENAME")]:  # a batch script on its only node: every rank local, as outside
        return None
    hosts = [n for n, k in zip(nodes, counts) for _ in range(k)]
    if len(hosts) < np_:
        raise SystemExit(f"ringrun: the Slurm allocation (SLURM_JOB_NODELIST={nodelist}, SLURM_TASKS_PER_NODE="
                         f"{per_node}) gives {len(hosts)} slots but -np asks for {np_}: give -H to choose hosts")
    return hosts[:np_]


def job_id() -> str:
    """The id the ranks of one ringrun carry as RINGREDUCE_JOB: ringrun's own, else a fresh one."""
    return os.environ.get("RINGREDUCE_JOB") or f"ringrun-{secrets.token_hex(4)}"


def rank_envs(hosts: list[str], port: int, secret: str, timeout: float | None,
              is_local=lambda host: host in LOCAL_HOSTS, address=lambda host: host, job: str = "") -> list[dict]:
    first = hosts[0]
    addr_host = "127.0.0.1" if all(is_local(h) for h in hosts) else address(first)
    envs = []
    for rank, host in enumerate(hosts):
        env = {
            "RINGREDUCE_RANK": str(rank),
            "RINGREDUCE_SIZE": str(len(hosts)),
            "RINGREDUCE_ADDR": f"{addr_host}:{port}",
            "RINGREDUCE_SECRET": secret,
            "RINGREDUCE_LOCAL_RANK": str(hosts[:rank].count(host)),
            "RINGREDUCE_LOCAL_SIZE": str(hosts.count(host)),
            "RINGREDUCE_JOB": job or job_id(),
            "PYTHONUNBUFFERED": "1",
        }
        if timeout is not None:
            env["RINGREDUCE_TIMEOUT"] = str(timeout)
        envs.append(env)
    return envs


def pod_envs(pod: kubernetes.PodJob, np_: int, secret: str, timeout: float | None) -> list[dict]:
    """The ranks of this pod of a PyTorchJob or TrainJob (kubernetes.rank_envs)."""
    envs = kubernetes.rank_envs(pod, np_, secret)
    job = job_id()
    for env in envs:
        env["PYTHONUNBUFFERED"] = "1"
        env["RINGREDUCE_JOB"] = job
        if timeout is not None:
            env["RINGREDUCE_TIMEOUT"] = str(timeout)
    return envs


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.1f} ms"


def straggler_summary(directory: str, since: float = 0.0) -> list[str]:
    """The lines ringrun prints of the stragglers.json rank 0's engine wrote
    into `directory` (ringreduce/engine/stragglers.py) no earlier than
    `since` (time.time(): not a previous job's): one per straggler, or one
    naming the slowest rank when none is past the threshold; none without
    a report."""
    path = os.path.join(directory, STRAGGLER_FILE)
    try:
        if os.stat(path).st_mtime < since:
            return []
        with open(path) as f:
            report = json.load(f)
        ranks = report["ranks"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not ranks:
        return []

    def describe(x):
        return (f"rank {x['rank']} arrived last in {100 * x['last_fraction']:.0f}% of steps, "
                f"{_ms(x['median_lateness'])} late on median (p90 {_ms(x['p90_lateness'])}), "
                f"score {x['score']:.2f}")

    where = f"over the last {report['cycles']} engine cycles, RINGREDUCE_STRAGGLER_THRESHOLD {report['threshold']}"
    flagged = [x for x in ranks if x["rank"] in report.get("stragglers", ())]
    if flagged:
        return [f"straggler ({where}): {describe(x)}" for x in flagged]
    slowest = min(ranks, key=lambda x: (x["score"], -x["median_lateness"]))
    return [f"no straggler ({where}); the slowest: {describe(slowest)}"]


def run(np_: int, command: list[str], hosts_spec: str | None = None, timeout: float | None = None,
        ssh: str = "ssh -o BatchMode=yes", pod: kubernetes.PodJob | None = None) -> Ending:
    """pod: this pod's place in a PyTorchJob or TrainJob; its np_ ranks then
    join the world of every pod's (hosts_spec is not used). Inside a Slurm
    allocation with no hosts_spec, the ranks go on the allocation's nodes (srun)."""
    in_slurm = pod is None and hosts_spec is None and (hosts := allocation_hosts(os.environ, np_)) is not None
    here = os.environ.get("SLURMD_NODENAME") if in_slurm else None  # a batch script runs on a node of its own

    def is_local(host):
        return host in LOCAL_HOSTS or host == here
    secret = os.environ.get("RINGREDUCE_SECRET") or secrets.token_hex(32)
    if pod is not None:
        hosts = ["localhost"] * np_
        envs = pod_envs(pod, np_, secret, timeout)
    else:
        if not in_slurm:
            hosts = parse_hosts(hosts_spec, np_)
        envs = rank_envs(hosts, free_port(), secret, timeout, is_local,
                         slurm.node_address if in_slurm else lambda h: h, job_id())
    job = Job()
    report = open_report_dir()  # the ranks' flight recorder dumps (ringreduce/launch/report_dir.py)
    job.report_dir, started = report.path, time.time()
    old = {s: signal.signal(s, lambda signum, frame: job.signals.append(signum)) for s in STOP_SIGNALS}
    job.waker.catch_signals()
    pumps = []
    ending = None
    try:
        for host, env in zip(hosts, envs):
            rank = int(env["RINGREDUCE_RANK"])  # the world's rank (in a pod of a job: node_rank * np + i)
            env[REPORT_DIR_ENV] = report.path
            argv = rank_argv("localhost" if is_local(host) else host, env, command, ssh, srun=in_slurm)
            try:
                # stdin: the control pipe; only ringrun holds its write end (close_fds).
                p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.PIPE, start_new_session=True)
            except OSError as exc:
                say(f"cannot start rank {rank} ({argv[0]}): {exc}")
                job.stop_all(signal.SIGKILL)
                ending = Ending(127)
                return ending
            job.ranks.append(Rank(rank, is_local(host), p))  # over srun or ssh: the guard's pipe stops the rank
            threading.Thread(target=job.wait_for, args=(job.ranks[-1],), daemon=True).start()
            for stream, sink, name in ((p.stdout, sys.stdout, "stdout"), (p.stderr, sys.stderr, "stderr")):
                t = threading.Thread(target=job.pump, args=(rank, stream, sink, name), daemon=True)
                t.start()
                pumps.append(t)
        ending = watch(job)
    finally:
        job.waker.close()
        for s, h in old.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=5)
        failed = ending is None or ending.code != 0
        for line in straggler_summary(report.path, started):
            say(line)
        if report.owned and not failed:  # read and told: a job that ended well leaves nothing behind
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(report.path, STRAGGLER_FILE))
        if failed:
            tell_verdict(report.path, np_, started)
        if close_report_dir(report) and failed:
            say(f"reports kept in {report.path} (ringrun --postmortem {report.path})")
    return ending


def tell_verdict(directory: str, np_: int, since: float) -> None:
    """After a failed job: one line on where its ranks were, from the flight
    recorder dumps they wrote since it started (ringreduce/launch/verdict.py),
    if they left any."""
    try:
        text = postmortem.job_verdict(directory, np_, since)
    except Exception as exc:  # a verdict is a courtesy: never what ringrun fails on
        text = f"no verdict: reading the flight recorder dumps failed ({type(exc).__name__}: {exc})"
    if text is not None:
        say(text)


def watch(job: Job) -> Ending:
    """Waits for every rank; the first failure, signal or closed output stops them all."""
    ending: Ending | None = None
    kill_at = None
    done_early: list[int] = []  # ranks that exited 0 while others still ran
    while True:
        running = job.running()
        others = len(running)
        if ending is None:
            if job.signals:
                sig = job.signals[0]
                ending = Ending(128 + sig, own_signal=sig)
                reason = f"got {signal.Signals(sig).name}"
            elif job.closed_sink is not None:
                ending = Ending(128 + signal.SIGPIPE, own_signal=signal.SIGPIPE)
                reason = f"{job.closed_sink} was closed"
            else:
                with job.lock:  # then any whose end is not recorded yet (its wait just returned)
                    by_index = {r.index: r for r in job.ranks}
                    ended = [by_index[i] for i in job.ended]
                    ended += [r for r in job.ranks if r.index not in job.ended and r.proc.returncode is not None]
                failed = next((r for r in ended if r.proc.returncode != 0), None)
                if failed is not None:
                    code = failed.proc.returncode
                    ending = Ending(code if code > 0 else 128 - code)
                    reason = f"rank {failed.index} {describe(code)}"
                    if done_early:  # often why the failing rank failed: PeerLostError
                        reason += f" (after rank(s) {', '.join(map(str, done_early))} exited with code 0)"
                else:
                    done_early = [r.index for r in job.ranks if r.proc.returncode == 0] if running else []
            if ending is not None:
                say(f"{reason}; stopping {'the other ' if not ending.own_signal else ''}{others} rank(s)"
                    if others else f"{reason}; no rank left to stop")
                if others:
                    ask_for_dumps(job)  # the ranks still running say where they are (flight recorder)
                    job.stop_all(signal.SIGTERM)
                    kill_at = time.monotonic() + GRACE_SECONDS + 1
        elif running and (time.monotonic() > kill_at or len(job.signals) > 1):
            # a second Ctrl-C, or ranks that outlived SIGTERM and their guard's SIGKILL
            say(f"killing {others} rank(s) that did not stop: {', '.join(str(r.index) for r in running)}")
            job.stop_all(signal.SIGKILL)
            kill_at = float("inf")
            job.signals[1:] = []
        if not running:
            return ending or Ending(0)
        # asleep until a rank ends, a signal comes or output closes (then the loop looks again)
        job.waker.wait(1.0 if ending is None else max(0.05, min(1.0, kill_at - time.monotonic())))


def end_by_signal(sig: int) -> None:
    """Ends ringrun killed by `sig`, the way a shell expects of a command stopped
    by a signal (`$?` is 128 + sig; a script stops on Ctrl-C)."""
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ringrun", description="Start N ranks of a command for ringreduce and watch them.",
        epilog="example: ringrun -np 4 python train.py")
    parser.add_argument("-np", "-n", dest="np", type=int, help="number of ranks")
    parser.add_argument("-H", "--hosts", help="host1:slots,host2:slots (ranks fill hosts in order; ssh); "
                        "without it inside a Slurm allocation, its nodes (srun)")
    parser.add_argument("--hostfile", help="the hosts from an MPI hostfile (`host slots=N` or `host:N` lines); "
                        "default: the one OMPI_MCA_orte_default_hostfile, I_MPI_HYDRA_HOST_FILE or "
                        "HYDRA_HOST_FILE names (an MPIJob's launcher)")
    parser.add_argument("--timeout", type=float, help="RINGREDUCE_TIMEOUT for the ranks (seconds)")
    parser.add_argument("--ssh", default="ssh -o BatchMode=yes", help="command used to reach other hosts")
    parser.add_argument("--postmortem", metavar="DIR",
                        help="print the verdict on a finished job's flight recorder dumps in DIR, and exit")
    elastic = parser.add_argument_group("elastic training (docs/elastic.md)")
    elastic.add_argument("--elastic", action="store_true",
                         help="keep going when workers are lost; restart them; let new ones join")
    elastic.add_argument("--min-np", type=int, help="fewest workers to train with (default: -np)")
    elastic.add_argument("--max-np", type=int, help="most workers at once (default: -np)")
    elastic.add_argument("--max-restarts", type=int, help="restarts of lost workers in all (default 100)")
    elastic.add_argument("--elastic-timeout", type=float,
                         help="seconds to wait below --min-np before giving up (default 600)")
    elastic.add_argument("--host-discovery-script", help="prints the available hosts, `host:slots` a line")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = parser.parse_args(argv)
    if args.postmortem is not None:
        if args.command or args.np is not None:
            parser.error("--postmortem DIR takes no -np and no command")
        return postmortem.main([args.postmortem])
    if args.np is None:
        parser.error("the following arguments are required: -np/-n")
    if not args.command:
        parser.error("no command given")
    if args.np < 1:
        parser.error("-np must be at least 1")
    if args.timeout is not None and not args.timeout >= 0:
        parser.error(f"--timeout {args.timeout:g} makes no sense: use seconds >= 0 (0: never time out)")
    if args.hosts and args.hostfile:
        parser.error("give -H or --hostfile, not both")
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if slurm.in_step(os.environ) and tasks.isdigit() and int(tasks) > 1:  # each task's ringrun: a world of its own
        parser.error(f"ringrun is one of {tasks} tasks of an srun step (SLURM_STEP_NUM_TASKS={tasks}): each would "
                     "start a world of its own. Start ringrun once (srun -n1 ringrun, or in the batch script), or "
                     f"let srun start the ranks itself (srun -n N python train.py)")
    pod = None
    if args.hostfile:
        try:
            args.hosts = parse_hostfile(args.hostfile)
        except ValueError as exc:
            parser.error(f"--hostfile: {exc}")
    elif not args.hosts and not args.host_discovery_script:
        try:
            pod = kubernetes.pod_job(os.environ)
            if pod is not None:
                kubernetes.rank_envs(pod, args.np, "")  # -np against the operator's, and the secret, checked now
        except RingReduceError as exc:
            parser.error(str(exc))
        named = env_hostfile(os.environ) if pod is None else None
        if named is not None:
            try:
                args.hosts = parse_hostfile(named[1])
            except ValueError as exc:
                parser.error(f"{named[0]}: {exc}")
    if pod is not None and args.elastic:
        parser.error(f"--elastic inside a {pod.operator} pod would make one elastic job per pod: run "
                     "ringrun --elastic on one launcher, or drop --elastic (one world of every pod's ranks)")
    if args.hosts and not args.elastic:
        try:
            parse_hosts(args.hosts, 0)
        except ValueError as exc:
            parser.error(f"-H: {exc}")
    given = [f for f in ("min_np", "max_np", "max_restarts", "elastic_timeout", "host_discovery_script")
             if getattr(args, f) is not None]
    if given and not args.elastic:
        parser.error(f"--{given[0].replace('_', '-')} needs --elastic")
    if args.elastic:
        min_np = args.min_np if args.min_np is not None else args.np
        max_np = args.max_np if args.max_np is not None else max(args.np, min_np)
        if not 1 <= min_np <= args.np <= max_np:
            parser.error(f"need 1 <= --min-np ({min_np}) <= -np ({args.np}) <= --max-np ({max_np})")
        if args.host_discovery_script and args.hosts:
            parser.error("give -H or --host-discovery-script, not both")
        if args.hosts:
            try:
                elastic_launcher.parse_slots(args.hosts)
            except ValueError as exc:
                parser.error(f"-H: {exc}")
        max_restarts = 100 if args.max_restarts is None else args.max_restarts
        elastic_timeout = 600.0 if args.elastic_timeout is None else args.elastic_timeout
        if max_restarts < 0 or not elastic_timeout >= 0:  # nan too: no deadline would ever pass
            parser.error("--max-restarts and --elastic-timeout must not be negative (nor --elastic-timeout nan)")
        ending = elastic_launcher.run(elastic_launcher.Options(
            args.np, min_np, max_np, max_restarts, elastic_timeout, args.host_discovery_script,
            args.hosts, args.timeout, args.ssh), args.command)
    else:
        ending = run(args.np, args.command, args.hosts, args.timeout, args.ssh, pod)
    if ending.own_signal is not None:
        end_by_signal(ending.own_signal)
    return ending.code  # also where the signal did not end us


if __name__ == "__main__":
    sys.exit(main())
