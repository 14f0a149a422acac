"""Builds ringreduce._core from csrc/. Metadata lives in pyproject.toml."""
from setuptools import Extension, setup

core = Extension(
    "ringreduce._core",
    sources=["csrc/module.c", "csrc/ring.c", "csrc/reduce.c", "csrc/tcp.c"],
    depends=["csrc/reduce_math.h", "csrc/reduce.h", "csrc/ring.h", "csrc/tcp.h", "csrc/transport.h"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                        "-Wno-cast-function-type"],
    libraries=["pthread"],
)

setup(ext_modules=[core])
