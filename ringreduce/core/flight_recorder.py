"""The flight recorder: each rank keeps its last K collectives, to say after
a hang or a failure who was where.

    rr.flight_recorder.set_step(step)     # optional: the training step, kept with each entry
    rr.flight_recorder.dump()             # flight_rank{R}.json now (also on SIGUSR1)

Every collective of core (allreduce, broadcast, allgather, reduce_scatter,
alltoall, barrier) is recorded by `recorded` around it: one small list
appended to a deque of K entries (RINGREDUCE_FLIGHT_RECORDER, default 2000; 0
turns the recorder off), no formatting and no I/O per call. An entry holds:
a number per (process set, kind), counted on this rank in the order its
collectives start (ranks that run the same collectives in the same order
give the same numbers: the engine's agreed order does), the name (the
engine's tensor name for what the engine ran, else the caller's name= or
None), kind, bytes, dtype, op, process set id, elastic generation, the
training step if set, enqueue / start / end times and the state: enqueued
(handed to the engine, not yet run), started, done or failed (with the
error's text).

A dump (JSON, one file per rank: flight_rank{R}.json) is written when an
exception leaves a collective (a timeout or a lost peer: PeerLostError; a
mismatch; a refused input; Ctrl-C), when the engine fails its waiting
requests, on SIGUSR1 (a handler installed at init() when the process has
none: one it has is chained, called after the dump) and on dump(). A rank
waiting inside a C collective dumps when the C call returns with the
timeout's exception; SIGUSR1 there runs the handler within ~100 ms (the
transport's interrupt hook runs Python's signal handlers on the main thread).
The directory: RINGREDUCE_FLIGHT_DIR, else RINGREDUCE_REPORT_DIR (ringrun's
per-job report directory), else <tempdir>/ringreduce-flight-<uid>.
ringrun reads the dumps of a failed job and prints one verdict
(ringreduce/launch/verdict.py).

The engine (ringreduce/engine/scheduler.py) records a request when it is
enqueued (`enqueued`) and runs it inside `running(entries)`: the core
collective that runs it then takes those entries (one number for a fused
bucket) instead of making its own.
"""
from __future__ import annotations

import collections
import functools
import inspect
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time

from .communicator import current as _state

DEFAULT_CAPACITY = 2000  # RINGREDUCE_FLIGHT_RECORDER's default (core/config.py checks the setting)
FORMAT = 1  # the dump's "format": readers refuse others

# An entry's fields, by position (a list: the cheapest record to make and to update in place).
(ID, SEQ, NAME, KIND, NBYTES, DTYPE, OP, PROCESS_SET, GENERATION, STEP, T_ENQUEUE, T_START, T_END, STATE,
 ERROR) = range(15)
ENQUEUED, STARTED, DONE, FAILED = "enqueued", "started", "done", "failed"

_entries: collections.deque = collections.deque(maxlen=DEFAULT_CAPACITY)
_capacity = DEFAULT_CAPACITY
_ids = iter(range(1, 1 << 62))  # next(_ids) is atomic under the GIL
_step = None
_counters: list = []  # each kind's {process set id: itertools.count}, cleared at init()
_dir: str | None = None  # RINGREDUCE_FLIGHT_DIR as read at init()
_mono = time.monotonic


class _Local(threading.local):
    adopt = None  # the engine's entries the next collective on this thread runs (running())


_local = _Local()


def configure(capacity: int, directory: str | None = None, restart_numbers: bool = False) -> None:
    """Sets K (0: off) and the dump directory; called by init() from Config,
    which also restarts the numbers (restart_numbers): every rank of a new
    world (an elastic generation's newcomers too) counts from 1 alike.
    Entries recorded so far are kept, up to the new K."""
    global _entries, _capacity, _dir
    if restart_numbers:
        for counters in _counters:
            counters.clear()
    if capacity != _capacity:
        _entries = collections.deque(_entries if capacity else (), maxlen=max(capacity, 1))
        _capacity = capacity
    _dir = directory or None


def capacity() -> int:
    """K: how many collectives each rank keeps (0: the recorder is off)."""
    return _capacity


def set_step(step) -> None:
    """The training step (an int, or None) recorded with every later entry,
    so a dump says at which step each collective ran. Cheap: one assignment."""
    global _step
    _step = step


def step():
    return _step


def recorded(kind: str):
    """Decorates core's collective `kind`: each call gets an entry (or takes
    the engine's, running()); an exception leaving it marks the entry failed
    and dumps. A collective calling another calls the undecorated one
    (`.__wrapped__`), so it is recorded once.
    The wrapper is made with the collective's own signature (source built
    from inspect.signature), so it reads x, op, name and process_set as
    plain locals: no argument parsing per call."""
    def wrap(fn):
        sig = inspect.signature(fn)
        params = sig.parameters
        defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        text = ", ".join(f"{n}=_d_{n}" if n in defaults else n for n in params)
        passed = ", ".join(n for n in params)
        source = _TEMPLATE.format(
            params=text, passed=passed, x="x" if "x" in params else "None",
            op="op" if "op" in params else '""', name="name" if "name" in params else "None",
            ps="process_set" if "process_set" in params else "None", SEQ=SEQ, T_START=T_START, T_END=T_END,
            STATE=STATE)
        scope = {f"_d_{n}": v for n, v in defaults.items()}
        by_set: dict = {}  # process set id -> the numbers of this kind on it
        _counters.append(by_set)
        scope.update(_fn=fn, _kind=kind, _by_set=by_set, _local=_local, _mono=_mono,
                     _module=sys.modules[__name__], _state=_state, _ids=_ids, _next=next, _count=itertools.count,
                     _getattr=getattr, _fail=fail, STARTED=STARTED, DONE=DONE, _BaseException=BaseException)
        exec(compile(source, f"<flight recorder around {fn.__name__}>", "exec"), scope)  # noqa: S102
        return functools.wraps(fn)(scope["call"])
    return wrap


_TEMPLATE = """
def call({params}):
    if not _module._capacity:
        return _fn({passed})
    ps = {ps}
    ps = 0 if ps is None else _getattr(ps, "process_set_id", -1)
    counter = _by_set.get(ps)
    if counter is None:
        counter = _by_set.setdefault(ps, _count(1))
    adopted = _local.adopt
    if adopted is None:  # a direct call: an entry of its own
        x = {x}
        # the fields in the order of ID, SEQ, NAME, KIND, ... above
        e = [_next(_ids), _next(counter), {name}, _kind, _getattr(x, "nbytes", None), _getattr(x, "dtype", None),
             {op}, ps, _state.generation, _module._step, None, _mono(), None, STARTED, None]
        _module._entries.append(e)
        try:
            result = _fn({passed})
        except _BaseException as exc:
            _fail((e,), exc)
            raise
        e[{T_END}] = _mono()
        e[{STATE}] = DONE
        return result
    # the engine's requests: this collective runs them
    _local.adopt = None
    seq, now = _next(counter), _mono()
    for e in adopted:
        e[{SEQ}], e[{T_START}], e[{STATE}] = seq, now, STARTED
    try:
        result = _fn({passed})
    except _BaseException as exc:
        _fail(adopted, exc)
        raise
    now = _mono()
    for e in adopted:
        if e[{STATE}] is STARTED:
            e[{T_END}] = now
            e[{STATE}] = DONE
    return result
"""


def enqueued(kind: str, name, nbytes, dtype, op, process_set: int):
    """The engine's record of a request handed to it: state enqueued, no
    number yet (running() gives it the number of the collective that runs
    it). None when the recorder is off."""
    if not _capacity:
        return None
    e = [next(_ids), None, name, kind, nbytes, dtype, op, process_set, _state.generation, _step, _mono(), None,
         None, ENQUEUED, None]
    _entries.append(e)
    return e


class running:
    """with running(entries): the next collective of core on this thread
    runs these engine requests (a fused bucket: one collective, one number
    for all); entries not done by the end are marked done, or failed with
    the exception that ended the block. entries may hold None (recorder off)."""
    __slots__ = ("entries",)

    def __init__(self, entries):
        self.entries = [e for e in entries if e is not None]

    def __enter__(self):
        _local.adopt = self.entries or None
        return self

    def __exit__(self, kind, exc, tb):
        _local.adopt = None
        if exc is not None:
            fail(self.entries, exc)
            return False
        now = _mono()
        for e in self.entries:
            if e[STATE] is not FAILED and e[STATE] is not DONE:
                e[T_START] = e[T_START] if e[T_START] is not None else now
                e[T_END], e[STATE] = now, DONE
        return False


_last_dumped = (None, 0.0)  # (id of the exception last dumped for, when)


def fail(entries, exc: BaseException, dump_now: bool = True) -> None:
    """Marks entries (None in it: ignored) failed with exc, and dumps once per
    exception (the engine fails many requests with one)."""
    global _last_dumped
    now = _mono()
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # an exception whose str() fails: its type says enough
        text = type(exc).__name__
    for e in entries:
        if e is not None and e[STATE] is not DONE and e[STATE] is not FAILED:
            e[T_END], e[STATE], e[ERROR] = now, FAILED, text
    if not dump_now or not _capacity or isinstance(exc, (SystemExit, GeneratorExit)) or _state.comm is None:
        return  # (not initialized: nothing ran, nothing to say)
    if _last_dumped[0] == id(exc) and now - _last_dumped[1] < 5.0:
        return
    _last_dumped = (id(exc), now)
    dump(reason=text)


# -- dumps -------------------------------------------------------------------

def directory() -> str:
    """Where dumps go: RINGREDUCE_FLIGHT_DIR, else RINGREDUCE_REPORT_DIR (ringrun's
    report directory), else <tempdir>/ringreduce-flight-<uid>."""
    return (_dir or os.environ.get("RINGREDUCE_FLIGHT_DIR") or os.environ.get("RINGREDUCE_REPORT_DIR")
            or os.path.join(tempfile.gettempdir(), f"ringreduce-flight-{os.getuid()}"))


def _my_rank():
    world = _state.world
    if world is not None:
        return world.rank, world.size
    try:
        return int(os.environ["RINGREDUCE_RANK"]), int(os.environ.get("RINGREDUCE_SIZE", "0")) or None
    except (KeyError, ValueError):
        return None, None


def file_name(rank) -> str:
    return f"flight_rank{rank}.json" if rank is not None else f"flight_pid{os.getpid()}.json"


def snapshot(reason: str = "requested") -> dict:
    """This rank's record as the dump holds it (JSON-ready)."""
    mono, wall = _mono(), time.time()
    rank, size = _my_rank()

    def wall_of(t):
        return None if t is None else round(t - mono + wall, 6)

    entries = []
    for e in list(_entries):  # a copy: other threads append meanwhile
        dtype = e[DTYPE]
        entries.append({
            "id": e[ID], "seq": e[SEQ], "name": _text(e[NAME]), "kind": e[KIND], "bytes": _number(e[NBYTES]),
            "dtype": None if dtype is None else str(dtype), "op": _text(e[OP]), "process_set": e[PROCESS_SET],
            "generation": e[GENERATION], "step": e[STEP], "state": e[STATE], "error": e[ERROR],
            "t_enqueue": e[T_ENQUEUE], "t_start": e[T_START], "t_end": e[T_END],
            "wall_enqueue": wall_of(e[T_ENQUEUE]), "wall_start": wall_of(e[T_START]), "wall_end": wall_of(e[T_END]),
        })
    sets = {}
    for set_id, ring in list(_state.sets.items()):
        sets[str(set_id)] = list(ring.ranks)
    return {"format": FORMAT, "rank": rank, "size": size, "pid": os.getpid(), "host": os.uname().nodename,
            "generation": _state.generation, "reason": reason, "step": _step, "capacity": _capacity,
            "monotonic": mono, "wall": wall, "process_sets": sets, "entries": entries}


def _text(value):
    """What the caller passed as a name or op, as JSON holds it (bad input is recorded too)."""
    return value if value is None or isinstance(value, str) else repr(value)


def _number(value):
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def dump(path: str | None = None, reason: str = "requested") -> str | None:
    """Writes this rank's record (JSON) to path (default: directory()/flight_rank{R}.json),
    whole or not at all (a temporary file renamed), and returns the path;
    None when it could not be written (said on stderr) or the recorder is off."""
    if not _capacity:
        return None
    try:
        data = snapshot(reason)
        if path is None:
            path = os.path.join(directory(), file_name(data["rank"]))
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".flight-", suffix=".tmp", dir=os.path.dirname(path) or ".")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception as exc:  # a dump runs on error paths and in a signal handler: it never raises
        _say(f"could not write the flight recorder to {path or directory()}: {type(exc).__name__}: {exc}")
        return None
    _say(f"flight recorder of rank {data['rank']} written to {path} ({(reason.splitlines() or [''])[0][:200]})")
    return path


def _say(message: str) -> None:
    try:
        print(f"ringreduce: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


# -- SIGUSR1 -----------------------------------------------------------------

_installed = None  # our handler, once installed


def install_signal_handler() -> bool:
    """SIGUSR1 dumps: installed when the process has no handler of its own
    (SIG_DFL); a Python handler it has is chained (called after the dump);
    an ignored SIGUSR1 stays ignored. Only from the main thread (Python's
    rule). Returns whether SIGUSR1 now dumps."""
    global _installed
    if not _capacity or threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGUSR1)
    if _installed is not None and current is _installed:
        return True
    if current is signal.SIG_IGN or current is None:
        return False
    previous = current if callable(current) else None

    def on_sigusr1(signum, frame):
        dump(reason="SIGUSR1")
        if previous is not None:
            previous(signum, frame)

    signal.signal(signal.SIGUSR1, on_sigusr1)
    _installed = on_sigusr1
    return True


def marker_name(rank) -> str:
    """The file a rank leaves in ringrun's report directory at init when
    SIGUSR1 dumps: its pid, so ringrun can ask a rank that is still running
    after a failed job for its record."""
    return f"flight_rank{rank}.pid"


def announce(report_dir: str | None, rank: int) -> None:
    """Leaves marker_name(rank) (this pid) in report_dir."""
    if not report_dir:
        return
    try:
        with open(os.path.join(report_dir, marker_name(rank)), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        pass
