"""Every tunable read from the environment, once, in one place, and checked:
a setting that makes no sense is refused at init() with the variable named,
never discovered later as a strange failure."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from ..errors import RingReduceError

# Largest blob of the header pass (csrc/schedule/ring.c MAX_BLOB is 64 MiB): the small
# path sends header + tensor in one blob, so its limit stays well below.
MAX_SMALL_BYTES = 32 << 20
MAX_SEGMENT_BYTES = 64 << 20
# init's deadlines are socket timeouts, which overflow long before inf: a
# week stands for "wait as long as it takes" (inf died of an OverflowError
# on one rank while rank 0 waited for it forever)
MAX_START_TIMEOUT = 7 * 24 * 3600
MAX_SHM_BYTES = 1 << 30  # what a taker accepts (ringreduce/core/shm.py)
MAX_ARENA_BYTES = 16 << 20  # per rank, twice over (csrc/schedule/host_arena.h)
ARENA_HEADER_ROOM = 4096  # an arena slot holds arena_bytes of data plus the operation's header
BACKENDS = ("", "socket", "mpi")
SMALL_ALGORITHMS = ("", "doubling", "ring")
ARENA_REDUCES = ("auto", "direct", "split", "copy")  # csrc/schedule/host_arena.h rr_arena_mode
SHM_CMA_MODES = ("auto", "0", "1", "refused")  # csrc/schedule/cma.h
HIERARCHICAL_MODES = ("auto", "on", "off")  # ringreduce/core/hierarchy.py
MAX_CACHE_CAPACITY = 1 << 20  # a ready vector of this many bits is 128 KiB a cycle
MAX_PORT = 65535
MAX_FLIGHT_RECORDER = 10_000_000  # entries of ringreduce/core/flight_recorder.py (~ 200 bytes each)


@dataclass(frozen=True)
class Config:
    timeout: float = 60.0           # RINGREDUCE_TIMEOUT: seconds a peer may stay silent; 0 or inf:
                                    # never time out a silent peer (a dead one is still seen at once)
    start_timeout: float = 120.0    # RINGREDUCE_START_TIMEOUT: seconds to wait for every rank at init
    segment_bytes: int = 256 << 10  # RINGREDUCE_SEGMENT_BYTES: pipeline segment of the ring
    small_bytes: int = 128 << 10    # RINGREDUCE_SMALL_BYTES: data rides with the header while
                                    # (N-1) * tensor bytes stays within this
    spin: int = 100                 # RINGREDUCE_SPIN: yields before sleeping in poll
    backend: str = ""               # RINGREDUCE_BACKEND: "socket" or "mpi"; empty: choose
    shm_bytes: int = 1 << 20        # RINGREDUCE_SHM_BYTES: buffer of a shared-memory link between
                                    # neighbours on one host (socket backend); 0: sockets only
    arena_bytes: int = 256 << 10    # RINGREDUCE_ARENA_BYTES: largest tensor of the host arena, the small
                                    # path when all ranks share one host (either backend); 0: none
    arena_reduce: str = "auto"      # RINGREDUCE_ARENA_REDUCE: how the host arena reduces: "auto" (by size
                                    # and N, csrc/schedule/host_arena.c's cost model), "direct" (each rank folds all
                                    # N), "split" (each its 1/N, then a second round), "copy" (the first
                                    # version); the same bits every way
    shm_zerocopy: bool = True       # RINGREDUCE_SHM_ZEROCOPY: 1 (default): where both of a rank's links
                                    # are shared memory, the ring reduces straight in the mappings;
                                    # 0: through its own staging buffer, copied to and from them
    shm_cma: str = "auto"           # RINGREDUCE_SHM_CMA: "1": with zero copy on, a rank reads its
                                    # previous neighbour's chunks straight out of that process's buffers
                                    # (process_vm_readv) from 1 MiB a chunk, where every rank's probe at init
                                    # passes (else zero copy through the mappings); "auto" (default): so in
                                    # rings of two ranks only (where it measured faster); "0": not;
                                    # "refused": as "1" with this rank's probe failing (tests of the fallback)
    fusion_bytes: int = 64 << 20    # RINGREDUCE_FUSION_THRESHOLD: largest fused buffer of the engine
    cache_capacity: int = 1024      # RINGREDUCE_CACHE_CAPACITY: requests the engine's response cache
                                    # holds (ringreduce/engine/response_cache.py); 0: no cache
    small_algorithm: str = ""       # RINGREDUCE_SMALL_ALGORITHM: over MPI, "doubling" (the default:
                                    # recursive doubling) or "ring" (the ring's passes); alike on every rank
    metrics_port: int | None = None  # RINGREDUCE_METRICS_PORT: each rank serves Prometheus metrics on this
                                    # port + its local rank (0: a free port each, logged); unset: none
                                    # (ringreduce/metrics/, docs/metrics.md)
    metrics_addr: str = "127.0.0.1"  # RINGREDUCE_METRICS_ADDR: the address the metrics server binds
    straggler_window: int = 100     # RINGREDUCE_STRAGGLER_WINDOW: engine cycles the straggler report
                                    # covers (ringreduce/engine/stragglers.py)
    straggler_threshold: str = "0.5"  # RINGREDUCE_STRAGGLER_THRESHOLD: when rank 0 warns of a straggler:
                                    # a score in (0, 1) it falls below, a median lateness ("0.2s",
                                    # "150ms") it exceeds, or "off" (straggler_threshold())
    flight_recorder: int = 2000     # RINGREDUCE_FLIGHT_RECORDER: collectives each rank keeps for a dump
                                    # (ringreduce/core/flight_recorder.py); 0: the recorder is off
    flight_dir: str = ""            # RINGREDUCE_FLIGHT_DIR: where dumps go; empty: RINGREDUCE_REPORT_DIR
                                    # (ringrun's report directory), else <tempdir>/ringreduce-flight-<uid>
    hierarchical: str = "auto"      # RINGREDUCE_HIERARCHICAL: "auto" (default): the hierarchical allreduce
                                    # (ringreduce/core/hierarchy.py) from the cost model's crossover, where
                                    # the world spans hosts with two or more ranks each; "on": for every
                                    # allreduce on the ring path there; "off": the flat ring; alike on every rank
    cuda_ipc: bool = True           # RINGREDUCE_CUDA_IPC: 1 (default): collectives of GPU arrays go device to
                                    # device through CUDA IPC where every rank's GPU can open every other's
                                    # memory (ringreduce/core/device_ipc.py); 0: this rank refuses, and every
                                    # rank takes the staged path (the host ring on a pinned mirror)

    def __post_init__(self):
        _check("RINGREDUCE_TIMEOUT", self.timeout, self.timeout >= 0, "0 (never time out), a number of seconds, or inf")
        _check("RINGREDUCE_START_TIMEOUT", self.start_timeout, 0 < self.start_timeout <= MAX_START_TIMEOUT,
               f"a number of seconds > 0, at most {MAX_START_TIMEOUT} (a week)")
        _check("RINGREDUCE_SEGMENT_BYTES", self.segment_bytes, 0 < self.segment_bytes <= MAX_SEGMENT_BYTES,
               f"1 .. {MAX_SEGMENT_BYTES} bytes")
        _check("RINGREDUCE_SMALL_BYTES", self.small_bytes, 0 <= self.small_bytes <= MAX_SMALL_BYTES,
               f"0 (always the ring) .. {MAX_SMALL_BYTES} bytes")
        _check("RINGREDUCE_SPIN", self.spin, 0 <= self.spin <= 1_000_000, "0 .. 1000000 yields")
        _check("RINGREDUCE_BACKEND", self.backend, self.backend in BACKENDS, "'socket', 'mpi' or empty")
        _check("RINGREDUCE_SHM_BYTES", self.shm_bytes, 0 <= self.shm_bytes <= MAX_SHM_BYTES,
               f"0 (sockets only) .. {MAX_SHM_BYTES} bytes")
        _check("RINGREDUCE_ARENA_BYTES", self.arena_bytes, 0 <= self.arena_bytes <= MAX_ARENA_BYTES,
               f"0 (no host arena) .. {MAX_ARENA_BYTES} bytes")
        _check("RINGREDUCE_ARENA_REDUCE", self.arena_reduce, self.arena_reduce in ARENA_REDUCES,
               "'auto', 'direct', 'split' or 'copy'")
        _check("RINGREDUCE_SHM_ZEROCOPY", self.shm_zerocopy, isinstance(self.shm_zerocopy, bool), "0 or 1")
        _check("RINGREDUCE_SHM_CMA", self.shm_cma, self.shm_cma in SHM_CMA_MODES, "auto, 0, 1 or refused")
        _check("RINGREDUCE_FUSION_THRESHOLD", self.fusion_bytes, self.fusion_bytes >= 0, "bytes >= 0")
        _check("RINGREDUCE_SMALL_ALGORITHM", self.small_algorithm, self.small_algorithm in SMALL_ALGORITHMS,
               "'doubling', 'ring' or empty")
        _check("RINGREDUCE_CACHE_CAPACITY", self.cache_capacity, 0 <= self.cache_capacity <= MAX_CACHE_CAPACITY,
               f"0 (no cache) .. {MAX_CACHE_CAPACITY} requests")
        _check("RINGREDUCE_METRICS_PORT", self.metrics_port,
               self.metrics_port is None or 0 <= self.metrics_port <= MAX_PORT, f"0 (a free port) .. {MAX_PORT}")
        _check("RINGREDUCE_METRICS_ADDR", self.metrics_addr, bool(self.metrics_addr.strip()),
               "an address to bind, such as 127.0.0.1 or 0.0.0.0")
        _check("RINGREDUCE_STRAGGLER_WINDOW", self.straggler_window, self.straggler_window >= 2,
               "a whole number of engine cycles, at least 2")
        straggler_threshold(self.straggler_threshold)
        _check("RINGREDUCE_FLIGHT_RECORDER", self.flight_recorder,
               0 <= self.flight_recorder <= MAX_FLIGHT_RECORDER, f"0 (off) .. {MAX_FLIGHT_RECORDER} collectives")
        _check("RINGREDUCE_HIERARCHICAL", self.hierarchical, self.hierarchical in HIERARCHICAL_MODES,
               "auto, on or off")
        _check("RINGREDUCE_CUDA_IPC", self.cuda_ipc, isinstance(self.cuda_ipc, bool), "0 or 1")

    @property
    def ring_timeout(self) -> float:
        """The timeout the C transport gets: 0 means never, which it spells inf."""
        return math.inf if self.timeout == 0 else self.timeout

    def small_limit(self, size: int, arena: bool = False) -> int:
        """Largest tensor (bytes) for the one-pass small algorithm on `size`
        ranks: it sends (N-1) times the tensor, the ring 2(N-1)/N times plus
        3(N-1) latencies; measured crossover ~128 KiB at N=2, ~48 KiB at N=4.
        Through the host arena (`arena`) each rank writes its tensor once and
        reads N: it beats the ring up to arena_bytes (docs/performance.md)."""
        ring_pass = self.small_bytes // max(size - 1, 1)
        return max(ring_pass, self.arena_bytes) if arena and self.small_bytes > 0 else ring_pass

    @property
    def arena_slot(self) -> int:
        """Bytes of a rank's host-arena slot: arena_bytes of data plus the
        operation's header; 0: this rank wants no arena."""
        return self.arena_bytes + ARENA_HEADER_ROOM if self.arena_bytes else 0

    @classmethod
    def from_env(cls, env=None) -> "Config":
        env = os.environ if env is None else env
        d = cls()

        def get(name, default, kind):
            text = env.get(name, "").strip()
            if text == "":
                return default
            try:
                return kind(text)
            except ValueError:
                what = {float: "a number", int: "an integer", _switch: "0 or 1"}.get(kind, kind.__name__)
                raise ValueError(f"{name}={text!r} is not {what}") from None

        return cls(
            timeout=get("RINGREDUCE_TIMEOUT", d.timeout, float),
            start_timeout=get("RINGREDUCE_START_TIMEOUT", d.start_timeout, float),
            segment_bytes=get("RINGREDUCE_SEGMENT_BYTES", d.segment_bytes, int),
            small_bytes=get("RINGREDUCE_SMALL_BYTES", d.small_bytes, int),
            spin=get("RINGREDUCE_SPIN", d.spin, int),
            backend=get("RINGREDUCE_BACKEND", d.backend, str),
            shm_bytes=get("RINGREDUCE_SHM_BYTES", d.shm_bytes, int),
            arena_bytes=get("RINGREDUCE_ARENA_BYTES", d.arena_bytes, int),
            arena_reduce=get("RINGREDUCE_ARENA_REDUCE", d.arena_reduce, str),
            shm_zerocopy=get("RINGREDUCE_SHM_ZEROCOPY", d.shm_zerocopy, _switch),
            shm_cma=get("RINGREDUCE_SHM_CMA", d.shm_cma, str),
            fusion_bytes=get("RINGREDUCE_FUSION_THRESHOLD", d.fusion_bytes, int),
            cache_capacity=get("RINGREDUCE_CACHE_CAPACITY", d.cache_capacity, int),
            small_algorithm=get("RINGREDUCE_SMALL_ALGORITHM", d.small_algorithm, str),
            metrics_port=get("RINGREDUCE_METRICS_PORT", d.metrics_port, int),
            metrics_addr=get("RINGREDUCE_METRICS_ADDR", d.metrics_addr, str),
            straggler_window=get("RINGREDUCE_STRAGGLER_WINDOW", d.straggler_window, int),
            straggler_threshold=get("RINGREDUCE_STRAGGLER_THRESHOLD", d.straggler_threshold, str),
            flight_recorder=get("RINGREDUCE_FLIGHT_RECORDER", d.flight_recorder, int),
            flight_dir=get("RINGREDUCE_FLIGHT_DIR", d.flight_dir, str),
            hierarchical=get("RINGREDUCE_HIERARCHICAL", d.hierarchical, str),
            cuda_ipc=get("RINGREDUCE_CUDA_IPC", d.cuda_ipc, _switch),
        )


# Every RINGREDUCE_* name read anywhere (launcher, world, engine, TF layer, build): any other is a typo.
KNOWN_NAMES = frozenset({
    "RINGREDUCE_TIMEOUT", "RINGREDUCE_START_TIMEOUT", "RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_SMALL_BYTES",
    "RINGREDUCE_SPIN", "RINGREDUCE_BACKEND", "RINGREDUCE_SHM_BYTES", "RINGREDUCE_FUSION_THRESHOLD",
    "RINGREDUCE_CACHE_CAPACITY", "RINGREDUCE_AUTOTUNE", "RINGREDUCE_SMALL_ALGORITHM", "RINGREDUCE_ARENA_BYTES",
    "RINGREDUCE_SHM_ZEROCOPY", "RINGREDUCE_ARENA_REDUCE", "RINGREDUCE_SHM_CMA",
    "RINGREDUCE_RANK", "RINGREDUCE_SIZE", "RINGREDUCE_ADDR", "RINGREDUCE_SECRET", "RINGREDUCE_LOCAL_RANK",
    "RINGREDUCE_LOCAL_SIZE", "RINGREDUCE_PORT", "RINGREDUCE_HOST", "RINGREDUCE_ELASTIC_ADDR", "RINGREDUCE_WORKER_ID",
    "RINGREDUCE_METRICS_PORT", "RINGREDUCE_METRICS_ADDR", "RINGREDUCE_JOB",
    "RINGREDUCE_TIMELINE", "RINGREDUCE_OVERLAP", "RINGREDUCE_TF_OPS_DIR", "RINGREDUCE_CUDA", "RINGREDUCE_CUDA_ARCHS",
    "RINGREDUCE_STRAGGLER_WINDOW", "RINGREDUCE_STRAGGLER_THRESHOLD", "RINGREDUCE_REPORT_DIR",
    "RINGREDUCE_FLIGHT_RECORDER", "RINGREDUCE_FLIGHT_DIR",
    "RINGREDUCE_HIERARCHICAL", "RINGREDUCE_HOST_ID", "RINGREDUCE_SLURM_TASK", "RINGREDUCE_CUDA_IPC",
})


def env_int(env, *names) -> int | None:
    """The first of the variables `names` set (non-empty) in env, as an int;
    None when none is set. A value that is no integer raises RingReduceError
    naming the variable (a launcher's world variables: SLURM_*, RANK, ...)."""
    for name in names:
        value = env.get(name, "")
        if value != "":
            try:
                return int(value)
            except ValueError:
                raise RingReduceError(f"{name}={value!r} is not an integer") from None
    return None


def warn_unknown(env=None) -> None:
    """Warns of each RINGREDUCE_* variable no part of ringreduce reads, naming
    the one probably meant: a misspelt setting otherwise does nothing, silently."""
    import difflib
    import warnings
    env = os.environ if env is None else env
    for name in sorted(n for n in env if n.startswith("RINGREDUCE_") and n not in KNOWN_NAMES):
        close = difflib.get_close_matches(name, KNOWN_NAMES, n=1)
        warnings.warn(f"{name} is not a ringreduce setting and is ignored"
                      + (f"; did you mean {close[0]}?" if close else " (docs/api.md lists them)"), stacklevel=3)


_DURATION = re.compile(r"^([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(ms|s)$")


def straggler_threshold(text: str) -> tuple | None:
    """RINGREDUCE_STRAGGLER_THRESHOLD's meaning: ("score", x) for a number
    in (0, 1), ("seconds", s) for a duration > 0 in s or ms, None for
    "off"; ValueError naming the variable for anything else."""
    value = text.strip().lower()
    if value == "off":
        return None
    match = _DURATION.match(value)
    if match:
        seconds = float(match.group(1)) * (1e-3 if match.group(2) == "ms" else 1.0)
        if math.isfinite(seconds) and seconds > 0:
            return "seconds", seconds
    else:
        try:
            score = float(value)
        except ValueError:
            score = math.nan
        if 0 < score < 1:
            return "score", score
    raise ValueError(f"RINGREDUCE_STRAGGLER_THRESHOLD={text!r} makes no sense: use a score between 0 and 1 (warn "
                     "when a rank's score falls below it, e.g. 0.5), a median lateness in seconds (e.g. 0.2s or "
                     "150ms), or off")


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name}={value!r} makes no sense: use {allowed}")
