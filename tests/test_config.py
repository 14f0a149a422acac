"""Settings that make no sense are refused at init(), naming the variable."""
import math
import os
import re

import pytest

import ringreduce as rr
from ranks import REPO, run_ranks
from ringreduce.core.config import Config

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
    "RINGREDUCE_CUDA_IPC": ["2", "yes", "off"],
}


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD.items() for v in vs])
def test_a_setting_that_makes_no_sense_names_itself(name, value):
    with pytest.raises(ValueError, match=name):
        Config.from_env({name: value})


def test_cuda_ipc_is_on_by_default_and_zero_turns_it_off():
    assert Config.from_env({}).cuda_ipc is True
    assert Config.from_env({"RINGREDUCE_CUDA_IPC": "1"}).cuda_ipc is True
    assert Config.from_env({"RINGREDUCE_CUDA_IPC": "0"}).cuda_ipc is False


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


# RINGREDUCE_START_TIMEOUT=inf (or 1e300, or beyond a week) is refused at
# init(), naming the variable, on every rank alike (all read the same
# setting): no rank may die of an OverflowError naming no setting while
# rank 0 waits for it for ever.
@pytest.mark.parametrize("value", ["inf", "1e300", "604801"])
def test_an_endless_start_timeout_is_refused_naming_it(value):
    from ringreduce.core.config import Config
    with pytest.raises(ValueError, match=re.escape(f"RINGREDUCE_START_TIMEOUT={float(value)!r} makes no sense")):
        Config.from_env({"RINGREDUCE_START_TIMEOUT": value})
    assert Config.from_env({"RINGREDUCE_START_TIMEOUT": "604800"}).start_timeout == 604800


def test_a_long_start_timeout_still_joins(tmp_path):
    ranks = run_ranks(2, "result = rr.allreduce(np.ones(2)).tolist()", tmp_path, timeout=60,
                      env={"RINGREDUCE_START_TIMEOUT": "604800"})
    assert [x.result for x in ranks] == [[2.0, 2.0]] * 2


def test_a_misspelt_setting_is_warned_about_with_the_name_meant(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_TIMOUT", "5")
    monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", "65536")
    for name in [n for n in os.environ if n.startswith(("RINGREDUCE_RANK", "RINGREDUCE_SIZE", "RINGREDUCE_ADDR"))]:
        monkeypatch.delenv(name)
    rr.shutdown()
    with pytest.warns(UserWarning, match="RINGREDUCE_TIMOUT.*RINGREDUCE_TIMEOUT") as caught:
        rr.init()
    rr.shutdown()
    assert not any("SEGMENT" in str(w.message) for w in caught)


def test_every_setting_the_code_reads_is_a_known_name():
    """A new RINGREDUCE_* variable must join config.KNOWN_NAMES, or setting it warns as a typo."""
    import re
    from ringreduce.core import config
    sources = [*(REPO / "ringreduce").rglob("*.py"), REPO / "setup.py"]
    read = {m for p in sources for m in re.findall(r"[\"'](RINGREDUCE_[A-Z0-9_]+)[\"']", p.read_text())}
    assert read and read <= config.KNOWN_NAMES, sorted(read - config.KNOWN_NAMES)
