"""The processes of a job, as ringrun and the elastic launcher start and stop
them: each rank's command line (under its guard, over ssh on a remote host),
a Job of running ranks and how it ends, and ringrun's one-line messages."""
from __future__ import annotations

import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from . import guard as _guard

GRACE_SECONDS = 3.0  # SIGTERM -> SIGKILL, in the guard; ringrun kills what is left a second later
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def guarded(command: list[str]) -> list[str]:
    """The command under its guard; -I: the guard needs only the standard library."""
    return [sys.executable, "-I", os.path.abspath(_guard.__file__), "--grace", str(GRACE_SECONDS), "--", *command]


def rank_argv(host: str, env: dict, command: list[str], ssh: str, srun: bool = False) -> list[str]:
    """The rank's command line: local, over srun (inside a Slurm allocation:
    a one-task step on that node, the environment passed whole) or over ssh."""
    if host in LOCAL_HOSTS:
        return guarded(command)
    if srun:
        # --export=ALL: a batch script of `sbatch --export=NONE` would otherwise
        # start a rank without its RINGREDUCE_* (a world of one); --input=all:
        # the guard's stdin is ringrun's pipe, so the rank ends with ringrun;
        # --overlap: the ranks share the allocation's CPUs with any step running.
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--export=ALL",
                "--input=all", "--kill-on-bad-exit=1", "--quiet", *guarded(command)]
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    remote = f"cd {shlex.quote(os.getcwd())} && env {assignments} {shlex.join(guarded(command))}"
    return [*shlex.split(ssh), host, remote]


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def say(message: str) -> None:
    """One line on ringrun's stderr, if it is still open."""
    try:
        print(f"ringrun: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class Waker:
    """What a waiting ringrun sleeps on: a pipe that a rank's exit, a closed
    output or a signal (signal.set_wakeup_fd) writes a byte to. `wait` blocks
    in poll() until then or its timeout, so a waiting ringrun takes no CPU
    however long it waits."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        self.old_wakeup: int | None = None
        self.lock = threading.Lock()  # a poke never writes to a descriptor close() gave back
        self.closed = False

    def poke(self) -> None:
        with self.lock:
            if self.closed:
                return
            try:
                os.write(self.w, b"!")
            except OSError:
                pass  # the pipe is full: a wake-up is pending anyway

    def wait(self, timeout: float) -> None:
        try:
            poller = select.poll()  # not select(): descriptors past 1024 (many ranks' pipes) are fine here
            poller.register(self.r, select.POLLIN)
            poller.poll(max(0.0, timeout) * 1000)
            while os.read(self.r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        except (OSError, ValueError):
            time.sleep(max(0.0, timeout))  # closed: sleep instead, never spin

    def catch_signals(self) -> None:
        """Signals wake `wait` at once (the main thread only; elsewhere the timeout does)."""
        try:
            self.old_wakeup = signal.set_wakeup_fd(self.w)
        except ValueError:
            self.old_wakeup = None

    def close(self) -> None:
        if self.old_wakeup is not None:
            try:
                signal.set_wakeup_fd(self.old_wakeup)
            except ValueError:
                pass
            self.old_wakeup = None
        with self.lock:
            if self.closed:
                return
            self.closed = True
            os.close(self.r)
            os.close(self.w)


@dataclass
class Rank:
    index: int
    local: bool
    proc: subprocess.Popen  # the guard, or ssh running it


@dataclass
class Ending:
    code: int                       # ringrun's exit status, shell style (128 + N: signal N)
    own_signal: int | None = None   # ringrun stopped because of this signal: end by it too


class Job:
    def __init__(self):
        self.ranks: list[Rank] = []
        self.lock = threading.Lock()
        self.signals: list[int] = []         # signals ringrun got, in order (from the handler)
        self.closed_sink: str | None = None  # "stdout"/"stderr" once writing to it failed
        self.ended: list[int] = []           # ranks in the order they ended: the first failure is the cause
        self.waker = Waker()                 # woken by each of the above
        self.report_dir: str | None = None   # where the ranks leave their reports (report_dir.py)

    def wait_for(self, rank: "Rank"):
        """Records when a rank ends, so ringrun blames the first to fail (its
        peers fail a moment later, lost a peer), not the lowest rank number."""
        rank.proc.wait()
        with self.lock:
            self.ended.append(rank.index)
        self.waker.poke()

    def pump(self, rank: int, stream, sink, sink_name: str):
        """Copies one rank's output to ours, line by line, each line prefixed.

        Once our sink is closed the lines are read and dropped, so a rank never
        blocks on a full pipe while it is being stopped."""
        prefix = f"[{rank}] ".encode()
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self.lock:
                if self.closed_sink is not None:
                    continue
                try:
                    sink.buffer.write(prefix + line)
                    sink.buffer.flush()
                except (OSError, ValueError):  # BrokenPipeError: `| head` is done with us
                    self.closed_sink = sink_name
                    _silence(sink)
                    self.waker.poke()
        stream.close()

    def running(self) -> list[Rank]:
        return [r for r in self.ranks if r.proc.poll() is None]

    def stop_all(self, sig=signal.SIGTERM):
        """Closes every control pipe (the guards stop their ranks, ssh passes the
        EOF on) and signals the local process groups directly as well."""
        for r in self.ranks:
            if r.proc.stdin is not None and not r.proc.stdin.closed:
                try:
                    r.proc.stdin.close()
                except OSError:
                    pass
            if r.local or sig == signal.SIGKILL:
                try:
                    os.killpg(r.proc.pid, sig)  # the group outlives a dead guard while any of it runs
                except (ProcessLookupError, PermissionError):
                    pass


def _silence(sink) -> None:
    """Points a closed stdout/stderr at /dev/null, so nothing later trips on it."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sink.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


ASK_SECONDS = 2.0  # how long a failed job's ranks still running get to write their flight recorder dump


def ask_for_dumps(job: "Job", seconds: float = ASK_SECONDS) -> list[int]:
    """Before a failed job's ranks are stopped: each local rank still running
    whose ringreduce left its marker in the report directory (the rank's pid;
    SIGUSR1 dumps there, ringreduce/core/flight_recorder.py) gets SIGUSR1, and
    ringrun waits up to `seconds` for their dumps (or their end). Only a pid
    in that rank's process group (its guard's) is signalled: a stale marker
    never reaches another process. Returns the ranks asked."""
    directory = job.report_dir
    if not directory:
        return []
    asked, since = [], time.time()
    for r in job.running():
        if not r.local:
            continue
        try:
            with open(os.path.join(directory, f"flight_rank{r.index}.pid")) as f:
                pid = int(f.read().strip())
            if pid <= 0 or os.getpgid(pid) != r.proc.pid:
                continue
            os.kill(pid, signal.SIGUSR1)
        except (OSError, ValueError):
            continue
        asked.append(r)
    deadline = time.monotonic() + seconds
    while asked and time.monotonic() < deadline and len(job.signals) < 2:  # a second Ctrl-C: stop now
        def written(r):
            try:
                return os.stat(os.path.join(directory, f"flight_rank{r.index}.json")).st_mtime >= since
            except OSError:
                return False
        asked_left = [r for r in asked if r.proc.poll() is None and not written(r)]
        if not asked_left:
            break
        time.sleep(0.05)
    return [r.index for r in asked]
