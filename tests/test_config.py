"""Settings that make no sense are refused at init(), naming the variable."""
import math

import pytest

from ringreduce.core.config import Config
from ranks import run_ranks

BAD = {
    "RINGREDUCE_TIMEOUT": ["-1", "nan", "soon"],
    "RINGREDUCE_START_TIMEOUT": ["0", "-5"],
    "RINGREDUCE_SEGMENT_BYTES": ["0", "-4", str(1 << 30), "1.5"],
    "RINGREDUCE_SMALL_BYTES": ["-1", str(80 << 20)],
    "RINGREDUCE_SPIN": ["-1"],
    "RINGREDUCE_BACKEND": ["gloo"],
    "RINGREDUCE_SHM_BYTES": ["-1", str(2 << 30)],
    "RINGREDUCE_ARENA_BYTES": ["-1", str(32 << 20), "big"],
    "RINGREDUCE_FUSION_THRESHOLD": ["-1"],
    "RINGREDUCE_CACHE_CAPACITY": ["-1", "lots", str((1 << 20) + 1)],
}


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD.items() for v in vs])
def test_a_setting_that_makes_no_sense_names_itself(name, value):
    with pytest.raises(ValueError, match=name):
        Config.from_env({name: value})


def test_timeout_zero_and_inf_mean_never_and_huge_values_stay_huge():
    assert Config.from_env({"RINGREDUCE_TIMEOUT": "0"}).ring_timeout == math.inf
    assert Config.from_env({"RINGREDUCE_TIMEOUT": "inf"}).ring_timeout == math.inf
    assert Config.from_env({"RINGREDUCE_TIMEOUT": "3000000"}).ring_timeout == 3e6
    assert Config.from_env({}).ring_timeout == 60.0


def test_cache_capacity_defaults_to_1024_and_zero_turns_it_off():
    assert Config.from_env({}).cache_capacity == 1024
    assert Config.from_env({"RINGREDUCE_CACHE_CAPACITY": "0"}).cache_capacity == 0


def test_init_refuses_a_bad_setting_on_every_rank_before_connecting(tmp_path):
    ranks = run_ranks(2, """
        try:
            rr.init()
            result = "joined"
        except ValueError as e:
            result = str(e)
    """, tmp_path, init=False, timeout=60, env={"RINGREDUCE_SMALL_BYTES": str(80 << 20)})
    for r in ranks:
        assert "RINGREDUCE_SMALL_BYTES" in r.result and "makes no sense" in r.result, r.result
