"""Gradient compression on the wire: cast before the ring, back after. Each
hop widens the 16-bit values, reduces and rounds once (sum in float32; avg as
a running mean in double, so an average never overflows the 16-bit range)."""
import tensorflow as tf


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


class Compression:
    """Compression.none, Compression.fp16, Compression.bf16."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
