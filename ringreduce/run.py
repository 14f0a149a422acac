"""ringrun: start N ranks of a command and watch them.

    ringrun -np 4 python train.py
    ringrun -np 4 -H node1:2,node2:2 python train.py      # over ssh

Each rank gets RINGREDUCE_RANK/SIZE/ADDR/SECRET/LOCAL_RANK/LOCAL_SIZE (and
RINGREDUCE_TIMEOUT with --timeout); every output line is prefixed with its
rank. When any rank exits non-zero or is killed, ringrun stops the others and
exits non-zero itself: no job lingers half-dead.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time

from .world import free_port

GRACE_SECONDS = 3.0
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def parse_hosts(spec: str | None, np_: int) -> list[str]:
    """'a:2,b:2' -> ['a', 'a', 'b', 'b'] (one host name per rank)."""
    if not spec:
        return ["localhost"] * np_
    hosts = []
    for item in spec.split(","):
        name, _, slots = item.strip().partition(":")
        hosts += [name] * (int(slots) if slots else 1)
    if len(hosts) < np_:
        raise SystemExit(f"ringrun: -H gives {len(hosts)} slots but -np asks for {np_}")
    return hosts[:np_]


def rank_envs(hosts: list[str], port: int, secret: str, timeout: float | None) -> list[dict]:
    first = hosts[0]
    addr_host = "127.0.0.1" if all(h in LOCAL_HOSTS for h in hosts) else first
    envs = []
    for rank, host in enumerate(hosts):
        env = {
            "RINGREDUCE_RANK": str(rank),
            "RINGREDUCE_SIZE": str(len(hosts)),
            "RINGREDUCE_ADDR": f"{addr_host}:{port}",
            "RINGREDUCE_SECRET": secret,
            "RINGREDUCE_LOCAL_RANK": str(hosts[:rank].count(host)),
            "RINGREDUCE_LOCAL_SIZE": str(hosts.count(host)),
            "PYTHONUNBUFFERED": "1",
        }
        if timeout is not None:
            env["RINGREDUCE_TIMEOUT"] = str(timeout)
        envs.append(env)
    return envs


def rank_argv(host: str, env: dict, command: list[str], ssh: str) -> list[str]:
    if host in LOCAL_HOSTS:
        return command
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    remote = f"cd {shlex.quote(os.getcwd())} && env {assignments} {shlex.join(command)}"
    return [*shlex.split(ssh), host, remote]


class Job:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.failed: tuple[int, int] | None = None  # (rank, returncode)

    def pump(self, rank: int, stream, sink):
        """Copies one rank's output to ours, line by line, each line prefixed."""
        prefix = f"[{rank}] ".encode()
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self.lock:
                sink.buffer.write(prefix + line)
                sink.buffer.flush()
        stream.close()

    def stop_all(self, sig=signal.SIGTERM):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run(np_: int, command: list[str], hosts_spec: str | None = None, timeout: float | None = None,
        ssh: str = "ssh -o BatchMode=yes") -> int:
    hosts = parse_hosts(hosts_spec, np_)
    port = free_port()
    secret = os.environ.get("RINGREDUCE_SECRET") or secrets.token_hex(32)
    job = Job()
    pumps = []
    for rank, (host, env) in enumerate(zip(hosts, rank_envs(hosts, port, secret, timeout))):
        argv = rank_argv(host, env, command, ssh)
        try:
            p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            print(f"ringrun: cannot start rank {rank} ({argv[0]}): {exc}", file=sys.stderr)
            job.stop_all(signal.SIGKILL)
            return 127
        job.procs.append(p)
        for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=job.pump, args=(rank, stream, sink), daemon=True)
            t.start()
            pumps.append(t)

    def on_signal(signum, frame):
        job.failed = job.failed or (-1, 128 + signum)
        job.stop_all()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = watch(job)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=5)
    return code


def watch(job: Job) -> int:
    """Waits for every rank; the first failure stops the rest."""
    stop_deadline = None
    while True:
        running = 0
        for rank, p in enumerate(job.procs):
            code = p.poll()
            if code is None:
                running += 1
            elif code != 0 and job.failed is None:
                job.failed = (rank, code)
                others = sum(q.poll() is None for q in job.procs)
                print(f"ringrun: rank {rank} {describe(code)}; stopping the other {others} rank(s)",
                      file=sys.stderr, flush=True)
        if job.failed is not None and running:
            if stop_deadline is None:
                job.stop_all(signal.SIGTERM)
                stop_deadline = time.monotonic() + GRACE_SECONDS
            elif time.monotonic() > stop_deadline:
                job.stop_all(signal.SIGKILL)
        if not running:
            break
        time.sleep(0.05)
    if job.failed is None:
        return 0
    rank, code = job.failed
    return code if code > 0 else 128 + (-code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ringrun", description="Start N ranks of a command for ringreduce and watch them.",
        epilog="example: ringrun -np 4 python train.py")
    parser.add_argument("-np", "-n", dest="np", type=int, required=True, help="number of ranks")
    parser.add_argument("-H", "--hosts", help="host1:slots,host2:slots (ranks fill hosts in order; ssh)")
    parser.add_argument("--timeout", type=float, help="RINGREDUCE_TIMEOUT for the ranks (seconds)")
    parser.add_argument("--ssh", default="ssh -o BatchMode=yes", help="command used to reach other hosts")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command given")
    if args.np < 1:
        parser.error("-np must be at least 1")
    return run(args.np, args.command, args.hosts, args.timeout, args.ssh)


if __name__ == "__main__":
    sys.exit(main())
