"""Every tunable read from the environment, once, in one place."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    timeout: float = 60.0           # RINGREDUCE_TIMEOUT: seconds a peer may stay silent
    start_timeout: float = 120.0    # RINGREDUCE_START_TIMEOUT: seconds to wait for every rank at init
    segment_bytes: int = 256 << 10  # RINGREDUCE_SEGMENT_BYTES: pipeline segment of the ring
    small_bytes: int = 128 << 10    # RINGREDUCE_SMALL_BYTES: data rides with the header while
                                    # (N-1) * tensor bytes stays within this
    spin: int = 100                 # RINGREDUCE_SPIN: yields before sleeping in poll
    backend: str = ""               # RINGREDUCE_BACKEND: "socket" or "mpi"; empty: choose
    shm_bytes: int = 1 << 20        # RINGREDUCE_SHM_BYTES: buffer of a shared-memory link between
                                    # neighbours on one host (socket backend); 0: sockets only

    def small_limit(self, size: int) -> int:
        """Largest tensor (bytes) for the one-pass small algorithm on `size`
        ranks: it sends (N-1) times the tensor, the ring 2(N-1)/N times plus
        3(N-1) latencies; measured crossover ~128 KiB at N=2, ~48 KiB at N=4."""
        return self.small_bytes // max(size - 1, 1)

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
            backend=get("RINGREDUCE_BACKEND", d.backend, str),
            shm_bytes=get("RINGREDUCE_SHM_BYTES", d.shm_bytes, int),
        )
