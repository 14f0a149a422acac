"""One rank's guard: runs the rank's command and ends it when ringrun goes away.

    python -I .../ringreduce/launch/guard.py --grace 3 -- python train.py

ringrun starts every rank under a guard, locally or at the far end of ssh, and
keeps the only write end of a pipe on the guard's stdin. ringrun never writes
to it, so EOF there means ringrun is gone (killed, even by SIGKILL, or its ssh
connection dropped) or wants the rank stopped. Either way the guard sends
SIGTERM to the rank's whole process group, SIGKILL `grace` seconds later.
SIGTERM, SIGINT or SIGHUP to the guard stop the rank the same way.

The guard leads its own process group and the command (and whatever it
starts) stays in it, so one killpg reaches them all; the command also gets
PR_SET_PDEATHSIG, so it dies if the guard alone is killed. The guard exits the
way its command did (same code, or killed by the same signal), so ringrun can
say why a rank ended. Standard library only, so it starts fast under -I.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import select
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _die_with_parent(parent_pid: int):
    """preexec_fn: the child gets SIGKILL when the guard dies (Linux; else a no-op)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec():
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the guard died before prctl took effect
            os._exit(137)
    return preexec


def _exit_like(code: int):
    """Ends the guard the way its command ended: same code, or the same signal."""
    if code >= 0:
        sys.exit(code)
    sig = -code
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the command dumped core already if it was to
    try:
        signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ, and we caught the stop signals
    except (OSError, ValueError):
        pass  # SIGKILL and SIGSTOP cannot be caught, nor need to be
    os.kill(os.getpid(), sig)
    sys.exit(128 + sig)  # a signal that does not end a process


def guard(command: list[str], grace: float) -> None:
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # under sshd: a group of our own, without the remote shell
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stop_requested = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: stop_requested.append(signum))
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent(os.getpid()))
    except OSError as exc:
        hint = (f" (a Python script needs its interpreter: ringrun -np N python {' '.join(command)})"
                if command[0].endswith(".py") else "")
        print(f"ringrun: cannot start {command[0]}: {exc}{hint}", file=sys.stderr, flush=True)
        sys.exit(127)
    try:
        child_exit = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        child_exit = None  # polled below instead
    watch = [0, wake_r] + ([child_exit] if child_exit is not None else [])
    kill_at = None
    while child.poll() is None:
        if kill_at is None and stop_requested:
            kill_at = _stop(grace)
        if kill_at is not None and time.monotonic() >= kill_at:
            os.killpg(0, signal.SIGKILL)  # the guard too: nothing of the rank is left
        ready, _, _ = select.select(watch, [], [], 0.2)
        if 0 in ready and not os.read(0, 4096):  # EOF: ringrun is gone or wants us stopped
            watch.remove(0)
            stop_requested.append(0)
        if wake_r in ready:
            os.read(wake_r, 4096)
    _end_the_group(grace)
    _exit_like(child.returncode)


def _end_the_group(grace: float) -> None:
    """Whatever the command left running in its group (a background job)
    ends with it: SIGTERM, then SIGKILL after `grace` seconds."""
    if not _others_in_group():
        return
    _stop(grace)
    deadline = time.monotonic() + grace
    while _others_in_group() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in _others_in_group():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _others_in_group() -> list[int]:
    """Live processes of our group other than the guard (Linux /proc; elsewhere none are seen)."""
    me, group, found = os.getpid(), os.getpgrp(), []
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit() and int(e) != me]
    except OSError:
        return found
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            found.append(int(pid))
    return found


def _stop(grace: float) -> float:
    try:
        os.killpg(0, signal.SIGTERM)  # our handler keeps the guard alive to wait for the command
    except ProcessLookupError:
        pass
    return time.monotonic() + grace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ringreduce.launch.guard", description=__doc__.splitlines()[0])
    parser.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    guard(command, args.grace)


if __name__ == "__main__":
    main()
