"""allreduce against numpy: every dtype and op, odd sizes, several world sizes;
every rank must end with the same bits."""
import numpy as np
import pytest

from cases import DTYPES, OPS, np_dtype
from ringreduce.core.config import MAX_SMALL_BYTES

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
def world_results(world_pool):
    cache = {}

    def get(n, algorithm):
        if (n, algorithm) not in cache:
            ranks = world_pool.run(n, """
                from cases import check_all_allreduce
                result = check_all_allreduce(rr)
            """, timeout=300, env=ALGORITHMS[algorithm])
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
def test_ten_million_elements(world_pool, n):
    ranks = world_pool.run(n, """
        from cases import digest
        x = np.arange(10_000_000, dtype=np.float32) % 1000 + rr.rank()
        y = rr.allreduce(x)
        want = (np.arange(10_000_000, dtype=np.float32) % 1000) * rr.size() + sum(range(rr.size()))
        big = np.full(10_000_001, rr.rank() + 1, dtype=np.int64)
        z = rr.allreduce(big, op="max")
        result = (bool(np.array_equal(y, want)), digest(y), bool((z == rr.size()).all()))
    """, timeout=240)
    for r in ranks:
        assert r.result[0], f"rank {r.rank}: 10M float32 sum differs from numpy"
        assert r.result[1] == ranks[0].result[1], f"rank {r.rank}: not bit-identical"
        assert r.result[2], f"rank {r.rank}: 10M int64 max wrong"


def test_random_floats_within_rounding(world_pool):
    """Real-valued inputs: sums agree with numpy to float32 rounding, and bits agree across ranks."""
    ranks = world_pool.run(4, """
        from cases import digest
        xs = [np.random.default_rng(i).standard_normal(300_007).astype(np.float32) for i in range(rr.size())]
        y = rr.allreduce(xs[rr.rank()], op="avg")
        want = np.mean(np.stack(xs).astype(np.float64), axis=0)
        result = (float(np.max(np.abs(y - want))), digest(y))
    """)
    for r in ranks:
        assert r.result[0] < 1e-5, f"rank {r.rank}: error {r.result[0]}"
        assert r.result[1] == ranks[0].result[1]


# 16-bit averages at the edges of the range. Each rank builds every rank's
# input from its rank, returns its allreduce and its reduce_scatter chunk.
EDGE16_BODY = """
import ml_dtypes
from cases import np_dtype
n, r = rr.size(), rr.rank()
out = {}
for dtype in ["float16", "bfloat16"]:
    info = ml_dtypes.finfo(np_dtype(dtype))
    big, tiny = float(info.max), float(info.smallest_subnormal)
    g = np.random.default_rng([r, len(dtype)])
    top = 2.0 ** int(np.log2(big))  # the top binade [top, max]: one ulp throughout
    columns = {
        "40000": np.full(7, 40000.0 if dtype == "float16" else 3.0e38),
        "max": np.full(7, big),
        "-max": np.full(7, -big),
        "+-max": np.full(7, big if r % 2 else -big),
        "tiny": np.full(7, tiny),
        "tinies": np.full(7, tiny * (r + 1)),
        "random top": g.uniform(top, big, 3001),
        "random ones": g.uniform(1, 2, 3001),
        "random subnormal": np.round(g.uniform(0, 1023 if dtype == "float16" else 127, 3001)) * tiny,
    }
    for key, values in columns.items():
        x = values.astype(np_dtype(dtype))
        out[dtype, key] = (x, rr.allreduce(x, op="avg"), rr.reduce_scatter(x, op="avg"))
result = out
"""


def ordinal16(a: np.ndarray) -> np.ndarray:
    """16-bit floats as integers in value order, so ulps between them subtract."""
    b = a.view(np.uint16).astype(np.int64)
    return np.where(b & 0x8000, -(b & 0x7FFF), b)


@pytest.mark.parametrize("algorithm", ["ring", "small"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_16_bit_average_keeps_the_range_and_the_mean(world_pool, n, algorithm):
    """float16/bfloat16 avg never overflows (40000 + 40000 is inf in float16)
    nor flushes subnormals: equal inputs give themselves back, N = 2 gives the
    correctly rounded mean, N > 2 within one ulp of it here (inputs of one
    binade; +max and -max alternating cancel, within the general bound);
    every rank, allreduce and reduce_scatter, the same bits."""
    from cases import close_enough
    from test_kernels import nearest16
    ranks = world_pool.run(n, EDGE16_BODY, env=ALGORITHMS[algorithm], timeout=180)
    for (dtype, key), (_, first, _) in ranks[0].result.items():
        inputs = [r.result[dtype, key][0] for r in ranks]
        want = nearest16(np.mean(np.stack([x.astype(np.float64) for x in inputs]), axis=0), dtype)
        assert np.isfinite(first.astype(np.float64)).all(), f"n={n} {dtype} {key}: {first!r}"
        if key == "+-max" and n > 3:  # cancellation: the general bound (docs/architecture.md)
            assert close_enough(first, want, dtype, "avg", inputs), f"n={n} {dtype} {key}: {first!r}"
            continue
        off = np.abs(ordinal16(first) - ordinal16(want))
        allowed = 0 if n == 2 or key in ("40000", "max", "-max", "tiny", "+-max") else 1
        assert off.max() <= allowed, \
            f"n={n} {dtype} {key}: {first[off.argmax()]!r}, the mean is {want[off.argmax()]!r}"
        for r in ranks:
            _, mine, chunk = r.result[dtype, key]
            assert mine.tobytes() == first.tobytes(), f"rank {r.rank}: {dtype} {key} not bit-identical to rank 0"
            lo = sum(first.size // n + (i < first.size % n) for i in range(r.rank))
            assert chunk.tobytes() == first[lo:lo + chunk.size].tobytes(), f"rank {r.rank}: {dtype} {key} chunk"
