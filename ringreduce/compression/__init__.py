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
from .base import Compressor
from .int8 import Int8
from .powersgd import PowerSGD
from .topk import TopK

import ast

__all__ = ["Compressor", "PowerSGD", "Int8", "TopK", "from_tag"]

_BY_NAME = {c.name: c for c in (PowerSGD, Int8, TopK)}


def from_tag(tag: str) -> Compressor:
    """A fresh compressor from Compressor.tag (the engine's stand-in for a
    rank that has joined and so has no compressor of its own for a tensor)."""
    name, _, args = tag.partition("(")
    params = {}
    for item in filter(None, args.rstrip(")").split(",")):
        k, _, v = item.partition("=")
        params[k] = ast.literal_eval(v)
    return _BY_NAME[name](**params)
