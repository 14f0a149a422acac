"""ringrun --elastic: keep a job of between --min-np and --max-np workers.

    ringrun --elastic -np 4 --min-np 2 --max-np 8 python train.py
    ringrun --elastic -np 4 --host-discovery-script ./hosts.sh python train.py

ringrun holds the rendezvous (ringreduce/launch/rendezvous_server.py), so no worker is
special and any may die, rank 0 too. Each worker runs under its guard, as
without --elastic, with RINGREDUCE_ELASTIC_ADDR, RINGREDUCE_SECRET, the
job's RINGREDUCE_JOB (as ringrun's) and a RINGREDUCE_WORKER_ID of its own
instead of a rank (ranks change with each generation); its output lines are
prefixed with that id.

A worker that fails (exits non-zero or is killed) is started again on a
host that still exists, after a back-off (1 s, doubling with each failure
on that host in a row, at most 30 s), at most --max-restarts times in all;
a host with HOST_FAILURES failures within BLACKLIST_SECONDS is left out for
BLACKLIST_SECONDS. With --host-discovery-script (prints `host` or
`host:slots` lines; run every DISCOVERY_INTERVAL seconds) new slots get
workers, up to --max-np, and workers on hosts that disappear are stopped.
While fewer than --min-np workers run, ringrun waits up to
--elastic-timeout seconds, then stops the rest and exits 1 saying why.

When every worker of the first -np fails the same way (the same exit code,
or killed by the same signal) before any worker committed its state, the
script is at fault, not a host: ringrun ends the job as a plain ringrun
does, with that exit code, instead of restarting workers that would only
fail again.

Once a worker exits 0 the job is finishing: nothing is restarted, and
ringrun exits 0 when the last worker is done. Workers still in the last
generation, and those that closed their connection to the rendezvous (while
they save a model, or exit), are waited for however long their work after
`run` takes; only workers waiting to join a ring that will not form again,
and those cut off from the rendezvous (dropped, or their host stopped
answering), are stopped.

While it waits, ringrun sleeps (on its workers' exits, signals, and the
next thing due), and so does the rendezvous: a job waiting for minutes
takes no CPU.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from . import processes
from .rendezvous_server import RendezvousServer

BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0
HOST_FAILURES, BLACKLIST_SECONDS = 3, 60.0
DISCOVERY_INTERVAL = 1.0
REJOIN_TIMEOUT = 60.0  # seconds a member may take to come back after a loss (--timeout, if given)


@dataclass
class Options:
    np: int
    min_np: int
    max_np: int
    max_restarts: int = 100
    elastic_timeout: float = 600.0
    discovery_script: str | None = None
    hosts_spec: str | None = None
    timeout: float | None = None
    ssh: str = "ssh -o BatchMode=yes"
    verbose: bool = False  # say what the rendezvous does (RINGRUN_VERBOSE=1)


@dataclass
class Host:
    name: str
    slots: int
    failures: list = field(default_factory=list)  # times of failures, newest last
    in_a_row: int = 0                               # failures since its last worker ran fine
    left_out_until: float = 0.0


def parse_slots(text: str) -> dict[str, int]:
    """'a:2,b' or lines 'a:2' / 'b' -> {'a': 2, 'b': 1}."""
    slots: dict[str, int] = {}
    for item in text.replace(",", "\n").splitlines():
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        name, _, n = item.partition(":")
        if not name or (n and not n.isdigit()):
            raise ValueError(f"{item!r} is not host or host:slots (slots a number >= 0)")
        slots[name] = slots.get(name, 0) + (int(n) if n else 1)
    return slots


def discover(script: str) -> dict[str, int] | None:
    """The discovery script's hosts, or None if it failed (keep the last)."""
    try:
        out = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        processes.say(f"host discovery script failed: {exc}")
        return None
    if out.returncode != 0:
        processes.say(f"host discovery script exited with code {out.returncode}: {out.stderr.strip()[:200]}")
        return None
    try:
        return parse_slots(out.stdout)
    except ValueError as exc:  # one bad run of the script must not end the job
        processes.say(f"host discovery script printed {exc}: ignored, hosts unchanged")
        return None


def advertised_address(hosts: list[str]) -> str:
    """The address workers dial the rendezvous at: this machine's own address
    on the route to the first remote host. Local workers dial it too, so the
    server sees them come from an address the remote ones can reach (by
    127.0.0.1 they would; their ring peers on other hosts could not reach
    that). Falls back to the host name when no remote host resolves."""
    for host in hosts:
        if host in processes.LOCAL_HOSTS:
            continue
        try:
            family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)  # no packet is sent: the kernel only picks the route and its source address
                return s.getsockname()[0]
        except OSError:
            continue
    return socket.gethostname()


@dataclass
class Worker:
    serial: int
    id: str
    host: str
    proc: subprocess.Popen
    started: float


class ElasticJob:
    def __init__(self, opts: Options, command: list[str]):
        self.opts, self.command = opts, command
        self.job = processes.Job()
        self.secret = os.environ.get("RINGREDUCE_SECRET") or secrets.token_hex(32)
        self.job_id = os.environ.get("RINGREDUCE_JOB") or f"ringrun-{secrets.token_hex(4)}"  # as ringrun.job_id
        self.hosts: dict[str, Host] = {}
        if opts.discovery_script:
            found = discover(opts.discovery_script) or {}
            self.hosts = {h: Host(h, n) for h, n in found.items()}
        elif opts.hosts_spec:
            self.hosts = {h: Host(h, n) for h, n in parse_slots(opts.hosts_spec).items()}
        else:
            self.hosts = {"localhost": Host("localhost", max(opts.np, opts.max_np))}
        local = all(h in processes.LOCAL_HOSTS for h in self.hosts) and not opts.discovery_script
        self.server = RendezvousServer(self.secret.encode(), expected=opts.np, min_np=opts.min_np,
                                       max_np=opts.max_np, bind_host="127.0.0.1" if local else "0.0.0.0",
                                       rejoin_timeout=opts.timeout or REJOIN_TIMEOUT)
        self.addr_host = "127.0.0.1" if local else advertised_address(list(self.hosts))
        self.workers: list[Worker] = []
        self.serial = 0
        self.restarts = 0
        self.pending: list[tuple[float, str]] = []  # (when, preferred host) of restarts due
        self.pumps: list[threading.Thread] = []
        self.finishing = False
        self.stopped_joiners: set = set()  # ids of the joiners stopped once training finished
        self.below_since: float | None = None
        self.last_discovery = time.monotonic()

    # -- workers

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def free_host(self, preferred: str | None, now: float) -> str | None:
        busy = {}
        for w in self.running():
            busy[w.host] = busy.get(w.host, 0) + 1
        usable = [h for h in self.hosts.values() if h.left_out_until <= now and busy.get(h.name, 0) < h.slots]
        for h in usable:
            if h.name == preferred:
                return h.name
        return usable[0].name if usable else None

    def start(self, host: str) -> bool:
        self.serial += 1
        wid = f"{host}#{self.serial}"
        env = {"RINGREDUCE_ELASTIC_ADDR": f"{self.addr_host}:{self.server.port}", "RINGREDUCE_SECRET": self.secret,
               "RINGREDUCE_WORKER_ID": wid, "RINGREDUCE_JOB": self.job_id, "PYTHONUNBUFFERED": "1"}
        if self.opts.timeout is not None:
            env["RINGREDUCE_TIMEOUT"] = str(self.opts.timeout)
        argv = processes.rank_argv(host, env, self.command, self.opts.ssh)
        try:
            p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            processes.say(f"cannot start worker {wid} ({argv[0]}): {exc}")
            return False
        self.job.ranks.append(processes.Rank(self.serial, host in processes.LOCAL_HOSTS, p))
        self.workers.append(Worker(self.serial, wid, host, p, time.monotonic()))
        threading.Thread(target=self._wake_on_exit, args=(p,), daemon=True).start()
        for stream, sink, name in ((p.stdout, sys.stdout, "stdout"), (p.stderr, sys.stderr, "stderr")):
            t = threading.Thread(target=self.job.pump, args=(wid, stream, sink, name), daemon=True)
            t.start()
            self.pumps.append(t)
        return True

    def _wake_on_exit(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self.job.waker.poke()

    def failed_alike_at_start(self) -> int | None:
        """The exit code every worker of the first -np ended with, if each
        failed, all alike, and no worker ever committed (the script fails at
        start: a restart would fail again); None otherwise."""
        first = self.workers[:self.opts.np]
        if len(first) < self.opts.np or self.server.has_committed():
            return None
        codes = {w.proc.poll() for w in first}
        if len(codes) != 1:
            return None
        code = codes.pop()
        return code if code is not None and code != 0 else None

    def failed(self, w: Worker, code: int, now: float) -> None:
        host = self.hosts.get(w.host)
        why = f"worker {w.id} {processes.describe(code)}"
        if host is not None:
            host.failures = [t for t in host.failures if now - t < BLACKLIST_SECONDS] + [now]
            host.in_a_row += 1
            if len(host.failures) >= HOST_FAILURES:
                host.left_out_until = now + BLACKLIST_SECONDS
                host.failures = []
                why += f"; host {w.host} failed {HOST_FAILURES} times within {BLACKLIST_SECONDS:.0f} s: " \
                       f"left out for {BLACKLIST_SECONDS:.0f} s"
        if self.finishing:
            processes.say(why)
            return
        if self.restarts >= self.opts.max_restarts:
            processes.say(f"{why}; not restarted (--max-restarts {self.opts.max_restarts} used)")
            return
        self.restarts += 1
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** ((host.in_a_row if host else 1) - 1))
        self.pending.append((now + delay, w.host))
        processes.say(f"{why}; restarting it in {delay:.0f} s ({self.restarts}/{self.opts.max_restarts})")

    # -- the watch loop

    def watch(self) -> processes.Ending:
        seen_exit: set = set()
        told = 0
        while True:
            now = time.monotonic()
            if self.opts.verbose:  # what the rendezvous did, for whoever debugs a job
                with self.server.lock:
                    news, told = self.server.events[told:], len(self.server.events)
                for event in news:
                    processes.say(f"rendezvous: {event}")
            if self.job.signals:
                sig = self.job.signals[0]
                return self.stop(processes.Ending(128 + sig, own_signal=sig), f"got {signal.Signals(sig).name}")
            for w in self.workers:
                code = w.proc.poll()
                if code is None or w.serial in seen_exit:
                    continue
                seen_exit.add(w.serial)
                if code == 0:
                    self.finishing = True
                    self.pending.clear()
                    host = self.hosts.get(w.host)
                    if host is not None:
                        host.in_a_row = 0
                else:
                    raised = self.server.failure_of(w.id)
                    if raised is not None:  # the program's error: a restart would only raise it again
                        return self.stop(processes.Ending(code if code > 0 else 1),
                                         f"worker {w.id} raised {raised} in its training function")
                    alike = None if self.finishing else self.failed_alike_at_start()
                    if alike is not None:  # the script fails at start: end as a plain ringrun would
                        return self.stop(processes.Ending(alike if alike > 0 else 128 - alike),
                                         f"every worker (all {self.opts.np}) {processes.describe(alike)} before any "
                                         f"commit: not restarted, each would fail the same way")
                    self.failed(w, code, now)
            running = self.running()
            if self.finishing and not running:
                return processes.Ending(0)
            if self.finishing:
                self.stop_joiners(running)
            if not self.finishing:
                self.discover(now)
                self.start_due(now)
                for w in running:  # a worker that ran a while resets its host's back-off
                    h = self.hosts.get(w.host)
                    if h is not None and now - w.started > BACKOFF_MAX:
                        h.in_a_row = 0
                running = self.running()
                if len(running) < self.opts.min_np:
                    self.below_since = self.below_since or now
                    hopeless = not running and not self.pending
                    if hopeless or now - self.below_since > self.opts.elastic_timeout:
                        waited = f"for {now - self.below_since:.0f} s (--elastic-timeout {self.opts.elastic_timeout:g})"
                        return self.stop(processes.Ending(1), f"{len(running)} worker(s) left, below --min-np "
                                         f"{self.opts.min_np}, {'with no restart left' if hopeless else waited}")
                else:
                    self.below_since = None
            self.job.waker.wait(self.sleep_for(time.monotonic()))

    def sleep_for(self, now: float) -> float:
        """Seconds until something is due: a restart, a discovery run, the
        --elastic-timeout; at most 1 s (the rendezvous's news, read each
        turn), at least 10 ms. Exits and signals wake the loop sooner."""
        due = [now + 1.0]
        if self.finishing:
            due.append(now + 0.2)  # finished workers leave the rendezvous: look again soon
        else:
            due += [when for when, _ in self.pending]
            if self.opts.discovery_script:
                due.append(self.last_discovery + DISCOVERY_INTERVAL)
            if self.below_since is not None:
                due.append(self.below_since + self.opts.elastic_timeout + 0.01)
        return max(0.01, min(due) - now)

    def stop_joiners(self, running: list[Worker]) -> None:
        """Training is over: the workers still waiting to join a ring that
        will not form again, and those cut off from the rendezvous (dropped,
        or their host stopped answering), are stopped once no worker of the last
        generation is running. Every other worker (in that generation, or one
        that closed its connection itself: finished, saving, exiting) is
        waited for."""
        ids = {w.id for w in running}
        if self.server.members() & ids:
            return
        joiners = self.server.joiners(ids) - self.stopped_joiners
        dropped = self.server.dropped_of(ids) - joiners - self.stopped_joiners
        if not joiners and not dropped:
            return
        left = len(ids - joiners - dropped - self.stopped_joiners)
        why = " and ".join(([f"{len(joiners)} worker(s) still waited to join"] if joiners else []) +
                           ([f"{len(dropped)} worker(s) cut off from the rendezvous still ran"] if dropped else []))
        processes.say(f"training finished; {why}; stopping them"
                 + (f" (waiting for {left} finishing worker(s) to exit)" if left else ""))
        self.stopped_joiners |= joiners | dropped
        for w in running:
            if w.id in joiners | dropped:
                _stop_one(w)

    def start_due(self, now: float) -> None:
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, preferred in due:
            host = self.free_host(preferred, now)
            if host is None:
                self.pending.append((now + BACKOFF_FIRST, preferred))  # no host for it yet: try again later
            else:
                self.start(host)
        if not self.opts.discovery_script:
            return
        # new slots (discovery) get workers, up to --max-np
        while len(self.running()) + len(self.pending) < self.opts.max_np:
            host = self.free_host(None, now)
            if host is None or not self.start(host):
                break

    def discover(self, now: float) -> None:
        if not self.opts.discovery_script or now - self.last_discovery < DISCOVERY_INTERVAL:
            return
        self.last_discovery = now
        found = discover(self.opts.discovery_script)
        if found is None:
            return
        for name, slots in found.items():
            if name not in self.hosts:
                processes.say(f"host {name} found ({slots} slot(s))")
                self.hosts[name] = Host(name, slots)
            self.hosts[name].slots = slots
        for name in [h for h in self.hosts if h not in found]:
            processes.say(f"host {name} is gone: stopping its workers")
            del self.hosts[name]
            for w in self.running():
                if w.host == name:
                    _stop_one(w)

    def stop(self, ending: processes.Ending, reason: str) -> processes.Ending:
        others = self.running()
        processes.say(f"{reason}; stopping {len(others)} worker(s)" if others else f"{reason}; no worker left to stop")
        self.job.stop_all(signal.SIGTERM)
        kill_at = time.monotonic() + processes.GRACE_SECONDS + 1
        while self.running():
            if time.monotonic() > kill_at or len(self.job.signals) > 1:
                self.job.stop_all(signal.SIGKILL)
                kill_at = float("inf")
            self.job.waker.wait(0.2)
        return ending


def _stop_one(w: Worker) -> None:
    try:
        w.proc.stdin.close()  # its guard stops it (SIGTERM, SIGKILL after the grace)
    except OSError:
        pass


def run(opts: Options, command: list[str]) -> processes.Ending:
    opts.verbose = opts.verbose or os.environ.get("RINGRUN_VERBOSE", "") not in ("", "0")
    ej = ElasticJob(opts, command)
    old = {s: signal.signal(s, lambda signum, frame: ej.job.signals.append(signum)) for s in processes.STOP_SIGNALS}
    ej.job.waker.catch_signals()
    try:
        for _ in range(opts.np):
            host = ej.free_host(None, time.monotonic())
            if host is None:
                return ej.stop(processes.Ending(1), f"only {len(ej.running())} slot(s) for -np {opts.np}")
            if not ej.start(host):
                return ej.stop(processes.Ending(127), "cannot start the workers")
        return ej.watch()
    finally:
        ej.job.waker.close()
        for s, h in old.items():
            signal.signal(s, h)
        for t in ej.pumps:
            t.join(timeout=5)
        ej.server.close()
