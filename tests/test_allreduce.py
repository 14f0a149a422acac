"""allreduce against numpy: every dtype and op, odd sizes, several world sizes;
every rank must end with the same bits."""
import numpy as np
import pytest

from cases import DTYPES, OPS, np_dtype
from ringreduce.config import MAX_SMALL_BYTES
from ranks import run_ranks

WORLD_SIZES = [1, 2, 3, 4, 5, 8]


# Both algorithms on every size: the ring alone (no data rides with the
# header), the one-pass small algorithm alone, and the default choice by size.
# The ring also over TCP links (no shared memory), and over shared-memory
# links smaller than a segment and of an odd size, so every window wraps.
ALGORITHMS = {"ring": {"RINGREDUCE_SMALL_BYTES": "0"}, "small": {"RINGREDUCE_SMALL_BYTES": str(MAX_SMALL_BYTES)},
              "auto": {},
              "ring-tcp": {"RINGREDUCE_SMALL_BYTES": "0", "RINGREDUCE_SHM_BYTES": "0"},
              "ring-tiny-shm": {"RINGREDUCE_SMALL_BYTES": "0", "RINGREDUCE_SHM_BYTES": "1001"}}


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    cache = {}

    def get(n, algorithm):
        if (n, algorithm) not in cache:
            ranks = run_ranks(n, """
                from cases import check_all_allreduce
                result = check_all_allreduce(rr)
            """, tmp_path_factory.mktemp(f"allreduce{n}{algorithm}"), timeout=300, env=ALGORITHMS[algorithm])
            cache[n, algorithm] = [r.result for r in ranks]
        return cache[n, algorithm]
    return get


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_matches_numpy_on_every_rank(world_results, n, dtype, op, algorithm):
    per_rank = world_results(n, algorithm)
    cases = [k for k in per_rank[0] if k[0] == dtype and k[1] == op]
    assert len(cases) >= 4
    for case in cases:
        for r, results in enumerate(per_rank):
            ok, digest, got_dtype, shape = results[case]
            assert ok, f"rank {r} of {n}: {case} differs from numpy"
            assert got_dtype == np_dtype(dtype).name and shape == case[2], f"rank {r}: {case} returned {got_dtype}{shape}"
            assert digest == per_rank[0][case][1], f"rank {r} of {n}: {case} not bit-identical to rank 0"


@pytest.mark.parametrize("n", [2, 3, 5])
def test_ten_million_elements(tmp_path, n):
    ranks = run_ranks(n, """
        from cases import digest
        x = np.arange(10_000_000, dtype=np.float32) % 1000 + rr.rank()
        y = rr.allreduce(x)
        want = (np.arange(10_000_000, dtype=np.float32) % 1000) * rr.size() + sum(range(rr.size()))
        big = np.full(10_000_001, rr.rank() + 1, dtype=np.int64)
        z = rr.allreduce(big, op="max")
        result = (bool(np.array_equal(y, want)), digest(y), bool((z == rr.size()).all()))
    """, tmp_path, timeout=240)
    for r in ranks:
        assert r.result[0], f"rank {r.rank}: 10M float32 sum differs from numpy"
        assert r.result[1] == ranks[0].result[1], f"rank {r.rank}: not bit-identical"
        assert r.result[2], f"rank {r.rank}: 10M int64 max wrong"


def test_random_floats_within_rounding(tmp_path):
    """Real-valued inputs: sums agree with numpy to float32 rounding, and bits agree across ranks."""
    ranks = run_ranks(4, """
        from cases import digest
        xs = [np.random.default_rng(i).standard_normal(300_007).astype(np.float32) for i in range(rr.size())]
        y = rr.allreduce(xs[rr.rank()], op="avg")
        want = np.mean(np.stack(xs).astype(np.float64), axis=0)
        result = (float(np.max(np.abs(y - want))), digest(y))
    """, tmp_path)
    for r in ranks:
        assert r.result[0] < 1e-5, f"rank {r.rank}: error {r.result[0]}"
        assert r.result[1] == ranks[0].result[1]
