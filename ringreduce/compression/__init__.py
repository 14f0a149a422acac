"""Gradient compression with error feedback, framework-free (numpy):
PowerSGD (low rank), Int8 (scaled 8-bit, summed in place on the ring) and
TopK (sparse, gathered). Each keeps per-tensor state keyed by the
collective's name, so use one compressor object per model.

    from ringreduce.compression import PowerSGD
    c = PowerSGD(rank=4)
    g = c.allreduce(grad, "dense/kernel")                 # on the caller's thread
    h = engine().enqueue("dense/kernel", grad, compression=c)   # fused, in the engine

See docs/compression.md.
"""
from .base import REGISTRY, Compressor
from .int8 import Int8
from .powersgd import PowerSGD
from .topk import TopK

import ast

__all__ = ["Compressor", "PowerSGD", "Int8", "TopK", "from_tag", "check_rebuildable"]

_REBUILT: set = set()  # (class, tag) pairs check_rebuildable has passed


def from_tag(tag: str) -> Compressor:
    """A fresh compressor from Compressor.tag (the engine's stand-in for a
    rank that has joined and so has no compressor of its own for a tensor).
    ValueError, naming the tag, when no registered compressor makes it."""
    name, _, args = tag.partition("(")
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"no compressor named {name!r} (tag {tag!r}) is defined in this process: a Compressor "
                         f"subclass with name = {name!r} must be defined on every rank, in a module each imports "
                         f"(defined here: {', '.join(sorted(REGISTRY))})")
    params = {}
    try:
        for item in filter(None, args.rstrip(")").split(",")):
            k, _, v = item.partition("=")
            params[k] = ast.literal_eval(v)
        return cls(**params)
    except (ValueError, TypeError, SyntaxError) as exc:
        raise ValueError(f"{cls.__qualname__} cannot be made again from its tag {tag!r}: params() must return "
                         f"the keywords its __init__ takes, as literals ({type(exc).__name__}: {exc})") from None


def check_rebuildable(compressor: Compressor, tag: str) -> None:
    """Raises ValueError unless from_tag(tag) gives a compressor of the same
    class and tag, as a joined rank's engine needs (checked once per class and
    tag, when the engine is handed the compressor, so it fails on every rank
    alike and at once, not on a joined rank in the middle of a step)."""
    if (type(compressor), tag) in _REBUILT:
        return
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compression= takes a ringreduce.compression.Compressor, not {type(compressor).__name__}")
    cls = type(compressor)
    if "name" not in cls.__dict__:
        raise ValueError(f"{cls.__qualname__} has no name of its own (its tag {tag!r} would make a "
                         f"{REGISTRY.get(cls.name, Compressor).__qualname__} on a joined rank): set the class "
                         "attribute name")
    again = from_tag(tag)
    if type(again) is not cls or again.tag != tag:
        raise ValueError(f"{cls.__qualname__}'s tag {tag!r} makes {again!r} (tag {again.tag!r}) again: params() "
                         "must return every keyword its __init__ takes")
    _REBUILT.add((cls, tag))
