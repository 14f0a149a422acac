"""Marks for tests that need hardware this machine may lack."""
import pytest

from ringreduce.core import cuda

WHY_NO_GPU = cuda.available()


# Marked `gpu` (select with -m gpu); skips, saying why, where no GPU is.
GPU_MARKS = [pytest.mark.gpu,
             pytest.mark.skipif(WHY_NO_GPU is not None, reason=f"needs cupy and a CUDA GPU: {WHY_NO_GPU}")]


def gpu(test):
    """A test that needs a GPU: see GPU_MARKS."""
    for mark in reversed(GPU_MARKS):
        test = mark(test)
    return test
