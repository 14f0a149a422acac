"""ringrun: start N ranks of a command and watch them.

    ringrun -np 4 python train.py
    ringrun -np 4 -H node1:2,node2:2 python train.py      # over ssh
    ringrun --elastic -np 4 --min-np 2 python train.py    # elastic (elastic_launcher.py)

Each rank gets RINGREDUCE_RANK/SIZE/ADDR/SECRET/LOCAL_RANK/LOCAL_SIZE (and
RINGREDUCE_TIMEOUT with --timeout); every output line is prefixed with its
rank. Every rank runs under a guard (guard.py) that ends it when ringrun goes
away, however ringrun ends. When any rank exits non-zero or is killed, when
ringrun gets SIGINT/SIGTERM/SIGHUP, or when its stdout or stderr is closed,
ringrun stops every rank, says why in one line on stderr and exits saying why
too: no job lingers half-dead.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from ..core.world import free_port
from . import elastic_launcher, postmortem
from .processes import (GRACE_SECONDS, LOCAL_HOSTS, STOP_SIGNALS, Ending, Job, Rank, ask_for_dumps, describe, rank_argv,
                        say)
from .report_dir import ENV as REPORT_DIR_ENV, close_report_dir, open_report_dir


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


def run(np_: int, command: list[str], hosts_spec: str | None = None, timeout: float | None = None,
        ssh: str = "ssh -o BatchMode=yes") -> Ending:
    hosts = parse_hosts(hosts_spec, np_)
    port = free_port()
    secret = os.environ.get("RINGREDUCE_SECRET") or secrets.token_hex(32)
    job = Job()
    report = open_report_dir()  # the ranks' flight recorder dumps (ringreduce/launch/report_dir.py)
    job.report_dir, started = report.path, time.time()
    old = {s: signal.signal(s, lambda signum, frame: job.signals.append(signum)) for s in STOP_SIGNALS}
    job.waker.catch_signals()
    pumps = []
    ending = None
    try:
        for rank, (host, env) in enumerate(zip(hosts, rank_envs(hosts, port, secret, timeout))):
            env[REPORT_DIR_ENV] = report.path
            argv = rank_argv(host, env, command, ssh)
            try:
                # stdin: the control pipe; only ringrun holds its write end (close_fds).
                p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.PIPE, start_new_session=True)
            except OSError as exc:
                say(f"cannot start rank {rank} ({argv[0]}): {exc}")
                job.stop_all(signal.SIGKILL)
                ending = Ending(127)
                return ending
            job.ranks.append(Rank(rank, host in LOCAL_HOSTS, p))
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
                    ended = [job.ranks[i] for i in job.ended]
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
    parser.add_argument("-H", "--hosts", help="host1:slots,host2:slots (ranks fill hosts in order; ssh)")
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
        ending = run(args.np, args.command, args.hosts, args.timeout, args.ssh)
    if ending.own_signal is not None:
        end_by_signal(ending.own_signal)
    return ending.code  # also where the signal did not end us


if __name__ == "__main__":
    sys.exit(main())
