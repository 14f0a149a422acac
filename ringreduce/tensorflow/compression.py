"""Gradient compression on the wire.

fp16 / bf16: cast before the ring, back after. Each hop widens the 16-bit
values, reduces and rounds once (sum in float32; avg as a running mean in
double, so an average never overflows the 16-bit range).

powersgd(rank=4) / int8 / topk(ratio=0.01): lossy, with error feedback,
done by the engine (ringreduce/compression/): the tensor goes to the engine
as it is, and the engine's compressor reduces it. Each keeps per-tensor
state, so give each model its own (Compression.int8 is one shared object;
Compression.powersgd(...) and Compression.topk(...) make a new one).
"""
import tensorflow as tf

from ..compression import Int8, PowerSGD, TopK


class NoneCompressor:
    @staticmethod
    def compress(t):
        return t, None

    @staticmethod
    def decompress(t, ctx):
        return t


class _CastCompressor:
    wire = None

    @classmethod
    def compress(cls, t):
        if t.dtype.is_floating and t.dtype != cls.wire:
            return tf.cast(t, cls.wire), t.dtype
        return t, None

    @classmethod
    def decompress(cls, t, ctx):
        return t if ctx is None else tf.cast(t, ctx)


class FP16Compressor(_CastCompressor):
    wire = tf.float16


class BF16Compressor(_CastCompressor):
    wire = tf.bfloat16


class EngineCompression(NoneCompressor):
    """A compressor the engine runs (`engine`, a ringreduce.compression one):
    nothing to do on the TensorFlow side."""

    def __init__(self, engine):
        self.engine = engine

    def __repr__(self):
        return f"Compression({self.engine.tag})"


def engine_compressor(compression):
    """The engine's compressor behind a Compression, or None (cast or none)."""
    return getattr(compression, "engine", None)


class Compression:
    """Compression.none, .fp16, .bf16 (casts); .powersgd(rank=4), .int8,
    .topk(ratio=0.01) (lossy, with error feedback; see docs/compression.md)."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = EngineCompression(Int8())

    @staticmethod
    def powersgd(rank: int = 4, warmup_steps: int = 0, min_size: int = 4096) -> EngineCompression:
        return EngineCompression(PowerSGD(rank=rank, warmup_steps=warmup_steps, min_size=min_size))

    @staticmethod
    def topk(ratio: float = 0.01) -> EngineCompression:
        return EngineCompression(TopK(ratio=ratio))
