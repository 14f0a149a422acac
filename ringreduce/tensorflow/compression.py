"""Gradient compression on the wire: cast before the ring, back after (the
C kernels accumulate 16-bit values in float32 and round once)."""
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
