"""The world of an srun step without PMI (ringreduce/core/slurm.py), read from
the environment Slurm gives each task: hostlists and tasks-per-node lists
expanded, the rendezvous port derived from the job and step, the job secret
derived from a user-private key, salloc's shell and a batch script a world
of one, a step that does not add up refused on every rank, and ringrun's
hosts inside an allocation. tests/test_slurm_cluster.py runs the same on a
real Slurm."""
import multiprocessing
import os
import stat
import subprocess
import sys

import pytest

import ringreduce as rr
from ranks import REPO
from ringreduce.core import slurm, world
from ringreduce.launch import ringrun


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("a,b", ["a", "b"]),
    ("node[01-04,07],gpu-[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-1", "gpu-2"]),
    ("x[8-10]", ["x8", "x9", "x10"]),                      # no padding: the numbers grow
    ("y[098-101]", ["y098", "y099", "y100", "y101"]),      # padding follows the first number
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),    # several brackets multiply out
    ("pre[3]post,z", ["pre3post", "z"]),
    ("", []),
])
def test_a_hostlist_expands_in_slurms_order(text, names):
    assert slurm.expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["node[1-", "node1]", "node[3-1]", "node[a]", "node[1-2", "a,,b",
                                  "n[[1]]", "n[1--2]"])
def test_a_malformed_hostlist_is_refused(text):
    with pytest.raises(ValueError, match="hostlist"):
        slurm.expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])])
def test_tasks_per_node_expand(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(x)", "x", "2(3)", "", "2,"])
def test_malformed_tasks_per_node_are_refused(text):
    with pytest.raises(ValueError, match="tasks per node"):
        slurm.expand_tasks_per_node(text)


def test_the_port_is_derived_in_its_range_and_steps_of_nearby_jobs_never_share_one():
    ports = {(j, s): slurm.step_port(j, s) for j in range(1000, 1625) for s in range(slurm.STEP_STRIDE)}
    assert all(slurm.PORT_RANGE[0] <= p <= slurm.PORT_RANGE[1] for p in ports.values())
    assert len(set(ports.values())) == len(ports)
    assert slurm.PORT_RANGE[1] < 32768  # below the kernel's default ephemeral ports
    assert slurm.step_port(123456789, 3) == slurm.step_port(123456789, 3)


def step_env(home, rank=3, **over):
    """The task environment srun gives rank `rank` of `srun -N2 -n4` (job 17, step 0)."""
    env = {"SLURM_PROCID": str(rank), "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "17", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_NTASKS": "4", "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2),
           "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODELIST": "n[1-2]",
           "SLURM_TASKS_PER_NODE": "2(x2)", "HOME": str(home)}
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


@pytest.fixture
def names_as_addresses(monkeypatch):
    """node_address asks scontrol (tests/test_slurm_cluster.py); here a node's name is its address."""
    monkeypatch.setattr(slurm, "node_address", lambda name: f"addr-of-{name}")


def test_an_srun_task_forms_the_steps_world(tmp_path, names_as_addresses):
    worlds = [world.discover(step_env(tmp_path, r)) for r in range(4)]
    assert [(w.rank, w.size, w.local_rank, w.local_size, w.source) for w in worlds] == [
        (0, 4, 0, 2, "srun"), (1, 4, 1, 2, "srun"), (2, 4, 0, 2, "srun"), (3, 4, 1, 2, "srun")]
    assert {w.addr for w in worlds} == {("addr-of-n1", slurm.step_port(17, 0))}
    assert len({w.secret for w in worlds}) == 1 and len(worlds[0].secret) >= 32


def test_uneven_steps_read_the_local_size_of_their_node(tmp_path, names_as_addresses):
    """srun -n 7 over nodes of 2, 2, 2 and 1 tasks: rank 6 is alone on gpu-1."""
    env = step_env(tmp_path, 6, SLURM_STEP_NUM_TASKS="7", SLURM_LOCALID="0", SLURM_NODEID="3",
                   SLURM_STEP_NODELIST="node[01-03],gpu-1", SLURM_STEP_TASKS_PER_NODE="2(x3),1")
    w = world.discover(env)
    assert (w.rank, w.size, w.local_rank, w.local_size, w.addr[0]) == (6, 7, 0, 1, "addr-of-node01")


def test_the_steps_size_falls_back_to_slurm_ntasks_and_its_layout_to_the_job_variables(tmp_path,
                                                                                       names_as_addresses):
    env = step_env(tmp_path, 1, SLURM_STEP_NUM_TASKS=None, SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None)
    w = world.discover(env)
    assert (w.rank, w.size, w.local_rank, w.local_size) == (1, 4, 1, 2)


def test_ringreduce_port_and_addr_override_the_derived_rendezvous(tmp_path, names_as_addresses):
    assert world.discover(step_env(tmp_path, RINGREDUCE_PORT="4242")).addr == ("addr-of-n1", 4242)
    assert world.discover(step_env(tmp_path, RINGREDUCE_ADDR="10.1.2.3:555")).addr == ("10.1.2.3", 555)
    with pytest.raises(rr.RingReduceError, match="RINGREDUCE_PORT=70000"):
        world.discover(step_env(tmp_path, RINGREDUCE_PORT="70000"))


@pytest.mark.parametrize("env", [
    # salloc's shell: an allocation, no step
    {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]", "SLURM_NTASKS": "4",
     "SLURM_NPROCS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NUM_NODES": "2"},
    # a batch script: SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step
    {"SLURM_JOB_ID": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]", "SLURM_NTASKS": "4",
     "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2(x2)"},
    # the batch step's and the extern step's special ids
    {"SLURM_JOB_ID": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967294", "SLURM_NTASKS": "4"},
    {"SLURM_JOB_ID": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967292", "SLURM_NTASKS": "4"},
    # a step of one task
    {"SLURM_JOB_ID": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "1",
     "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n1",
     "SLURM_STEP_TASKS_PER_NODE": "1"},
])
def test_an_allocation_without_an_srun_step_is_a_world_of_one(env):
    w = world.discover(env)
    assert (w.rank, w.size, w.source) == (0, 1, "single process")


@pytest.mark.parametrize("over, says", [
    ({"SLURM_STEP_NODELIST": None, "SLURM_NODELIST": None}, "SLURM_STEP_NODELIST is not set"),
    ({"SLURM_LOCALID": None}, "SLURM_LOCALID is not set"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,1"}, "do not add up"),
    ({"SLURM_STEP_NODELIST": "n[1-3]"}, "do not add up"),
    ({"SLURM_LOCALID": "2"}, "do not add up"),
    ({"SLURM_NODEID": "2"}, "do not add up"),
    ({"SLURM_STEP_NODELIST": "n[1-"}, "rank 3: cannot read the srun step's layout"),
    ({"SLURM_PROCID": "three"}, "SLURM_PROCID='three' is not an integer"),
    ({"SLURM_DISTRIBUTION": "arbitrary"}, "arbitrary .* RINGREDUCE_ADDR"),
])
def test_a_step_that_does_not_add_up_is_refused_naming_what(tmp_path, names_as_addresses, over, says):
    with pytest.raises(rr.RingReduceError, match=says):
        world.discover(step_env(tmp_path, **over))


def test_rank_0_off_the_first_node_is_refused(tmp_path, names_as_addresses):
    """Every rank looks for rank 0 on the step's first node."""
    env = step_env(tmp_path, 0, SLURM_NODEID="1", SLURM_LOCALID="0")
    with pytest.raises(rr.RingReduceError, match="rank 0 runs on node 1 .* RINGREDUCE_ADDR"):
        world.discover(env)
    assert world.discover({**env, "RINGREDUCE_ADDR": "n2:1234"}).addr == ("n2", 1234)


@pytest.mark.parametrize("name", ["RINGREDUCE_SIZE", "RINGREDUCE_LOCAL_RANK"])
def test_a_half_set_ringreduce_world_under_srun_is_still_refused(tmp_path, name):
    with pytest.raises(rr.RingReduceError, match="RINGREDUCE_RANK"):
        world.discover(step_env(tmp_path, **{name: "1"}))


def test_the_secret_is_per_step_from_a_private_key_made_once(tmp_path, names_as_addresses):
    a = world.discover(step_env(tmp_path)).secret
    key = tmp_path / slurm.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert world.discover(step_env(tmp_path, 1)).secret == a                     # another task of the step
    assert world.discover(step_env(tmp_path, SLURM_STEP_ID="1")).secret != a     # another step
    assert world.discover(step_env(tmp_path, SLURM_JOB_ID="18")).secret != a     # another job
    other_home = tmp_path / "other"
    other_home.mkdir()
    assert world.discover(step_env(other_home)).secret != a                      # another key
    own = world.discover(step_env(tmp_path, RINGREDUCE_SECRET="s3cret")).secret
    assert own == world.discover(step_env(tmp_path, 1, RINGREDUCE_SECRET="s3cret")).secret  # every task's
    assert own not in (a, b"s3cret")


def test_steps_sharing_a_users_secret_and_a_derived_port_never_share_a_world(tmp_path, names_as_addresses):
    """Step 16 of job 17 and step 0 of job 18 meet on one port; with the user's
    RINGREDUCE_SECRET exported in both jobs they must still never pass each
    other's handshake (else their ranks could fill one ring: silently wrong)."""
    a = world.discover(step_env(tmp_path, SLURM_STEP_ID="16", RINGREDUCE_SECRET="s3cret"))
    b = world.discover(step_env(tmp_path, SLURM_JOB_ID="18", SLURM_STEP_ID="0", RINGREDUCE_SECRET="s3cret"))
    assert a.addr == b.addr
    assert a.secret != b.secret


def test_a_process_a_task_starts_is_refused_not_left_to_time_out(tmp_path, names_as_addresses):
    """A subprocess (or fork) of a task inherits its SLURM_* variables but is no
    task of the step: it is refused at once, naming the way out, while the task
    itself may read its world again and a nested srun step is a world of its own."""
    env = step_env(tmp_path, 0)
    assert world.discover(env).rank == 0
    assert env[slurm.CLAIM_ENV] == f"17.0:{os.getpid()}"
    assert world.discover(env).rank == 0  # the task itself, again (init after shutdown)
    child = {**env, slurm.CLAIM_ENV: f"17.0:{os.getpid() + 1}"}  # what a child of process pid+1 inherits
    with pytest.raises(rr.RingReduceError, match=r"inherited the srun environment of rank 0 of Slurm step 17\.0.*"
                                                 r"RINGREDUCE_RANK=0 RINGREDUCE_SIZE=1"):
        world.discover(child)
    assert world.discover({**child, "SLURM_STEP_ID": "1"}).size == 4  # a nested srun's own step
    assert world.discover({**child, "RINGREDUCE_RANK": "0", "RINGREDUCE_SIZE": "1"}).size == 1


def _discover_in_fork(env):
    try:
        world.discover(env)
    except rr.RingReduceError as exc:
        return str(exc)
    return "joined"


def test_a_forked_child_of_a_task_is_refused(tmp_path, names_as_addresses):
    env = step_env(tmp_path, 2)
    world.discover(env)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        said = pool.apply(_discover_in_fork, (env,))
    assert "inherited the srun environment of rank 2" in said


def test_a_key_others_can_read_is_refused(tmp_path, names_as_addresses):
    world.discover(step_env(tmp_path))
    key = tmp_path / slurm.KEY_FILE
    key.chmod(0o644)
    with pytest.raises(rr.RingReduceError, match="chmod 600"):
        world.discover(step_env(tmp_path))


def test_without_a_home_for_the_key_the_error_says_to_set_the_secret(tmp_path, names_as_addresses):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(rr.RingReduceError, match="rank 3: no job secret.*RINGREDUCE_SECRET"):
        world.discover(step_env(blocker))


def _key_of(home):
    return slurm.user_key(home)


def test_tasks_making_the_key_at_once_all_read_one_key(tmp_path):
    """The first run of a job: every task finds no key and makes one; a hard link decides whose holds."""
    with multiprocessing.get_context("fork").Pool(8) as pool:
        keys = pool.map(_key_of, [str(tmp_path)] * 16)
    assert len(set(keys)) == 1
    assert os.listdir(tmp_path / os.path.dirname(slurm.KEY_FILE)) == ["slurm.key"]  # no temporary left


# ringrun inside an allocation (salloc's shell, a batch script) starts its
# ranks on the allocation's nodes, filling them in order.
ALLOC = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}


def test_ringrun_in_an_allocation_takes_its_hosts():
    assert ringrun.allocation_hosts(ALLOC, 4) == ["n1", "n1", "n2", "n2"]
    assert ringrun.allocation_hosts(ALLOC, 3) == ["n1", "n1", "n2"]
    assert ringrun.allocation_hosts({**ALLOC, "SLURM_JOB_NODELIST": "gpu[1-3]", "SLURM_TASKS_PER_NODE": "1,2(x2)"},
                                    5) == ["gpu1", "gpu2", "gpu2", "gpu3", "gpu3"]
    with pytest.raises(SystemExit, match="gives 4 slots but -np asks for 5"):
        ringrun.allocation_hosts(ALLOC, 5)


@pytest.mark.parametrize("env", [
    {},                                                                   # no allocation
    {**ALLOC, "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},                 # in an srun step: as outside
    {**ALLOC, "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "1",   # a batch script on its only node
     "SLURMD_NODENAME": "n1"},
])
def test_ringrun_outside_an_allocation_or_on_its_only_node_starts_ranks_here(env):
    assert ringrun.allocation_hosts(env, 8) is None


def test_ringrun_ranks_on_other_nodes_start_over_srun_passing_the_environment():
    argv = ringrun.rank_argv("n2", {"RINGREDUCE_RANK": "2"}, ["python", "t.py"], "ssh", srun=True)
    assert argv[0] == "srun"
    assert "--nodelist=n2" in argv and "--export=ALL" in argv and "--ntasks=1" in argv
    assert argv[-2:] == ["python", "t.py"]
    assert ringrun.rank_argv("localhost", {}, ["python"], "ssh", srun=True)[0] != "srun"


def test_the_slurm_cluster_tests_fail_under_ci_where_slurm_is_missing():
    import slurm_cluster
    assert slurm_cluster.when_missing("srun not installed", {"CI": "true"}) == "fail"
    assert slurm_cluster.when_missing("srun not installed", {}) == "skip"
    assert slurm_cluster.when_missing(None, {"CI": "true"}) is None


def test_ringrun_as_one_of_several_srun_tasks_is_refused_not_a_world_per_task(tmp_path):
    """srun -n2 ringrun -np 4: each task's ringrun would train a world of 4 alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGREDUCE_", "SLURM_"))}
    env.update(step_env(tmp_path, 1), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, "-c", "1"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode != 0
    assert "one of 4 tasks of an srun step" in run.stderr and "srun -n1 ringrun" in run.stderr
    one = {**env, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1"}
    run = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable, "-c", "1"],
                         capture_output=True, text=True, timeout=60, env=one)
    assert run.returncode == 0, run.stderr  # srun -n1 ringrun: its ranks start here
