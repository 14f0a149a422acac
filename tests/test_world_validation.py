"""World discovery (ringreduce/core/world.py discover) refuses an environment it
cannot trust, naming the variable, instead of running a world of one where
a launcher meant N: half-set worlds, other launchers' worlds, srun steps
that cannot be read, launcher variables that are not integers, nonsense addresses."""
import re

import pytest

import ringreduce as rr


# Launched the Horovod or torch way (horovodrun's gloo mode, torchrun) with
# N ranks meant, each process finds no ringreduce world: it raises, naming
# the launcher and what to use, instead of training alone as a world of one.
@pytest.mark.parametrize("env", [
    {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "4",
     "HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"},
    {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
     "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"},
])
def test_another_launchers_world_of_n_is_not_a_silent_world_of_one(env):
    from ringreduce.errors import RingReduceError
    from ringreduce.core.world import discover
    with pytest.raises(RingReduceError, match="ringrun -np 4"):
        discover(env)
    one = {k: "1" if k in ("HOROVOD_SIZE", "WORLD_SIZE") else "0" if "RANK" in k else v for k, v in env.items()}
    assert discover(one).size == 1  # a launcher's world of one is one


@pytest.mark.parametrize("name", ["RINGREDUCE_RANK", "RINGREDUCE_SIZE", "RINGREDUCE_LOCAL_RANK", "PMI_RANK"])
def test_a_launcher_variable_that_is_not_an_integer_is_named(name):
    from ringreduce.errors import RingReduceError
    from ringreduce.core.world import discover
    env = {"RINGREDUCE_RANK": "0", "RINGREDUCE_SIZE": "1"} if name.startswith("RINGREDUCE") else {}
    env[name] = "one"
    with pytest.raises(RingReduceError, match=f"{name}='one' is not an integer"):
        discover(env)


# RINGREDUCE_ADDR needs a port of 1 .. 65535 (99999 would be an OverflowError
# naming no setting, 0 a random port no rank knows), and a local rank must lie
# in 0 .. local size - 1 (GPU picking uses it): each is refused, named.
@pytest.mark.parametrize("env, says", [
    ({"RINGREDUCE_ADDR": "127.0.0.1:99999"}, "RINGREDUCE_ADDR must be host:port with a port of 1 .. 65535"),
    ({"RINGREDUCE_ADDR": "127.0.0.1:0"}, "RINGREDUCE_ADDR must be host:port with a port of 1 .. 65535"),
    ({"RINGREDUCE_LOCAL_RANK": "5", "RINGREDUCE_LOCAL_SIZE": "2"}, "RINGREDUCE_LOCAL_RANK=5 needs"),
    ({"RINGREDUCE_LOCAL_RANK": "-1"}, "RINGREDUCE_LOCAL_RANK=-1 needs"),
])
def test_a_nonsensical_address_or_local_rank_is_named(env, says):
    from ringreduce.errors import RingReduceError
    from ringreduce.core.world import discover
    with pytest.raises(RingReduceError, match=re.escape(says)):
        discover({"RINGREDUCE_RANK": "1", "RINGREDUCE_SIZE": "2", "RINGREDUCE_ADDR": "127.0.0.1:1234", **env})


@pytest.mark.parametrize("env", [{"RINGREDUCE_SIZE": "4"},
                                 {"RINGREDUCE_ADDR": "127.0.0.1:29500", "RINGREDUCE_SIZE": "2"},
                                 {"RINGREDUCE_LOCAL_RANK": "1"}])
def test_a_half_set_world_is_an_error_not_a_world_of_one(env):
    """RINGREDUCE_SIZE=4 without RINGREDUCE_RANK meant 4 ranks: each process
    training alone as a world of one would be silently wrong."""
    from ringreduce.core import world
    with pytest.raises(rr.RingReduceError, match="RINGREDUCE_RANK"):
        world.discover(env)


def test_no_launcher_at_all_is_a_world_of_one():
    from ringreduce.core import world
    w = world.discover({"HOME": "/root", "RINGREDUCE_SECRET": "s"})
    assert (w.rank, w.size, w.source) == (0, 1, "single process")


def test_an_srun_step_that_cannot_be_read_is_an_error_not_n_worlds_of_one():
    """srun's tasks whose step id is missing (so not a world ringreduce can read,
    tests/test_slurm_world.py): every task would train alone."""
    from ringreduce.core import world
    with pytest.raises(rr.RingReduceError, match="srun"):
        world.discover({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4"})
    w = world.discover({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})  # a batch script's own step
    assert (w.rank, w.size) == (0, 1)


def test_srun_with_pmix_gives_the_size_of_the_step():
    """srun --mpi=pmix sets PMIX_RANK but no PMI_SIZE: rank 3 must not be a rank of a world of one."""
    from ringreduce.core import world
    w = world.discover({"PMIX_RANK": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"})
    assert (w.rank, w.size, w.source) == (3, 4, "mpirun")
