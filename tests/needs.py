"""Marks for tests that need hardware this machine may lack."""
import pytest

from ringreduce import cuda

WHY_NO_GPU = cuda.available()


def gpu(test):
    """Marked `gpu` (select with -m gpu); skips, saying why, where no GPU is."""
    skip = pytest.mark.skipif(WHY_NO_GPU is not None, reason=f"needs cupy and a CUDA GPU: {WHY_NO_GPU}")
    return pytest.mark.gpu(skip(test))
