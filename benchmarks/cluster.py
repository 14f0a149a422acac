"""An emulated cluster on one machine: one network namespace per host.

    with Cluster(4, rate="1gbit") as c:
        procs = [c.popen(i, ["python", "train.py"], env) for i in range(4)]

Each host gets a veth pair into a shared bridge, an address 10.<net>.0.<i+1>
inside its own namespace, and optionally a shaped link (tc tbf: `rate`, and
`delay` through netem where the kernel has it) on both directions, so every
host's link is the bottleneck it would be on a real switch. Everything is torn
down on exit, on error and on Ctrl-C. Needs root (CAP_NET_ADMIN) and iproute2.
Traffic stays inside the namespaces this module made.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import uuid


class ClusterError(RuntimeError):
    pass


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(*args, netns=None, check=True):
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["tc", *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def can_build() -> str | None:
    """None if namespaces can be made here, else the reason why not."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"rrprobe{uuid.uuid4().hex[:6]}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot make a network namespace: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _shaper(rate: str | None, delay: str | None) -> list[str]:
    """tc arguments for one link direction; netem when a delay is asked for."""
    if delay:
        args = ["netem", "delay", delay]
        return args + (["rate", rate] if rate else [])
    # A burst of a few ms at the rate keeps tbf exact at gigabit speeds.
    return ["tbf", "rate", rate, "burst", "512kb", "latency", "100ms"]


class Cluster:
    def __init__(self, hosts: int, rate: str | None = None, delay: str | None = None, net: int | None = None):
        if hosts < 1 or hosts > 250:
            raise ValueError("hosts must be 1..250")
        self.hosts, self.rate, self.delay = hosts, rate, delay
        self.tag = uuid.uuid4().hex[:6]
        self.net = net if net is not None else 200 + int(self.tag, 16) % 50
        self.bridge = f"rrbr{self.tag}"
        self.namespaces = [f"rr{self.tag}h{i}" for i in range(hosts)]
        self.addresses = [f"10.{self.net}.0.{i + 1}" for i in range(hosts)]
        self._up = False

    # -- lifecycle --------------------------------------------------------

    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()
        return False

    def up(self) -> None:
        reason = can_build()
        if reason:
            raise ClusterError(reason)
        self._up = True
        atexit.register(self.down)
        self._old_int = signal.getsignal(signal.SIGINT)
        self._old_term = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
                outside = f"rrv{self.tag}{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/16", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                if self.rate or self.delay:
                    # Shape both directions: egress of the host (inside) and
                    # egress towards the host (the bridge side of its veth).
                    _tc("qdisc", "add", "dev", "eth0", "root", *_shaper(self.rate, self.delay), netns=ns)
                    _tc("qdisc", "add", "dev", outside, "root", *_shaper(self.rate, self.delay))
        except subprocess.CalledProcessError as exc:
            self.down()
            raise ClusterError(f"building the cluster failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        except BaseException:
            self.down()
            raise

    def _on_signal(self, signum, frame):
        self.down()
        raise KeyboardInterrupt

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:
            # Killing what still runs inside lets the namespace go at once.
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        for i in range(self.hosts):
            _ip("link", "del", f"rrv{self.tag}{i}", check=False)
        _ip("link", "del", self.bridge, check=False)
        signal.signal(signal.SIGTERM, self._old_term if callable(self._old_term) else signal.SIG_DFL)

    def leftovers(self) -> list[str]:
        """Namespaces or links of this cluster that still exist (for tests)."""
        names = set(_ip("netns", "list", check=False).stdout.split())
        links = _ip("-o", "link", "show", check=False).stdout
        left = [ns for ns in self.namespaces if ns in names]
        left += [name for name in [self.bridge] + [f"rrv{self.tag}{i}" for i in range(self.hosts)]
                 if f" {name}:" in links or f" {name}@" in links]
        return left

    # -- running ----------------------------------------------------------

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def popen(self, host: int, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), env=env, **kw)

    def ring_env(self, host: int, port: int, secret: str, size: int | None = None, base: dict | None = None) -> dict:
        """Environment for one ringreduce rank per host on hosts 0..size-1, rank 0 on host 0."""
        env = dict(os.environ if base is None else base)
        env.update(RINGREDUCE_RANK=str(host), RINGREDUCE_SIZE=str(size or self.hosts),
                   RINGREDUCE_ADDR=f"{self.addresses[0]}:{port}", RINGREDUCE_SECRET=secret,
                   RINGREDUCE_LOCAL_RANK="0", RINGREDUCE_LOCAL_SIZE="1", PYTHONUNBUFFERED="1")
        return env
