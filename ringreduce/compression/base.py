"""What every compressor shares: per-tensor state keyed by the collective's
name, the reduction of a whole bucket at once (so compressed tensors fuse),
and the plain path for what is not worth compressing.

A compressor reduces a bucket of named tensors over the ring with the
public collectives (ringreduce.core.collectives): it runs on the caller's thread
(`compressor.allreduce(...)`) or on the engine's (engine().enqueue(...,
compression=...)), every rank calling the same collectives in the same order.
Only sum and avg are meaningful for a lossy reduction.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..core import collectives as _c
from ..core.process_sets import ring_of
from ..core.protocol import REFUSED_PREFIX
from ..errors import MismatchError

OPS = ("sum", "avg")


def scope(process_set) -> object:
    """Whose tensors a state belongs to: 0 for the world, a process set's
    (id, ranks), since a removed set's id goes to the next set added, whose
    members may differ."""
    if process_set is None or getattr(process_set, "process_set_id", 0) == 0:
        return 0
    return process_set.process_set_id, tuple(process_set.ranks)


# name -> the Compressor subclass that set it: how a joined rank's engine
# rebuilds a compressor from the negotiated tag (from_tag).
REGISTRY: dict = {}


class Compressor:
    """Subclasses set `name` and implement _reduce(items, n, group, label),
    items a list of (key, float array, state), label the prefix of the names
    of the collectives they run; they return the SUM over ranks of each
    array, as float arrays of the same shapes. params() returns what
    __init__ takes as keywords (literals), so cls(**params()) is the same
    compressor. A subclass that sets its own `name` is registered under it
    when defined, so defining it on every rank (in a module each imports)
    lets the engine rebuild it from its tag on a joined rank."""
    name = "none"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return  # inherits its parent's name: enqueue refuses it (its tag would rebuild the parent)
        known = REGISTRY.get(cls.name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"compressor name {cls.name!r} is taken by {known.__module__}.{known.__qualname__}; "
                            f"give {cls.__qualname__} a name of its own")
        REGISTRY[cls.name] = cls  # the same class defined again (a reload) replaces itself

    def __init__(self):
        self._state: dict = {}  # (scope(process set), tensor name) -> the compressor's per-tensor state

    def params(self) -> dict:
        return {}

    @property
    def tag(self) -> str:
        """The spec as text, e.g. 'powersgd(min_size=4096,rank=4,warmup_steps=0)': what
        the engine negotiates, and what from_tag() makes a compressor from again."""
        return f"{self.name}({','.join(f'{k}={v!r}' for k, v in sorted(self.params().items()))})"

    def wire_tag(self, process_set, key: str, shape) -> str:
        """The tag the engine negotiates for one tensor's next reduction:
        `tag`, unless which collectives it runs depends on the tensor's own
        state (PowerSGD's warm-up), which the tag then spells out, so that
        a joined rank's stand-in (from_tag) runs the same ones."""
        return self.tag

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"

    def reset(self) -> None:
        """Forget every tensor's state (error feedback, warm starts, steps)."""
        self._state.clear()

    def allreduce(self, arrays, names=None, op: str = "avg", process_set=None):
        """Reduce one array (names: its name) or a list of arrays (names: one
        each) over the ring, compressed; returns the same structure. Call it
        on every rank with the same names, shapes and dtypes, in the same order."""
        single = not isinstance(arrays, (list, tuple))
        arrays = [arrays] if single else list(arrays)
        names = [names] if single else list(names or [])
        if len(names) != len(arrays) or not all(isinstance(n, str) and n for n in names):
            raise ValueError("every tensor a compressor reduces needs a name, the same on every rank")
        out = self.reduce_bucket(names, arrays, op, process_set)
        return out[0] if single else out

    def reduce_bucket(self, names, arrays, op, process_set=None, keys=None, owners=None) -> list:
        """The bucket's tensors reduced; names go on the wire (the same on
        every rank), keys (default: the names) say whose state each uses:
        a name that changes every step (TensorFlow's eager naming) can keep
        one key. owners (default: self): the compressor whose state each
        tensor keeps, when the engine fuses tensors of several compressors
        with the same tag (two models' PowerSGD(rank=4))."""
        if op not in OPS:
            raise ValueError(f"{self!r} reduces with sum or avg only, not {op!r}")
        keys = list(keys or names)
        owned = [(id(o), k) for o, k in zip(owners or [self] * len(keys), keys)]
        if len(set(owned)) != len(owned):  # one key, one state: the second would overwrite the first's error
            raise ValueError(f"a compressor keeps state by name; {sorted({k for o, k in owned if owned.count((o, k)) > 1})} "
                             "name more than one tensor of one bucket")
        ring = ring_of(process_set)
        set_id = scope(process_set)
        # the wire names carry a digest of the bucket's names, shapes and dtypes: ranks that disagree fail
        # on the first collective (sizes alone may agree: (10, 20) and (20, 10), or top-k's k)
        layout = repr([(n, np.shape(a), np.asarray(a).dtype.str) for n, a in zip(names, arrays)])
        label = f"{names[0]}#{zlib.crc32(layout.encode()):08x}" if names else ""
        wrong = [f"{n!r} is {np.asarray(a).dtype}" for n, a in zip(names, arrays) if np.asarray(a).dtype.kind != "f"]
        if wrong:
            problem = f"{self!r} compresses floating-point tensors; {', '.join(wrong)}"[:400]
            try:  # still meet the others' first collective: they raise, naming this rank, instead of waiting
                _c.allreduce(np.zeros(1), name=f"{REFUSED_PREFIX} {problem}", process_set=process_set)
            except MismatchError:
                pass
            raise TypeError(problem)
        items = []
        for name, key, a, owner in zip(names, keys, arrays, owners or [self] * len(arrays)):
            a = np.asarray(a)
            work = a.astype(np.float64 if a.dtype == np.float64 else np.float32, copy=False)
            state = owner._state.setdefault((set_id, key), {})
            if state.get("shape", a.shape) != a.shape:  # another model's tensor of the same name: start afresh
                state.clear()
            state["shape"] = a.shape
            items.append(((set_id, name), work, state))
        before = [dict(state) for _, _, state in items]
        try:
            sums = self._reduce(items, ring.size, process_set, label) if items else []
        except MismatchError as exc:
            raise MismatchError(f"{self!r}: ranks disagree on the names, shapes or dtypes of the tensors they "
                                f"compress (this rank: {layout[:300]}): {exc}") from exc
        for s, (_, _, state), old in zip(sums, items, before):
            if not np.isfinite(s).all():  # an overflow, which a loss scaler skips: so does the state, alike on
                state.clear()             # every rank (the sums are), or the NaN would poison every later step
                state.update(old)
        if op == "avg":
            for s in sums:  # fresh arrays, the compressor's own
                s *= s.dtype.type(1.0 / ring.size)
        return [s.astype(np.asarray(a).dtype, copy=False).reshape(np.shape(a)) for s, a in zip(sums, arrays)]

    def _reduce(self, items, n: int, group, label: str) -> list:
        raise NotImplementedError

    @staticmethod
    def _plain_sum(arrays, group, name: str) -> list:
        """Uncompressed: one fused sum allreduce per dtype of whatever is left."""
        out = [None] * len(arrays)
        for dtype in {a.dtype for a in arrays}:
            idx = [i for i, a in enumerate(arrays) if a.dtype == dtype]
            flat = np.concatenate([arrays[i].reshape(-1) for i in idx])
            flat = _c.allreduce(flat, op="sum", name=f"{name}/{dtype}", process_set=group)
            at = 0
            for i in idx:
                out[i] = flat[at:at + arrays[i].size].reshape(arrays[i].shape)
                at += arrays[i].size
        return out
