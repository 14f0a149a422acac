"""The emulated cluster: namespaces that stand in for hosts, torn down after."""
import secrets
import subprocess
import sys

import pytest

from ranks import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import Cluster, can_build  # noqa: E402

REASON = can_build()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cannot make network namespaces here: {REASON}")

ALLREDUCE = """
import numpy as np, ringreduce as rr
rr.init()
y = rr.allreduce(np.full(1 << 18, rr.rank() + 1.0, dtype=np.float32))   # 1 MiB
print(rr.rank(), float(y.min()), float(y.max()))
"""


def test_two_hosts_allreduce_then_everything_is_gone():
    cluster = Cluster(2)
    with cluster:
        assert len(set(cluster.addresses)) == 2
        secret = secrets.token_hex(16)
        procs = [cluster.popen(i, [sys.executable, "-c", ALLREDUCE],
                               {**cluster.ring_env(i, 29400, secret), "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
        assert sorted(out.split() for out, _ in outs) == [["0", "3.0", "3.0"], ["1", "3.0", "3.0"]]
        # Hosts really are apart: each namespace sees only its own address.
        own = subprocess.run(cluster.command(1, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]),
                             capture_output=True, text=True).stdout
        assert cluster.addresses[1] in own and cluster.addresses[0] not in own
    assert cluster.leftovers() == []


def test_teardown_also_on_error():
    cluster = Cluster(2, rate="100mbit")
    with pytest.raises(RuntimeError):
        with cluster:
            qdisc = subprocess.run(cluster.command(0, ["tc", "qdisc", "show", "dev", "eth0"]),
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            raise RuntimeError("boom")
    assert cluster.leftovers() == []
