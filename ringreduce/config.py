"""Every tunable read from the environment, once, in one place."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    timeout: float = 60.0           # RINGREDUCE_TIMEOUT: seconds a peer may stay silent
    start_timeout: float = 120.0    # RINGREDUCE_START_TIMEOUT: seconds to wait for every rank at init
    segment_bytes: int = 256 << 10  # RINGREDUCE_SEGMENT_BYTES: pipeline segment of the ring
    small_bytes: int = 64 << 10     # RINGREDUCE_SMALL_BYTES: at most this, data rides with the header
    spin: int = 20                  # RINGREDUCE_SPIN: yields before sleeping in poll

    @classmethod
    def from_env(cls, env=None) -> "Config":
        env = os.environ if env is None else env
        get = lambda name, default, kind: kind(env[name]) if env.get(name, "") != "" else default  # noqa: E731
        d = cls()
        return cls(
            timeout=get("RINGREDUCE_TIMEOUT", d.timeout, float),
            start_timeout=get("RINGREDUCE_START_TIMEOUT", d.start_timeout, float),
            segment_bytes=get("RINGREDUCE_SEGMENT_BYTES", d.segment_bytes, int),
            small_bytes=get("RINGREDUCE_SMALL_BYTES", d.small_bytes, int),
            spin=get("RINGREDUCE_SPIN", d.spin, int),
        )
