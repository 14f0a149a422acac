"""Autotuning (RINGREDUCE_AUTOTUNE=1): the ring's settings chosen for the
running world instead of the fixed numbers of ringreduce/core/config.py.

At init, once the ring is connected and before the first user collective
(collectives.init calls `tune_ring`):

  1. The world's shape is its key: ranks, ranks per host, backend, how
     many ring links go through shared memory, and a digest of what every
     rank runs on: its machine (CPU model, core count, architecture; not
     the hostname, so like machines share a cache), ringreduce.__version__
     and the build (a digest of the compiled extensions). One allgather, so
     every rank builds the same key; a cache copied to another kind of
     machine, or kept across an upgrade or a rebuild, is not reused.
  2. Rank 0 looks for $XDG_CACHE_HOME/ringreduce/autotune/<key>.json and
     broadcasts what it found. Only rank 0 reads, so ranks on hosts with
     different caches still agree; a file that does not parse, or holds a
     value outside the candidates, is logged and ignored.
  3. Nothing cached: a short calibration. Every probe is one allreduce
     fenced by a barrier; each rank times its own, and one allreduce(max)
     over all the timings gives every rank the same table (the slowest rank
     decides, as it does for a real step). The choice is a function of
     that table alone, and rank 0's is broadcast besides, so the ranks
     can never disagree (the small limit decides which path an allreduce
     takes). Rank 0 writes the cache atomically (temporary file, rename).
       segment: each candidate times a 1 MiB and an 8 MiB allreduce on the
                ring; the least sum of (time / best time at that size) wins.
       small:   for each candidate limit c, a tensor of c / (N-1) bytes is
                timed both ways (one-pass small algorithm, and the ring);
                the limit whose rule (small at or below it) costs least over
                all those sizes wins.
       hierarchy: where the world built the hierarchical allreduce under
                RINGREDUCE_HIERARCHICAL=auto (core/hierarchy.py), flat and
                hierarchical are timed at HIER_PROBES; it runs from the
                smallest probe where it wins by MARGIN at that and every
                larger one (else never), in place of the cost model's
                crossover (tune_hierarchy; its own cache file, beside).
       Either way the built-in default stays unless a candidate beats it
       by more than MARGIN (5%): here most of the spread is load noise.
       And a candidate that would replace it must do so again in fresh
       rounds of just the two (the least of several noisy scores is
       biased low), so a lucky round alone moves nothing.
  4. The choice is applied (Comm.set_segment, the ring's small limit, the
     world's Config, which process sets made later use) and logged.

A variable set explicitly (RINGREDUCE_SEGMENT_BYTES, RINGREDUCE_SMALL_BYTES,
RINGREDUCE_FUSION_THRESHOLD on rank 0) is kept, not tuned, and rank 0's
value holds on every rank. RINGREDUCE_SHM_BYTES is not tuned: the
shared-memory buffer is fixed when the links form, before any collective
can measure anything.

The engine's fusion threshold is tuned from the steps it runs
(`FusionTuner`, ringreduce/engine/scheduler.py): each candidate in turn holds for a
window of cycles, scored by bytes allreduced per second of wall time over
the window (the slowest rank's, agreed by an allreduce at the same cycle on
every rank); the best is kept and logged. The engine has no cycle time to
tune: it negotiates as soon as a request is ready.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import version as _version
from . import collectives as _c, traffic
from .communicator import current as _state

log = logging.getLogger("ringreduce")

SEGMENT_CANDIDATES = (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)
SMALL_CANDIDATES = (32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10)  # of Config.small_bytes: (N-1) * tensor
FUSION_CANDIDATES = (4 << 20, 16 << 20, 64 << 20, 128 << 20)
SEGMENT_PROBES = (1 << 20, 8 << 20)  # bytes of the allreduces that rank segment sizes
REPS = 4                             # timed rounds of every probe (after a warm-up); the fastest counts
FUSION_WINDOW = 10                   # working cycles each fusion candidate holds (the first is a warm-up)
CACHE_VERSION = 1
HIER_PROBES = (1 << 20, 4 << 20, 16 << 20)  # bytes at which flat and hierarchical allreduces are timed
NEVER = 1 << 62                      # a hierarchy threshold no tensor reaches
MARGIN = 0.05                        # a candidate must beat the default by this much to replace it


def enabled(env=None) -> bool:
    env = os.environ if env is None else env
    text = env.get("RINGREDUCE_AUTOTUNE", "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"RINGREDUCE_AUTOTUNE={text!r} makes no sense: use 0 or 1")
    return text == "1"


@dataclass(frozen=True)
class Choice:
    segment_bytes: int
    small_bytes: int
    calibrated: bool = False   # measured now (not read from the cache)
    seconds: float = 0.0       # the calibration's wall time


def shape_key(size: int, local_size: int, backend: str, shm_links: int, machines: str) -> str:
    """machines: world_digest() of every rank's fingerprint()."""
    return f"n{size}-per-host{local_size}-{backend}-shm{shm_links}-{machines}"


def this_machine() -> str:
    """What the timings depend on in the machine, the hostname left out:
    CPU model, core count, architecture."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor() or 'unknown CPU'}; {os.cpu_count()} cores; {platform.machine()}"


def this_build() -> str:
    """Digest of the package's compiled extensions (kernels, ring, transports):
    a rebuild of the same version recalibrates."""
    here = Path(__file__).parent.parent  # the package, where the extensions are built
    files = sorted({f for suffix in importlib.machinery.EXTENSION_SUFFIXES for f in here.glob("*" + suffix)})
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(machine: str, version: str, build: str) -> int:
    """One rank's machine, version and build as a non-negative int64 (for the allgather)."""
    raw = hashlib.sha256(f"{machine}\0{version}\0{build}".encode()).digest()
    return int.from_bytes(raw[:8], "little") >> 1


def world_digest(fingerprints) -> str:
    """Every rank's fingerprint, in rank order, as the key's last part."""
    return hashlib.sha256(np.asarray(fingerprints, np.int64).tobytes()).hexdigest()[:12]


def cache_dir(env=None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "ringreduce" / "autotune"


def load_cached(path: Path) -> Choice | None:
    """The cached choice, or None when there is none or it is not usable."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ringreduce autotune: ignoring unreadable cache %s (%s)", path, exc)
        return None
    try:
        if data["version"] != CACHE_VERSION:
            raise ValueError(f"version {data['version']!r}")
        seg, small = data["segment_bytes"], data["small_bytes"]
        if seg not in SEGMENT_CANDIDATES or small not in SMALL_CANDIDATES:
            raise ValueError("values outside the candidates")
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ringreduce autotune: ignoring cache %s (%s)", path, exc)
        return None
    return Choice(seg, small)


def store(path: Path, choice: Choice, key: str, about: dict | None = None) -> None:
    """Atomically: a reader sees the old file or the whole new one. about:
    what the key's digest stands for, for a reader of the file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "key": key, "segment_bytes": choice.segment_bytes,
                       "small_bytes": choice.small_bytes, "calibration_seconds": round(choice.seconds, 3),
                       "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(about or {})}, f)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not stop training
        log.warning("ringreduce autotune: could not write the cache %s (%s)", path, exc)


def _pick(scores, prefer: int | None) -> int:
    """The least score; but `prefer` (the built-in default) unless the least
    beats it by more than MARGIN: on a loaded machine most of the spread
    between candidates is noise, and a default measured with care should
    not give way to it."""
    best = int(np.argmin(scores))
    if prefer is not None and scores[prefer] <= scores[best] * (1 + MARGIN):
        return prefer
    return best


def segment_scores(times: np.ndarray) -> np.ndarray:
    """times[c, p]: candidate c on probe size p. Each candidate's mean time
    relative to the best at each size."""
    return (times / times.min(axis=0)).sum(axis=1) / times.shape[1]


def small_costs(small: np.ndarray, ring: np.ndarray) -> np.ndarray:
    """small[j], ring[j]: the two paths at the size of candidate j's limit
    (ascending). What each limit's rule (small at or below it) costs over
    all those sizes."""
    k = len(small)
    return np.array([sum(small[j] if j <= c else ring[j] for j in range(k)) for c in range(k)])


def best_segment(times: np.ndarray, prefer: int | None = None) -> int:
    """Index of the least segment_scores (prefer: see _pick)."""
    return _pick(segment_scores(times), prefer)


def best_small(small: np.ndarray, ring: np.ndarray, prefer: int | None = None) -> int:
    """Index of the least small_costs (prefer: see _pick)."""
    return _pick(small_costs(small, ring), prefer)


def still_beats(scores: np.ndarray, pick: int, default: int) -> bool:
    """On fresh timings: does pick still beat default by more than MARGIN?"""
    return _pick(scores[[pick, default]], prefer=1) == 0


def tune_ring(ring, world, backend: str, env=None):
    """Chooses, applies and logs the segment and small limit on the world's
    ring; returns the Config to keep (with the chosen values). Every rank
    must call it at the same point (it runs collectives)."""
    env = os.environ if env is None else env
    config = world.config
    machine, build, version = this_machine(), this_build(), _version.__version__  # read at each calibration
    mine = np.array([[world.extra.get("links", {}).get("next") == "shm", fingerprint(machine, version, build)]],
                    np.int64)
    every = _c.allgather(mine, name="ringreduce.autotune.key")
    key = shape_key(world.size, world.local_size, backend, int(every[:, 0].sum()), world_digest(every[:, 1]))
    path = cache_dir(env) / f"{key}.json"
    # rank 0 speaks for all: what it has cached, and which variables it has set by hand
    mine = np.zeros(6, np.int64)
    if world.rank == 0:
        cached = load_cached(path)
        fixed_seg = env.get("RINGREDUCE_SEGMENT_BYTES", "").strip() != ""
        fixed_small = env.get("RINGREDUCE_SMALL_BYTES", "").strip() != ""
        fixed_fusion = env.get("RINGREDUCE_FUSION_THRESHOLD", "").strip() != ""
        mine[:] = [cached is not None, cached.segment_bytes if cached else 0, cached.small_bytes if cached else 0,
                   config.segment_bytes if fixed_seg else 0, config.small_bytes if fixed_small else -1,
                   config.fusion_bytes if fixed_fusion else -1]
    agreed = _c.broadcast(mine, 0, name="ringreduce.autotune.cache")
    found, seg, small, fixed_seg, fixed_small, fixed_fusion = (int(v) for v in agreed)
    if found:
        choice = Choice(seg, small)
    else:
        choice = calibrate(ring, world.size, (fixed_seg,) if fixed_seg else SEGMENT_CANDIDATES,
                           (fixed_small,) if fixed_small >= 0 else SMALL_CANDIDATES, config.segment_bytes,
                           config.small_bytes)
        if world.rank == 0:
            store(path, choice, key, {"rank0_machine": machine, "ringreduce": version, "build": build})
    if fixed_seg:
        choice = dataclasses.replace(choice, segment_bytes=fixed_seg)
    if fixed_small >= 0:
        choice = dataclasses.replace(choice, small_bytes=fixed_small)
    config = dataclasses.replace(config, segment_bytes=choice.segment_bytes, small_bytes=choice.small_bytes)
    ring.comm.set_segment(choice.segment_bytes)
    ring.small_limit = config.small_limit(world.size, world.extra.get("arena", False))
    how = f"calibrated in {choice.seconds:.2f} s" if choice.calibrated else f"from the cache {path}"
    if world.rank == 0:
        log.warning("ringreduce autotune (%s): segment %d bytes, small limit %d bytes (%d per tensor), %s",
                    key, choice.segment_bytes, choice.small_bytes, ring.small_limit, how)
    hier = ring.hierarchy
    if hier is not None and hier.mode == "auto":
        hier.threshold, calibrated = tune_hierarchy(ring, path.with_name(f"{key}.hierarchy.json"))
        if world.rank == 0:
            log.warning("ringreduce autotune (%s): hierarchical allreduce from %s, %s", key,
                        "never" if hier.threshold >= NEVER else f"{hier.threshold} bytes",
                        "calibrated" if calibrated else "from the cache")
        world.extra["hierarchy"] = hier.describe()
    traffic.reset_stats()  # rr.stats() counts from init() on: the calibration's probes (MBs) are init's own
    world.extra["autotune"] = {"key": key, "segment_bytes": choice.segment_bytes,
                               "small_bytes": choice.small_bytes, "calibrated": choice.calibrated,
                               "seconds": choice.seconds,
                               # rank 0's RINGREDUCE_FUSION_THRESHOLD (None: the engine tunes it), for every rank
                               "fusion_bytes": fixed_fusion if fixed_fusion >= 0 else None}
    return config


def hierarchy_threshold(flat: np.ndarray, hier: np.ndarray, sizes=HIER_PROBES) -> int:
    """flat[i], hier[i]: the two schedules' times at sizes[i] (ascending).
    The smallest size from which the hierarchy beats the flat ring by more
    than MARGIN at that size and every larger one; NEVER if it does not at
    the largest."""
    threshold = NEVER
    for i in reversed(range(len(sizes))):
        if hier[i] * (1 + MARGIN) >= flat[i]:
            break
        threshold = sizes[i]
    return threshold


def tune_hierarchy(ring, path: Path) -> tuple[int, bool]:
    """The hierarchical allreduce's threshold on this world (RINGREDUCE_HIERARCHICAL=auto
    under RINGREDUCE_AUTOTUNE=1): rank 0's cached one, or timed now (each of
    HIER_PROBES both ways, round-robin, the fastest of REPS rounds, the
    slowest rank's: the same table everywhere) and cached by rank 0.
    Returns (threshold, calibrated)."""
    cached = np.array([-1], np.int64)
    if ring.rank == 0:
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CACHE_VERSION and data.get("threshold") in (*HIER_PROBES, NEVER):
                cached[0] = data["threshold"]
        except (OSError, ValueError, AttributeError):
            pass
    cached = int(_c.broadcast(cached, 0, name="ringreduce.autotune.hierarchy.cache")[0])
    if cached >= 0:
        return cached, False
    h, kept = ring.hierarchy, ring.hierarchy.threshold
    arrays = [np.ones(nbytes // 4, np.float32) for nbytes in HIER_PROBES]
    local = np.zeros((REPS, 2, len(HIER_PROBES)))
    try:
        for rep in range(REPS + 1):
            for i, x in enumerate(arrays):
                for way, threshold in enumerate((NEVER, 0)):
                    h.threshold = threshold
                    _c.barrier(name="ringreduce.autotune")
                    t0 = time.perf_counter()
                    _c.allreduce(x, name="ringreduce.autotune")
                    if rep:
                        local[rep - 1, way, i] = time.perf_counter() - t0
    finally:
        h.threshold = kept
    fastest = _c.allreduce(local, op="max", name="ringreduce.autotune.times").min(axis=0)
    picked = np.array([hierarchy_threshold(fastest[0], fastest[1])], np.int64)
    threshold = int(_c.broadcast(picked, 0, name="ringreduce.autotune.hierarchy")[0])
    if ring.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "threshold": threshold,
                           "flat_seconds": fastest[0].tolist(), "hierarchical_seconds": fastest[1].tolist(),
                           "sizes": list(HIER_PROBES)}, f)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("ringreduce autotune: could not write the cache %s (%s)", path, exc)
    return threshold, True


def time_probes(ring, probes, segment: int, arrays) -> np.ndarray:
    """The fastest of REPS timed rounds of every probe (segment, element
    count, small path?), the slowest rank's: the same table on every rank.
    The probes run round-robin, REPS + 1 rounds (the first a warm-up), so a
    burst of load from elsewhere slows every candidate alike instead of
    sinking the one it happens to meet."""
    limit = ring.small_limit
    local = np.zeros((REPS, len(probes)))
    try:
        for rep in range(REPS + 1):
            for k, (seg, count, small_path) in enumerate(probes):
                ring.comm.set_segment(seg)
                ring.small_limit = 1 << 62 if small_path else -1
                _c.barrier(name="ringreduce.autotune")
                t0 = time.perf_counter()
                _c.allreduce(arrays[count], name="ringreduce.autotune")
                if rep:
                    local[rep - 1, k] = time.perf_counter() - t0
    finally:
        ring.small_limit = limit
        ring.comm.set_segment(segment)
    return _c.allreduce(local, op="max", name="ringreduce.autotune.times").min(axis=0)


def calibrate(ring, size: int, segments, smalls, segment: int, small_bytes: int | None = None,
              recheck: bool = True) -> Choice:
    """Times the candidates on the ring (see the module's doc) and returns
    the choice every rank makes alike. segment: the ring's segment now (the
    small limit is timed with it, unless segments holds just one); it and
    small_bytes, where among the candidates, are kept unless beaten by
    MARGIN.

    recheck: a candidate that would replace the default must beat it by
    MARGIN again in fresh rounds of just the two (the least of several
    noisy scores is biased low: the winner of one round is partly its
    luck). It costs a few probes only when the default would change."""
    t_start = time.monotonic()
    small_segment = segments[0] if len(segments) == 1 else segment
    seg_probes, small_probes = [], []  # (segment, element count, small path?)
    if len(segments) > 1:
        seg_probes = [(s, nbytes // 4, False) for s in segments for nbytes in SEGMENT_PROBES]
    if len(smalls) > 1:
        small_probes = [(small_segment, max(1, c // max(size - 1, 1) // 4), path)
                        for c in smalls for path in (True, False)]
    probes = seg_probes + small_probes
    arrays = {count: np.ones(count, np.float32) for _, count, _ in probes}
    fastest = time_probes(ring, probes, segment, arrays)
    seg_times = fastest[:len(seg_probes)].reshape(len(segments), len(SEGMENT_PROBES)) if seg_probes else None
    pairs = fastest[len(seg_probes):].reshape(len(smalls), 2) if small_probes else None
    seg_default = segments.index(segment) if segment in segments else None
    small_default = smalls.index(small_bytes) if small_bytes in smalls else None
    seg_i = best_segment(seg_times, seg_default) if seg_probes else 0
    small_i = best_small(pairs[:, 0], pairs[:, 1], small_default) if small_probes else 0
    # fresh rounds for a change of default (every rank holds the same table, so runs the same ones)
    move_seg = recheck and seg_default is not None and seg_i != seg_default
    move_small = recheck and small_default is not None and small_i != small_default
    if move_seg or move_small:
        per = len(SEGMENT_PROBES)
        again = ([p for c in (seg_i, seg_default) for p in seg_probes[c * per:(c + 1) * per]] if move_seg else [])
        again += small_probes if move_small else []
        fresh = time_probes(ring, again, segment, arrays)
        if move_seg and not still_beats(segment_scores(fresh[:2 * per].reshape(2, per)), 0, 1):
            seg_i = seg_default
        if move_small:
            pairs = fresh[len(again) - len(small_probes):].reshape(len(smalls), 2)
            if not still_beats(small_costs(pairs[:, 0], pairs[:, 1]), small_i, small_default):
                small_i = small_default
    picked = np.array([segments[seg_i], smalls[small_i]], np.int64)
    seg, small = (int(v) for v in _c.broadcast(picked, 0, name="ringreduce.autotune.choice"))
    return Choice(seg, small, calibrated=True, seconds=time.monotonic() - t_start)


class FusionTuner:
    """Picks the engine's fusion threshold from the cycles it runs: each of
    FUSION_CANDIDATES holds for FUSION_WINDOW working cycles (cycles that
    run something: the same ones on every rank), scored by the bytes
    allreduced per second of wall time from the window's first cycle to
    the next window's; the slowest rank's seconds count. Then the best
    one stays.

    The engine calls on_cycle after negotiating and before running
    anything: the agreement's allreduce then runs while this cycle's
    requests are still pending, like the negotiation itself, never after
    their results are handed out (when a caller may be running collectives
    of its own)."""

    def __init__(self, candidates=FUSION_CANDIDATES, window: int = FUSION_WINDOW):
        self.candidates = tuple(candidates)
        self.window = window
        self.scores: list[float] = []
        self.chosen: int | None = None
        self._cycles = 0
        self._bytes = 0
        self._t0 = 0.0

    @property
    def current(self) -> int:
        return self.chosen if self.chosen is not None else self.candidates[len(self.scores)]

    def on_cycle(self, nbytes: int) -> int:
        """At the start of a working cycle that allreduces nbytes; returns the
        threshold for it. Ends a window with an allreduce (the engine's thread)."""
        if self.chosen is not None:
            return self.chosen
        if self._cycles == self.window:
                    # bytes too: a rank outside a process set's ring moved fewer; the max is the same everywhere
            seconds, moved = _c.allreduce(np.array([time.perf_counter() - self._t0, float(self._bytes)]),
                                          op="max", name="ringreduce.autotune.fusion")
            self.scores.append(moved / max(seconds, 1e-9))
            self._cycles = 0
            if len(self.scores) == len(self.candidates):
                self.chosen = self.candidates[int(np.argmax(self.scores))]
                if _state.require_world().rank == 0:
                    log.warning("ringreduce autotune: fusion threshold %d bytes (MB/s per candidate: %s)",
                                self.chosen, ", ".join(f"{c >> 20} MiB {s / 1e6:.0f}"
                                                       for c, s in zip(self.candidates, self.scores)))
                return self.chosen
        if self._cycles == 0:
            self._t0, self._bytes = time.perf_counter(), 0
        self._cycles += 1
        self._bytes += nbytes
        return self.current
