"""The collectives over numpy (and cupy) arrays: allreduce, reduce_scatter,
allgather, broadcast, alltoall, barrier. Each checks its input on this rank
(refused on every rank when bad: refuse()), agrees on a header with the
others (protocol.py), then runs the small path (the data rode in the header
pass) or the C ring (ringreduce._core)."""
from __future__ import annotations

import contextlib
import math
import threading

import numpy as np

from .. import _core
from ..errors import RingReduceError
from . import cuda, device_ipc
from .arrays import (DTYPES, OPS, HostArrays, arrays_for, as_bytes, as_raw, check_name, chunk_bounds, deliver,
                     dtype_code, native, op_code, read_splits)
from .flight_recorder import recorded
from .listeners import collective as _reported  # each call's time and error, to the listeners
from .communicator import MAX_PLANS, Plan, Ring, communicator, current as _state  # noqa: F401  (Ring: callers)
from .hierarchy import run_allreduce
from .process_sets import lookup, ring_of
from .protocol import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, CLOSING_NAME, KIND_NAMES, REDUCE_SCATTER,
                       REFUSED_PREFIX, agree, all_device, all_inline, any_device, exchange, header, marks, parse,
                       payloads, voided)


def refuse(kind: int, problem: Exception, process_set=None) -> None:
    """This rank refuses its own bad input (a TypeError or ValueError found
    before any data moves), but still meets the others' collective, under a
    name saying why: they raise MismatchError naming this rank, instead of
    pairing their collective with this rank's next one (silently wrong data)
    or waiting for it (a hang). The caller then raises its own error."""
    try:
        ring = lookup(process_set)
        with ring.lock:
            why = f"{REFUSED_PREFIX} {problem}"[:400].encode(errors="replace").decode()  # sendable whatever it holds
            head = header(kind, 0, 0, (), why)
            blobs = ring.comm.exchange_blobs(head, b"")
            while voided(blobs, ring):  # joined members stepped aside for their engines: again, with those
                blobs = ring.comm.exchange_blobs(head, b"")
            agree(blobs, head, (), KIND_NAMES[kind], ring)
    except (RingReduceError, TypeError, ValueError):
        pass  # not initialized, or the others refused too, or a peer is lost: this rank's own error says most


# Averaged as running means, never as sums that could overflow (csrc/kernels/reduce_math.h).
_MEAN_CODES = (_core.FLOAT16, _core.BFLOAT16)


def _reduce_blobs(payloads, dtype, code, opc, shape):
    """Every rank reduces the same payloads in rank order: the same bits everywhere."""
    acc = np.frombuffer(payloads[0], dtype=dtype).copy()
    flat = as_raw(acc)
    mean = opc == _core.AVG and code in _MEAN_CODES
    for k, p in enumerate(payloads[1:], start=2):
        if mean:
            _core.mean_fold(flat, p, code, k)
        else:
            _core.reduce(flat, p, code, opc)
    if opc == _core.AVG and not mean:
        _core.divide(flat, code, len(payloads))
    return acc.reshape(shape)


@recorded("allreduce")
@_reported("allreduce")
def allreduce(x, op: str = "sum", out=None, name: str | None = None, process_set=None, weight=None):
    """Reduces x over all ranks (of process_set); returns a new array, or writes `out` (may be x) and returns it.
    weight (with op="avg"): the weighted mean sum_r(w_r x_r) / sum_r(w_r), see allreduce_weighted."""
    if weight is not None:
        return allreduce_weighted(x, weight, op, out, name, process_set)
    # The fast path: small allreduces are all latency (a 4 KiB one takes ~4 us
    # in C), so a call whose shape, dtype, op and name this ring has already
    # seen take the small path reuses that call's plan (ring.plans) and makes
    # one C call, without the checks below. Buffers the C call cannot use as
    # given, or input never planned, take the checked path, which refuses bad
    # input.
    if type(x) is np.ndarray:
        dtype = x.dtype
        try:
            ring = _state.ring if process_set is None else ring_of(process_set)
            plan = ring.plans.get((x.shape, dtype, op, name, marks.engine))  # the engine's headers are marked
        except Exception:  # not initialized, a bad process set or an unhashable op: the checked path says so
            plan = None
        if plan is not None and plan.rounds == ring.comm.small_rounds:
            # out's shape is compared in C (a Python tuple each costs more than the compare)
            dst = np.empty(plan.shape, dtype) if out is None else \
                out if type(out) is np.ndarray and out.dtype is dtype else None
            if dst is not None:
                # The ring's lock still: another thread's collective may be between its C calls
                # (a header pass, then the ring), and ours must not run in there.
                with ring.lock:
                    # another thread may have run shutdown() and init() since ring was read: then the checked path
                    blobs = ring.comm.try_allreduce_small(plan.head, x, dst, plan.code, plan.opc) \
                        if process_set is not None or ring is _state.ring else NotImplemented
                    if blobs is None:  # every header the same: reduced in that pass
                        return dst
                    if blobs is not NotImplemented:  # headers differ: a mismatch, or a rank that takes the ring
                        return _allreduce_unlike(blobs, plan.head, ring, x, dst, out, plan.code, plan.opc,
                                                 lambda: ring.comm.try_allreduce_small(plan.head, x, dst, plan.code,
                                                                                       plan.opc))
    return allreduce_checked(x, op, out, name, process_set)


# The largest integer weight float64 holds exactly (every integer up to it is exact): the weights travel
# and are summed as float64.
MAX_INT_WEIGHT = 1 << 53
_WEIGHT_FLOAT, _WEIGHT_INT = 0.0, 1.0  # a weight's kind, as it travels
WEIGHTS_NAME = "ringreduce.allreduce.weights"  # the allgather of the weights (an allgather: see allreduce_weighted)


def weighted_dtypes(dtype: np.dtype) -> tuple[np.dtype, np.dtype]:
    """(the dtype a weighted mean of `dtype` is computed and summed in, the
    dtype it is returned in): float16 and bfloat16 in float32, returned in
    their own dtype (rounded once, after the sum: no overflow where the
    float16 sum would, no subnormal flushed by the prescale); float32 and
    float64 in their own; integers in float64, returned as float64 (as
    np.average does: the weighted mean of integers is no integer, and
    truncating it back would be silently wrong)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return np.dtype(np.float64), np.dtype(np.float64)
    if dtype.itemsize == 2:
        return np.dtype(np.float32), dtype
    return dtype, dtype


def weight_record(weight) -> np.ndarray:
    """This rank's weight as it travels: float64 [kind, value]. Raises
    TypeError for anything that is not a real number (bool included); the
    value's checks (negative, NaN, too large) are made on every rank from
    the gathered records (check_weights), so every rank raises alike."""
    w = weight
    if isinstance(w, np.ndarray) and w.ndim == 0:
        w = w[()]
    if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, float, np.integer, np.floating)):
        raise TypeError(f"weight must be a real number (an int or a float, e.g. this rank's batch size), "
                        f"not {type(weight).__name__} {weight!r}"[:300])
    if isinstance(w, (int, np.integer)):
        return np.array([_WEIGHT_INT, float(w) if abs(int(w)) <= MAX_INT_WEIGHT else np.inf * (1 if w > 0 else -1)])
    return np.array([_WEIGHT_FLOAT, float(w)])


def check_weights(records: np.ndarray, names=None) -> np.ndarray:
    """Every rank's weights (from the gathered [kind, value] records, rank
    order), checked alike on every rank: ValueError naming the ranks at
    fault when a weight is negative, NaN, infinite (or an integer beyond
    2**53), when ranks mix integer and float weights, or when they sum to
    zero. Returns the weights as float64. names: how to call rank r."""
    records = np.asarray(records, dtype=np.float64).reshape(-1, 2)
    name = names or (lambda r: f"rank {r}")
    kinds, weights = records[:, 0], records[:, 1]
    if len(set(kinds.tolist())) > 1:
        ints = [name(r) for r, k in enumerate(kinds) if k == _WEIGHT_INT]
        floats = [name(r) for r, k in enumerate(kinds) if k == _WEIGHT_FLOAT]
        raise ValueError(f"weights must agree in kind on every rank: integer weights on {', '.join(ints)}, "
                         f"float weights on {', '.join(floats)}")
    bad = [f"{name(r)} ({'an integer beyond 2**53' if kinds[r] == _WEIGHT_INT and np.isinf(w) else repr(float(w))})"
           for r, w in enumerate(weights) if not (np.isfinite(w) and w >= 0)]
    if bad:
        raise ValueError(f"weights must be finite and >= 0 (integers at most 2**53); bad weight on {', '.join(bad)}")
    total = math.fsum(weights.tolist())
    if not total > 0:
        raise ValueError("weights sum to 0 over every rank: a weighted mean needs some weight")
    if not np.isfinite(total):
        raise ValueError(f"weights sum to {total} (float64 overflow): scale them down")
    return weights


def allreduce_weighted(x, weight, op="avg", out=None, name=None, process_set=None):
    """The weighted mean sum_r(w_r x_r) / sum_r(w_r) over the ranks (of
    process_set), bit-identical on every rank.

    Costs one allgather of two float64s per rank (every rank's weight, named
    WEIGHTS_NAME), then one sum allreduce: each rank prescales its x by
    w_r / W (W: the weights' exact sum, math.fsum in rank order, the same on
    every rank), so nothing overflows however large the weights, and sums.
    The dtypes: weighted_dtypes. A rank of weight 0 contributes zeros,
    whatever its x holds (inf and NaN included). Bad input: a weight that is
    no real number, op other than "avg", a bad x or out raise TypeError /
    ValueError on this rank and MismatchError naming it on the others (the
    usual refusal); bad weight values (check_weights) ValueError on every
    rank, naming the ranks at fault. A rank passing weight= beside one that
    does not: MismatchError on every rank (an allgather met an allreduce).
    Every check comes before data moves; the communicator stays usable."""
    try:
        record = weight_record(weight)
        if op != "avg":
            raise ValueError(f"weight= takes op='avg' (the weighted mean), not op={op!r}")
        if type(x) is not np.ndarray:
            if cuda.is_device_array(x):
                raise TypeError("weight= takes numpy arrays; copy a GPU array to the host first")
            x = np.asarray(x)
        x = native(x) if x.dtype not in DTYPES else x
        dtype_code(x.dtype)
        check_name(name)
        work_dtype, result_dtype = weighted_dtypes(x.dtype)
        if out is not None and (type(out) is not np.ndarray or out.shape != x.shape
                                or out.dtype.newbyteorder("=") != result_dtype or not out.flags.writeable):
            raise ValueError(f"out must be a writeable numpy array of shape {x.shape} and dtype {result_dtype} "
                             f"(a weighted mean of {x.dtype} is {result_dtype})")
    except (TypeError, ValueError) as exc:
        refuse(ALLGATHER, exc, process_set)
        raise
    ring = lookup(process_set)
    records = allgather.__wrapped__(record, name=WEIGHTS_NAME if name is None else f"{WEIGHTS_NAME}:{name}",
                        process_set=process_set)
    names = None if ring is _state.ring else (lambda r: f"world rank {ring.ranks[r]} (rank {r} of the set)")
    weights = check_weights(records, names)
    mine = float(weights[ring.rank])
    if mine == 0:
        scaled = np.zeros(x.shape, work_dtype)
    else:
        factor = work_dtype.type(mine / math.fsum(weights.tolist()))
        scaled = x.astype(work_dtype) * factor
    summed = allreduce.__wrapped__(scaled, op="sum", name=name, process_set=process_set)  # recorded once
    result = summed if summed.dtype == result_dtype else summed.astype(result_dtype)
    if out is None:
        return result
    out[...] = result
    return out


def allreduce_checked(x, op, out, name, process_set):
    """allreduce with every check: any input, refused on every rank when bad;
    a small one that all ranks ran alike leaves its plan for the fast path."""
    if type(x) is not np.ndarray and cuda.is_device_array(x):
        return _allreduce_device(x, op, out, name, process_set)
    try:
        if type(x) is not np.ndarray:
            x = np.asarray(x)
        code = DTYPES.get(x.dtype)
        if code is None:
            x = native(x)
            code = dtype_code(x.dtype)  # raises the TypeError
        opc = OPS.get(op)
        if opc is None:
            op_code(op)  # raises the ValueError
        check_name(name)
        if out is not None and (type(out) is not np.ndarray or out.shape != x.shape
                                or out.dtype.newbyteorder("=") != x.dtype or not out.flags.writeable):
            raise ValueError(f"out must be a writeable numpy array of shape {x.shape} and dtype {x.dtype}")
    except (TypeError, ValueError) as exc:
        refuse(ALLREDUCE, exc, process_set)
        raise
    ring = lookup(process_set)
    with ring.lock:
        rounds = ring.comm.small_rounds if ring.size > 1 else None
        small = x.nbytes <= ring.allreduce_limit
        head = header(ALLREDUCE, opc, code, x.shape, name, inline=small)
        # out is written in place only where it is x itself or apart from x: a partial overlap would let
        # the small path's early rounds overwrite x before a mismatch sends it to the ring.
        in_place = (out is not None and out.flags.c_contiguous and out.flags.writeable and out.dtype == x.dtype
                    and (not np.may_share_memory(out, x)
                         or (x.flags.c_contiguous and out.ctypes.data == x.ctypes.data)))
        src = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        dst = out if in_place else np.empty(x.shape, dtype=x.dtype)
        raw = code == _core.BFLOAT16  # the buffer protocol has no bfloat16: pass bytes
        if small:
            blobs = ring.comm.allreduce_small(head, as_bytes(src) if raw else src, as_bytes(dst) if raw else dst,
                                              code, opc)
            if blobs is None:  # every header the same: reduced in that pass
                if not raw and rounds is not None and type(name) in (str, type(None)):
                    if len(ring.plans) >= MAX_PLANS:
                        ring.plans.clear()
                    ring.plans[(x.shape, x.dtype, op, name, marks.engine)] = Plan(head, x.shape, code, opc, rounds)
                return dst if out is None or dst is out else deliver(dst, out)
            return _allreduce_unlike(blobs, head, ring, src, dst, out, code, opc,
                                     lambda: ring.comm.allreduce_small(head, as_bytes(src) if raw else src,
                                                                       as_bytes(dst) if raw else dst, code, opc))
        blobs = exchange(head, b"", ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
        return _allreduce_ring(blobs, ring, src, dst, out, code, opc)


def _allreduce_unlike(blobs, head, ring, src, dst, out, code, opc, again):
    """A small allreduce's headers differed: MismatchError on every rank, or,
    when only the path differs (RINGREDUCE_SMALL_BYTES differs between ranks)
    or the others are joined ranks' negotiation (rr.join: protocol.agree), the
    ring, as every rank takes it. A pass that joined members stepped aside
    from (protocol.voided: the engine's allreduce) runs again (again(): the
    same small pass), with their engines. src and dst are C-contiguous;
    called with the lock held."""
    while voided(blobs, ring):
        blobs = again()
        if blobs is None:  # every header the same: reduced in that pass
            return dst if out is None or dst is out else deliver(dst, out)
    agree(blobs, head, ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
    return _allreduce_ring(blobs, ring, src, dst, out, code, opc)


def _allreduce_ring(blobs, ring, src, dst, out, code, opc):
    """The ring allreduce of src into dst, after the header pass agreed."""
    if dst is not src and np.may_share_memory(dst, src):
        src = src.copy()
    device = any_device(blobs) if ring.hierarchy else False
    if not run_allreduce(ring, device, src, dst, code, opc):  # the flat ring, or hierarchical (core/hierarchy.py)
        _note_phases(ring.comm)
    return deliver(dst, out)


_phase_log = threading.local()  # .log: the list record_phases() collects in on this thread, or None


@contextlib.contextmanager
def record_phases():
    """Collects the phases of every ring allreduce this thread runs inside:
    (start, ScatterReduce done, end), CLOCK_MONOTONIC seconds as the C core
    timed them (comm.last_phases), one per ring op, read under the ring's
    lock right after the op. The small one-pass allreduces (arena, recursive
    doubling, the blob pass) and the hierarchical ones (three rings, no one
    ScatterReduce) have no such phases and add nothing. The
    engine's timeline shows them (ringreduce/engine/timeline.py)."""
    log, outer = [], getattr(_phase_log, "log", None)
    _phase_log.log = log
    try:
        yield log
    finally:
        _phase_log.log = outer


def _note_phases(comm) -> None:
    log = getattr(_phase_log, "log", None)
    if log is not None:
        log.append(comm.last_phases())


def _shaped(result, x):
    """A GPU allreduce's result in x's shape: the buffers it runs on are
    ascontiguousarray(x)'s, which is 1-d for a 0-d x (in numpy as in cupy),
    and the result has x's shape, as numpy's allreduce."""
    return result if result.shape == x.shape else result.reshape(x.shape)


def _allreduce_device(x, op, out, name, process_set=None):
    try:
        g, x = arrays_for(x)
        code, opc = dtype_code(x.dtype), op_code(op)
        check_name(name)
        if out is not None and (not cuda.is_device_array(out) or out.shape != x.shape or out.dtype != x.dtype):
            raise ValueError(f"out must be a GPU array of shape {x.shape} and dtype {x.dtype}")
        if out is not None and cuda.device_id(out) != cuda.device_id(x):
            raise ValueError(f"out is on GPU {cuda.device_id(out)}, x on GPU {cuda.device_id(x)}: the result is "
                             "made on x's GPU, out must be there too")
    except (TypeError, ValueError) as exc:
        refuse(ALLREDUCE, exc, process_set)
        raise
    ring = lookup(process_set)
    small = x.nbytes <= ring.allreduce_limit
    if small and device_ipc.small_takes_ipc(ring):
        return _allreduce_device_small_ipc(g, x, code, opc, out, name, ring, process_set)
    if small and not device_ipc.small_agrees_first(ring):  # outside the ring's lock, which allreduce() takes
        # Latency-bound: one copy each way through a pinned bounce buffer and
        # the host path in place there (host kernels: the host ring's bits).
        met = []  # whether this rank's host allreduce began: from there the others have met it

        def reduce(host):
            met.append(True)
            allreduce.__wrapped__(host, op, out=host, name=name, process_set=process_set)  # recorded once
        with g.on(x):
            try:
                got = g.allreduce_small(x, out, reduce)
                host = g.to_host(x) if got is None else None  # the device busy with other threads: pageable memory
            except Exception as exc:
                if not met:  # the GPU failed first (out of memory, a CUDA error): the others raise at once
                    refuse(ALLREDUCE, exc, process_set)
                raise
            if got is None:
                got = g.from_host(allreduce.__wrapped__(host, op, name=name, process_set=process_set), like=x)
            return deliver(_shaped(got, x), out, g.xp)
    try:
        # The ring's device and GPU memory are had before the header goes out:
        # a rank without them (cupy's OutOfMemoryError is a MemoryError) refuses, and the others
        # raise at once instead of waiting in the ring for it.
        with g.on(x):
            g.ready(x)  # the ring's device, made on first use (its kernels loaded)
            src = g.xp.ascontiguousarray(x)
            dst = out if out is not None and out.flags.c_contiguous else g.xp.empty_like(src)
            if dst is not src and g.xp.may_share_memory(dst, src):
                src = src.copy()
    except Exception as exc:
        refuse(ALLREDUCE, exc, process_set)
        raise
    with ring.lock, g.on(x):
        head = header(ALLREDUCE, opc, code, x.shape, name, device=True)
        blobs = exchange(head, b"", ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
        if small and not all_device(blobs):  # a host rank: this ring's small GPU allreduces take the bounce buffer
            ring.small_asks_ipc = False
        g.allreduce(ring, src, dst, code, opc, all_device(blobs))  # device to device, or staged (core/device_ipc.py)
        _note_phases(ring.comm)
        return deliver(_shaped(dst, x), out, g.xp)


def _allreduce_device_small_ipc(g, x, code, opc, out, name, ring, process_set):
    """A small allreduce of GPU arrays on a ring that agreed on the IPC path:
    one pass (device_ipc.allreduce_small), whose headers say so. Where a
    rank's differs (a host array, another small limit, joined ranks) every
    rank takes the ring, as after any header pass that agrees."""
    try:
        with g.on(x):
            src = g.xp.ascontiguousarray(x)
            dst = out if out is not None and out.flags.c_contiguous else g.xp.empty_like(src)
    except Exception as exc:  # out of GPU memory: the others raise at once, naming this rank
        refuse(ALLREDUCE, exc, process_set)
        raise
    with ring.lock, g.on(x):
        head = header(ALLREDUCE, opc, code, x.shape, name, inline=True, device=True)
        blobs = g.allreduce_small_ipc(ring, head, src, dst, code, opc)
        while blobs is not None and voided(blobs, ring):  # joined members' engines run it: again, with them
            blobs = g.allreduce_small_ipc(ring, head, src, dst, code, opc)
        if blobs is not None:
            agree(blobs, head, ("op", "dtype", "shape", "name"), "allreduce", ring, beside_joined=True)
            if dst is not src and g.xp.may_share_memory(dst, src):
                src = src.copy()
            g.allreduce(ring, src, dst, code, opc, all_device(blobs))
        return deliver(_shaped(dst, x), out, g.xp)


def _prepared(g, x, kind, process_set, down: bool, host: bool, alloc=None):
    """What a collective needs of x before its header goes out: x's small
    trip (g.small_trip: its bytes down through a bounce buffer where down),
    its host bytes where host, and alloc()'s buffers (None without alloc).
    On a GPU any of it can fail (a CUDA error, out of GPU memory, the
    kernels' first compile): this rank then refuses, so the others raise
    MismatchError naming it at once instead of waiting for it in the ring or
    pairing their collective with its next one. Made outside the ring's
    lock, which refuse takes after the communicator's."""
    if g is HostArrays:
        return g.small_trip(x), alloc() if alloc else None
    trip = None
    try:
        with g.on(x):
            g.ready(x)
            trip = g.small_trip(x, down=down)
            if host:
                trip.host  # noqa: B018  the pageable copy where no bounce buffer was had
            return trip, alloc() if alloc else None
    except Exception as exc:
        if trip is not None:
            trip.close()
        refuse(kind, exc, process_set)
        raise


@recorded("reduce_scatter")
@_reported("reduce_scatter")
def reduce_scatter(x, op: str = "sum", name: str | None = None, process_set=None):
    """Returns this rank's chunk of the flattened reduction (chunks in rank order)."""
    try:
        g, x = arrays_for(x)
        code, opc = dtype_code(x.dtype), op_code(op)
        check_name(name)
    except (TypeError, ValueError) as exc:
        refuse(REDUCE_SCATTER, exc, process_set)
        raise
    w = lookup(process_set)
    # A small one's bytes go down and its result up through a bounce buffer on a GPU (cuda.SmallTrip).
    small = x.nbytes <= w.small_limit
    ring_bufs = lambda: (g.xp.ascontiguousarray(x), g.xp.empty(x.size, dtype=x.dtype))  # noqa: E731
    trip, bufs = _prepared(g, x, REDUCE_SCATTER, process_set, down=small, host=small,
                           alloc=None if small else ring_bufs)
    with trip, w.lock, g.on(x):
        head = header(REDUCE_SCATTER, opc, code, x.shape, name, inline=small, device=g is not HostArrays)
        blobs = exchange(head, trip.host.tobytes() if small else b"",
                          ("op", "dtype", "shape", "name"), "reduce_scatter", w)
        lo, hi = chunk_bounds(x.size, w.size, w.rank)
        if all_inline(blobs):
            mine = _reduce_blobs(payloads(blobs, len(head)), x.dtype, code, opc, (x.size,))[lo:hi].copy()
            return g.result(trip, mine, like=x)
        trip.close()
        src, work = bufs or ring_bufs()  # made here where this rank's limit said small and another's did not
        g.reduce_scatter(w, src, work, code, opc, all_device(blobs))
        return work[lo:hi].copy()


@recorded("allgather")
@_reported("allgather")
def allgather(x, name: str | None = None, process_set=None):
    """Concatenates every rank's x along axis 0 (ranks may differ in dim 0 only)."""
    try:
        g, x = arrays_for(x, reduces=False)
        check_name(name)
    except (TypeError, ValueError) as exc:
        refuse(ALLGATHER, exc, process_set)
        raise
    if x.ndim == 0:
        x = x.reshape(1)
    w = lookup(process_set)
    # A small one's bytes go down through a bounce buffer on a GPU (cuda.SmallTrip); the result, N times
    # larger, up through it where it fits, else the pageable way.
    small = x.nbytes <= w.small_limit
    trip, _ = _prepared(g, x, ALLGATHER, process_set, down=small, host=small)
    with trip, w.lock, g.on(x):
        head = header(ALLGATHER, 0, 0, x.shape, name, inline=small, descr=x.dtype, device=g is not HostArrays)
        blobs = exchange(head, trip.host.tobytes() if small else b"",
                          ("dtype", "trailing", "name"), "allgather", w)
        heads = [parse(b) for b in blobs]
        rows = [h["shape"][0] for h in heads]
        shape = (sum(rows),) + x.shape[1:]
        if all(h["inline"] for h in heads):
            joined = np.concatenate([np.frombuffer(h["payload"], dtype=np.uint8) for h in heads])
            return g.result(trip, joined.view(x.dtype).reshape(shape), like=x)
        trip.close()
        out = g.xp.empty(shape, dtype=x.dtype)
        flat = as_bytes(out)
        row_bytes = x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        nbytes = [r * row_bytes for r in rows]
        at = sum(nbytes[:w.rank])
        flat[at:at + nbytes[w.rank]] = as_bytes(g.xp.ascontiguousarray(x))
        g.allgather(w, flat, nbytes, all_device(blobs))
        return out


@recorded("broadcast")
@_reported("broadcast")
def broadcast(x, root: int = 0, name: str | None = None, process_set=None):
    """Returns a new array holding root's x (same shape and dtype on every rank).
    root is a world rank; with a process set, one of its members (as Horovod's)."""
    try:
        g, x = arrays_for(x, reduces=False)
        check_name(name)
    except (TypeError, ValueError) as exc:
        refuse(BROADCAST, exc, process_set)
        raise
    w = lookup(process_set)
    if not isinstance(root, (int, np.integer)):  # 0.0 == 0 would pass `in` below, then fail in struct.pack
        # on one rank but hit another's cached header for 0 (_header_of): their collectives one off
        problem = TypeError(f"root must be an integer rank, not {type(root).__name__} {root!r}")
        refuse(BROADCAST, problem, process_set)
        raise problem
    if root not in w.ranks:  # refused outside the ring's lock, which refuse takes after _state.lock
        problem = ValueError(f"root {root} is not a rank of this world of {w.size}" if w is _state.ring
                             else f"root {root} is not a member of process set {process_set.process_set_id} "
                                  f"(ranks {w.ranks})")
        refuse(BROADCAST, problem, process_set)
        raise problem
    # A small one's bytes go down (on the root; elsewhere the buffer only carries the result) and the result
    # up through a bounce buffer on a GPU (cuda.SmallTrip).
    root = w.ranks.index(root) if w is not _state.ring else root
    small = x.nbytes <= w.small_limit
    ring_buf = lambda: g.xp.empty(x.shape, dtype=x.dtype)  # noqa: E731
    trip, buf = _prepared(g, x, BROADCAST, process_set, down=small, host=small and w.rank == root,
                          alloc=None if small else ring_buf)
    with trip, w.lock, g.on(x):
        head = header(BROADCAST, 0, 0, x.shape, name, root=root, inline=small, descr=x.dtype,
                      device=g is not HostArrays)
        blobs = exchange(head, trip.host.tobytes() if small and w.rank == root else b"",
                          ("dtype", "shape", "root", "name"), "broadcast", w)
        if all_inline(blobs):
            # Copied as bytes: numpy copies a padded structured dtype field by field, dropping the padding.
            data = np.frombuffer(blobs[root], np.uint8, offset=len(head)).copy().view(x.dtype).reshape(x.shape)
            return g.result(trip, data, like=x)
        trip.close()
        if buf is None:  # this rank's limit said small, another's did not
            buf = ring_buf()
        if w.rank == root:  # as bytes, padding included (see above)
            as_bytes(buf)[...] = as_bytes(g.xp.ascontiguousarray(x))
        g.broadcast(w, buf, root, all_device(blobs))
        return buf


# How a rank asked alltoall to split its rows (the header's op byte).
_SPLITS_GIVEN, _SPLITS_EQUAL = 0, 1


def _split_matrix(heads, n: int) -> list:
    """Every rank's splits (rows it sends to each rank), checked the same way
    on every rank from the same headers: bad splits raise ValueError on all
    of them, before data moves, and the ring stays usable."""
    matrix = []
    for r, h in enumerate(heads):
        rows = h["shape"][0]
        if h["op"] == _SPLITS_EQUAL:
            if rows % n:
                raise ValueError(f"alltoall without splits needs rows divisible by the {n} ranks: rank {r} has "
                                 f"{rows}; pass splits")
            matrix.append([rows // n] * n)
            continue
        splits = list(h["splits"])
        if len(splits) != n:
            raise ValueError(f"alltoall splits need one entry per rank ({n}); rank {r} passed {len(splits)}: {splits}")
        if any(v < 0 for v in splits):
            raise ValueError(f"alltoall splits must not be negative; rank {r} passed {splits}")
        if sum(splits) != rows:
            raise ValueError(f"alltoall splits must sum to the rows of the tensor; rank {r} passed {splits} "
                             f"(sum {sum(splits)}) for {rows} rows")
        matrix.append(splits)
    return matrix


@recorded("alltoall")
@_reported("alltoall")
def alltoall(x, splits=None, name: str | None = None, process_set=None):
    """Sends rows of x to every rank: x is split along axis 0 into pieces of
    splits[i] rows for rank i (default: equal pieces; rows must then divide
    by size). Returns (received, received_splits): the pieces every rank sent
    this one, concatenated in rank order, and how many rows came from each
    (int32). Ranks must agree on dtype and shape[1:]; they may differ in rows.
    A GPU array goes through the host and comes back on its GPU."""
    try:
        g, x = arrays_for(x, reduces=False)
        if x.ndim == 0:
            raise ValueError("alltoall needs a tensor of at least one dimension (its rows are split)")
        given = None if splits is None else read_splits(splits)
        check_name(name)
    except (TypeError, ValueError) as exc:
        refuse(ALLTOALL, exc, process_set)
        raise
    w = lookup(process_set)
    # A small one's bytes go down through a bounce buffer on a GPU and the result up through it where it fits
    # (cuda.SmallTrip); a large one's through the host's pageable memory (the ring's alltoall is the host's).
    small = x.nbytes <= w.small_limit
    trip, _ = _prepared(g, x, ALLTOALL, process_set, down=small, host=True)
    with trip, w.lock, g.on(x):
        n, me = w.size, w.rank
        head = header(ALLTOALL, _SPLITS_EQUAL if given is None else _SPLITS_GIVEN, 0, x.shape, name,
                       inline=small, descr=x.dtype, splits=given or ())
        blobs = exchange(head, trip.host.tobytes() if small else b"", ("dtype", "trailing", "name"), "alltoall", w)
        heads = [parse(b) for b in blobs]
        matrix = _split_matrix(heads, n)
        row_bytes = x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        received_splits = np.array([matrix[o][me] for o in range(n)], dtype=np.int32)
        out = np.empty((int(received_splits.sum()),) + x.shape[1:], dtype=x.dtype)
        flat = as_bytes(out)
        if all(h["inline"] for h in heads):
            at = 0
            for o, h in enumerate(heads):
                start = sum(matrix[o][:me]) * row_bytes
                size = matrix[o][me] * row_bytes
                flat[at:at + size] = np.frombuffer(h["payload"], dtype=np.uint8)[start:start + size]
                at += size
        else:
            w.comm.alltoall(trip.host, flat, [rows * row_bytes for per in matrix for rows in per])
        return g.result(trip, out, like=x), received_splits


@recorded("barrier")
@_reported("barrier")
def barrier(name: str | None = None, process_set=None) -> None:
    """Returns once every rank (of process_set) has entered the barrier."""
    try:
        check_name(name)
        if name == CLOSING_NAME:  # a barrier so named would pair with a peer's closing pass (device_ipc.release)
            raise ValueError(f"the name {CLOSING_NAME!r} is reserved for a rank's last pass on a ring it closes")
    except (TypeError, ValueError) as exc:
        refuse(BARRIER, exc, process_set)
        raise
    w = lookup(process_set)
    with w.lock:
        head = header(BARRIER, 0, 0, (), name)
        exchange(head, b"", ("name",), "barrier", w)
