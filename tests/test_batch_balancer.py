"""ringreduce.balance.BatchBalancer: shares of the global batch move toward
each rank's measured speed, every `every` steps, identically on every rank;
integer shares, at least min_batch, summing to the global batch. Step times
are injected (record()), never measured, so the tests are deterministic."""
import pytest

from ringreduce.balance import apportion


@pytest.mark.parametrize("total, weights, least, want", [
    (10, [1, 1], 1, (5, 5)),
    (11, [1, 1], 1, (6, 5)),            # a tie goes to the lower rank
    (50, [2, 2, 1], 1, (20, 20, 10)),
    (7, [1, 1, 1], 1, (3, 2, 2)),
    (10, [1000, 1, 1], 2, (6, 2, 2)),   # min_batch holds; the rest goes by weight
    (4, [5, 0, 0, 0], 1, (1, 1, 1, 1)),
    (100, [3, 1], 1, (75, 25)),
])
def test_apportion(total, weights, least, want):
    got = apportion(total, weights, least)
    assert got == want
    assert sum(got) == total and min(got) >= least


def test_apportion_sums_and_bounds_over_many_cases():
    import random
    rng = random.Random(3)
    for _ in range(2000):
        n = rng.randint(1, 8)
        least = rng.randint(1, 4)
        total = rng.randint(n * least, 500)
        weights = [rng.random() * rng.choice([1, 10, 1000]) for _ in range(n)]
        got = apportion(total, weights, least)
        assert sum(got) == total and min(got) >= least and len(got) == n
        ideal = [total * w / sum(weights) for w in weights]
        for g, i in zip(got, ideal):  # within one of proportional, unless min_batch lifted some
            assert g >= least and (g <= max(i + 1, least) or any(x < least for x in ideal))


CONVERGE = """
from ringreduce.balance import BatchBalancer
n, r = rr.size(), rr.rank()
# rank n-1 is twice as slow per sample: injected compute seconds, proportional to its batch
per_sample = [0.001] * (n - 1) + [0.002]
bal = BatchBalancer(global_batch_size=60, every=5, smoothing=0.5)
start = bal.shares
changes = []
for step in range(60):
    lo, hi = bal.rows(step)
    assert hi - lo == bal.local_batch_size
    bal.record(per_sample[r] * bal.local_batch_size)
    if bal.step():
        changes.append(step)
result = (start, bal.shares, bal.history, changes, [round(e, 6) for e in bal.estimates])
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shares_converge_to_measured_speed_on_every_rank(world_pool, n):
    ranks = world_pool.run(n, CONVERGE, timeout=120)
    start, final, history, changes, estimates = ranks[0].result
    assert sum(start) == 60 and max(start) - min(start) <= 1  # equal to begin with
    # throughput 1000 samples/s, the slow rank 500: shares 2:...:2:1
    want = apportion(60, [2] * (n - 1) + [1])
    assert final == want, (final, want)
    assert estimates == [1000.0] * (n - 1) + [500.0]
    assert changes and changes[0] == 4  # the first exchange, after `every` steps, already moves them
    for rk in ranks[1:]:
        assert rk.result == ranks[0].result  # every rank decided the same, at the same steps


SMOOTHED = """
from ringreduce.balance import BatchBalancer
r = rr.rank()
bal = BatchBalancer(global_batch_size=100, every=2, smoothing=0.75, min_batch=5)
seen = []
for step in range(40):
    # rank 1 is 3x slower from step 10 on (an injected slowdown); before that all alike
    slow = 3.0 if (r == 1 and step >= 10) else 1.0
    bal.record(0.01 * slow * bal.local_batch_size)
    bal.step()
    seen.append(bal.shares)
result = seen
"""


def test_smoothed_shares_move_gradually_toward_the_slowdown(world_pool):
    ranks = world_pool.run(2, SMOOTHED, timeout=120)
    seen = ranks[0].result
    assert ranks[1].result == seen
    assert all(sum(s) == 100 and min(s) >= 5 for s in seen)
    assert seen[9] == (50, 50)  # no slowdown yet: equal speeds keep equal shares
    slow_share = [s[1] for s in seen[10:]]
    # smoothing: the slow rank's share falls over several exchanges, not at once, never rising, toward 25
    assert slow_share[1] > 25 and slow_share[-1] in (25, 26)
    assert all(b <= a for a, b in zip(slow_share, slow_share[1:]))
    assert len(set(slow_share)) > 3


VALIDATION = """
from ringreduce.balance import BatchBalancer
r = rr.rank()
out = {}
bal = BatchBalancer(global_batch_size=[10, 10, 12][r], every=1)
bal.record(0.1)
try:
    bal.step()
    out["global"] = "ok"
except ValueError as e:
    out["global"] = str(e)
def local(fn):
    try:
        fn()
        return "ok"
    except ValueError as e:
        return str(e)
b = BatchBalancer(global_batch_size=9, every=3)
out["negative seconds"] = local(lambda: b.record(-1.0))
out["nan seconds"] = local(lambda: b.record(float("nan")))
out["too small"] = local(lambda: BatchBalancer(global_batch_size=5, min_batch=2))
out["bad shares"] = local(lambda: BatchBalancer(global_batch_size=9, shares=[3, 3, 2]))
out["bad smoothing"] = local(lambda: BatchBalancer(global_batch_size=9, smoothing=1.0))
# a rank that measured nothing keeps the shares where they are (no estimate for it yet)
c = BatchBalancer(global_batch_size=9, every=1)
if r != 0:
    c.record(0.5)
c.step()
out["unmeasured"] = c.shares
result = out
"""


def test_validation(world_pool):
    ranks = world_pool.run(3, VALIDATION, timeout=120)
    for rk in ranks:
        out = rk.result
        assert "disagree on global_batch_size" in out["global"] and "rank 2 has 12" in out["global"]
        for key in ("negative seconds", "nan seconds", "too small", "bad shares", "bad smoothing"):
            assert out[key] != "ok", key
        assert out["unmeasured"] == (3, 3, 3)
