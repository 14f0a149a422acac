"""A pool of initialized worlds that run snippets, so a test that only runs
collectives on a healthy world need not start one of its own.

    def test_sums(world_pool):
        ranks = world_pool.run(4, "result = rr.allreduce(np.ones(3)).tolist()")

It runs the snippet as tests/ranks.py run_ranks does (after `import numpy as
np, ringreduce as rr`, rr.init(); `result` comes back per rank), on n rank
processes that stay alive between tests: one world per (n, env), started
on first use (rank_env, as run_ranks starts its ranks) and kept while it is
healthy. Each rank runs the snippet in a fresh namespace.

What holds, as with run_ranks:
- A rank whose snippet raises fails the test, showing that rank's
  traceback; it then exits, so its peers' collectives with it end
  (PeerLostError) instead of waiting; the world is discarded.
- A snippet that outlives `timeout` fails the test ("timed out"); every
  process of that world is killed, and the next test gets a fresh one.
- A snippet that leaves the world unfit for the next test is not
  trusted: the world is discarded (its ranks killed) and the next test
  gets a fresh one. Unfit: ringreduce shut down, os.environ changed, a
  function or class of a ringreduce module rebound (monkeypatching), a
  thread left running (the engine's, a snippet's), or the health check
  after it failed: every rank allgathers the run's sequence number, which
  must come back from every rank alike within HEALTH_TIMEOUT (a ring left
  out of step by one collective fails it).
- Process sets a snippet added are removed after it (every rank alike), so
  the next snippet's sets get ids 1, 2, ... as in a fresh world.

Tests that need a fresh world (a rank killed, a setting that differs per
rank, init() itself, a patched module) keep using run_ranks.

Run as a script, this file is one rank of a pooled world (its protocol:
length-prefixed pickles; commands on stdin, replies on RR_POOL_REPLY_FD).
"""
from __future__ import annotations

import os
import pickle
import secrets
import select
import struct
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

HEALTH_TIMEOUT = 60.0  # seconds for the health check after a snippet
START_TIMEOUT = 120.0  # seconds for a world's ranks to start and init()
MAX_POOLED_RANKS = 16  # the least recently used worlds go beyond this many rank processes


def _send(f, obj) -> None:
    data = pickle.dumps(obj)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


# --------------------------------------------------------------------------- one rank (run as a script)


def _recv_blocking(f):
    head = f.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(f.read(size))


def _callables() -> dict:
    """id of every function and class bound in a ringreduce module: a snippet
    that rebinds one (monkeypatching) changes this."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "ringreduce" or name.startswith("ringreduce.")):
            continue
        for attr, value in list(vars(mod).items()):
            if callable(value):
                out[name, attr] = id(value)
    return out


def _registered_sets() -> dict | None:
    """The process sets registered on this rank, by id (the global set, 0,
    left out); None where this cannot be told (the world is then not reused)."""
    try:
        from ringreduce.core import collectives
        return {k: v for k, v in collectives.communicator().sets.items() if k != 0}
    except Exception:  # noqa: BLE001 - ringreduce's internals moved: reuse nothing
        return None


def _unfit(rr, env, funcs, threads) -> list[str]:
    import threading
    why = []
    if not rr.is_initialized():
        why.append("ringreduce is no longer initialized")
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    if changed:
        why.append(f"os.environ changed: {changed}")
    now = _callables()
    rebound = sorted(f"{m}.{a}" for (m, a), i in funcs.items() if now.get((m, a), i) != i)
    if rebound:
        why.append(f"rebound: {rebound[:5]}")
    left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()]
    if left:
        why.append(f"threads left running: {left}")
    return why


def _serve() -> None:
    import linecache
    import threading
    import traceback

    try:  # Linux: end with the test process, even inside a hung snippet
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    reply = os.fdopen(int(os.environ["RR_POOL_REPLY_FD"]), "wb", buffering=0)
    commands = sys.stdin.buffer
    import numpy as np

    import ringreduce as rr
    rr.init()
    _send(reply, ("ready", os.getpid()))
    while True:
        msg = _recv_blocking(commands)
        if msg is None:  # the pool closed this world
            return
        kind, seq, body = msg
        if kind == "run":
            env, funcs = dict(os.environ), _callables()
            threads = {t.ident for t in threading.enumerate()}
            before_sets = _registered_sets()
            filename = f"<snippet {seq}>"
            linecache.cache[filename] = (len(body), None, body.splitlines(True), filename)
            scope = {"__name__": "__snippet__", "os": os, "pickle": pickle, "sys": sys, "np": np, "rr": rr,
                     "result": None}
            try:
                exec(compile(body, filename, "exec"), scope)
                data = pickle.dumps(scope["result"])
            except BaseException:  # noqa: BLE001 - reported to the test, then this rank ends
                sys.stdout.flush()
                sys.stderr.write(traceback.format_exc())
                sys.stderr.flush()
                _send(reply, ("error", traceback.format_exc(), None))
                os._exit(1)  # its peers' collectives with it end now, not at RINGREDUCE_TIMEOUT
            sys.stdout.flush()
            sys.stderr.flush()
            why = _unfit(rr, env, funcs, threads)
            after_sets = _registered_sets()
            if before_sets is None or after_sets is None:
                why.append("cannot tell which process sets it added")
            added = [] if why else sorted(set(after_sets) - set(before_sets))
            scope.clear()
            _send(reply, ("ok", data, why))
        elif kind == "tidy":  # only after every rank ran its snippet and none was unfit
            try:
                sets = _registered_sets()
                for set_id in added:
                    rr.remove_process_set(sets[set_id].owners[0])
                got = rr.allgather(np.array([seq], np.int64), name=f"world_pool health {seq}")
                why = [] if got.tolist() == [seq] * rr.size() else [f"health check: {got.tolist()}"]
            except BaseException as exc:  # noqa: BLE001 - the world is discarded
                why = [f"tidying up: {type(exc).__name__}: {exc}"]
            _send(reply, ("ok", None, why))


# --------------------------------------------------------------------------- the pool (in the test process)


@dataclass
class Rank:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    result: object
    pid: int


class _World:
    def __init__(self, n: int, env: dict, folder: Path):
        import ranks
        self.n, self.folder = n, folder
        port, secret = ranks.free_port(), secrets.token_hex(16)
        self.procs, self.replies, self.outs = [], [], []
        for r in range(n):
            read_end, write_end = os.pipe()
            e = ranks.rank_env(r, n, port, secret, env)
            e["RR_POOL_REPLY_FD"] = str(write_end)
            out, err = folder / f"rank{r}.out", folder / f"rank{r}.err"
            with open(out, "wb") as fo, open(err, "wb") as fe:
                p = subprocess.Popen([sys.executable, __file__], env=e, stdin=subprocess.PIPE, stdout=fo,
                                     stderr=fe, pass_fds=[write_end])
            os.close(write_end)
            self.procs.append(p)
            self.replies.append(read_end)
            self.outs.append((out, err))
        self.pids = None

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def offsets(self) -> list:
        return [(out.stat().st_size, err.stat().st_size) for out, err in self.outs]

    def output(self, since: list | None = None) -> list:
        since = since or [(0, 0)] * self.n
        got = []
        for (out, err), (o, e) in zip(self.outs, since):
            got.append((out.read_bytes()[o:].decode(errors="replace"), err.read_bytes()[e:].decode(errors="replace")))
        return got

    def send(self, msg) -> None:
        for p in self.procs:
            _send(p.stdin, msg)

    def collect(self, timeout: float) -> list | None:
        """Each rank's reply, None for a rank that ended without one; None
        altogether when the deadline passed first."""
        deadline = time.monotonic() + timeout
        bufs = {fd: bytearray() for fd in self.replies}  # grows in place: a result may be large
        replies = [None] * self.n
        pending = set(range(self.n))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.replies[r] for r in pending], [], [], min(left, 1.0))
            for fd in ready:
                r = self.replies.index(fd)
                chunk = os.read(fd, 1 << 20)
                if not chunk:  # the rank ended
                    pending.discard(r)
                    continue
                buf = bufs[fd]
                buf += chunk
                if len(buf) >= 8 and len(buf) >= 8 + struct.unpack_from("<Q", buf)[0]:
                    replies[r] = pickle.loads(memoryview(buf)[8:])
                    pending.discard(r)
        return replies

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
            if p.stdin:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for fd in self.replies:
            try:
                os.close(fd)
            except OSError:
                pass
        self.replies = []


class WorldPool:
    """The pool; the `world_pool` fixture (conftest.py) holds one per session."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.worlds: OrderedDict = OrderedDict()
        self.seq = 0
        self.started = 0  # worlds started, for the pool's own tests
        self.discarded: list[str] = []  # why each discarded world was (the last few)

    def _discard(self, key, why: str) -> None:
        world = self.worlds.pop(key, None)
        if world is not None:
            world.close()
            self.discarded = (self.discarded + [why])[-20:]

    def _world(self, key) -> _World:
        if key in self.worlds:
            self.worlds.move_to_end(key)
            if self.worlds[key].alive():
                return self.worlds[key]
            self._discard(key, "a rank had ended")
        while self.worlds and sum(w.n for w in self.worlds.values()) + key[0] > MAX_POOLED_RANKS:
            self._discard(next(iter(self.worlds)), "evicted")
        self.started += 1
        n, env = key[0], dict(key[1])
        folder = self.folder / f"world{self.started}_n{n}"
        folder.mkdir()
        world = _World(n, env, folder)
        self.worlds[key] = world
        ok = False
        try:
            replies = world.collect(START_TIMEOUT)
            if replies is not None and all(r is not None and r[0] == "ready" for r in replies):
                world.pids = [r[1] for r in replies]
                ok = True
                return world
            self._fail(key, world, None, f"a world of {n} did not start" if replies is not None else
                       f"a world of {n} did not start within {START_TIMEOUT:.0f} s")
        finally:
            if not ok:
                self._discard(key, "did not start")

    def _fail(self, key, world, since, what: str) -> None:
        import pytest
        world.close()  # a failed rank wrote its traceback before replying
        report = "\n".join(f"--- rank {r} (exit {p.returncode})\n{err[-3000:]}"
                           for r, (p, (_, err)) in enumerate(zip(world.procs, world.output(since))))
        self._discard(key, what)
        pytest.fail(what + "\n" + report)

    def run(self, n: int, body: str, timeout: float = 120, env: dict | None = None) -> list[Rank]:
        """Runs body on a pooled world of n ranks (started with env), under
        timeout; returns each rank's Rank (result as run_ranks's)."""
        key = (n, tuple(sorted((env or {}).items())))
        world = self._world(key)
        self.seq += 1
        seq, since, done = self.seq, world.offsets(), False
        try:
            world.send(("run", seq, textwrap.dedent(body)))
            replies = world.collect(timeout)
            if replies is None:
                world.close()
                self._fail(key, world, since, "job timed out after %.0f s" % timeout)
            if any(r is None or r[0] != "ok" for r in replies):
                # each failed rank's last line, the ranks that only lost a peer last
                said = [(k, r[1].strip().splitlines()[-1]) for k, r in enumerate(replies) if r and r[0] == "error"]
                said += [(k, "ended without a reply") for k, r in enumerate(replies) if r is None]
                said.sort(key=lambda ks: "PeerLostError" in ks[1])
                self._fail(key, world, since, "a rank failed: " + "; ".join(f"rank {k}: {s}" for k, s in said))
            output = world.output(since)
            out = [Rank(k, 0, output[k][0], output[k][1], pickle.loads(r[1]), world.pids[k])
                   for k, r in enumerate(replies)]
            why = sorted({w for r in replies for w in r[2]})
            if not why:
                world.send(("tidy", seq, None))
                tidied = world.collect(HEALTH_TIMEOUT)
                why = ["the health check timed out"] if tidied is None else sorted(
                    {w for r in tidied for w in (r[2] if r is not None else ["a rank ended while tidying"])})
            if why:
                self._discard(key, "; ".join(why))
            done = True
            return out
        finally:
            if not done and key in self.worlds:  # interrupted (pytest-timeout, Ctrl-C): never reuse it
                self._discard(key, "interrupted")

    def close(self) -> None:
        while self.worlds:
            self._discard(next(iter(self.worlds)), "the session ended")


if __name__ == "__main__":
    _serve()
