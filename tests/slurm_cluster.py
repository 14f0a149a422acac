"""A real Slurm cluster on this machine, for the tests of ringreduce under Slurm.

    cluster = SlurmCluster(tmp_dir).start()     # munged, slurmctld, slurmd x 2
    subprocess.run(["srun", "-N2", "-n4", ...], env=cluster.env)
    cluster.stop()

Two nodes, n1 and n2 (2 CPUs each), are two slurmd daemons on this host
(`slurmd -N n1`, `slurmd -N n2`, each on its own port; NodeAddr=127.0.0.1),
so a job of 4 tasks spans two Slurm nodes with two tasks on each. Everything
lives under the given folder: its own munge key and socket, slurm.conf
(SLURM_CONF in `env`), state, spool and logs; nothing is written to /etc.
The daemons run as root (Debian's slurm-wlm and munge: .ci/run installs them).

why_not() says why no cluster can be made here (None: it can); under CI that
is a failure, elsewhere a skip (slurm_cluster fixture in test_slurm_cluster.py).
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ringreduce.core import slurm

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "scontrol", "sinfo")
NODES = ("n1", "n2")
CPUS = 2


def which(name: str) -> str | None:
    """A Slurm or munge program, in PATH or the sbin folders a user's PATH may lack."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def why_not() -> str | None:
    missing = [d for d in DAEMONS if which(d) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install -y --no-install-recommends slurm-wlm munge, "
                "as .ci/run does)")
    if os.geteuid() != 0:
        return "the Slurm daemons of the test cluster run as root"
    return None


def _free_ports(n: int) -> list[int]:
    """n free ports above the range of derived rendezvous ports (slurm.PORT_RANGE)."""
    import random
    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(slurm.PORT_RANGE[1] + 100, 32700)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def when_missing(why: str | None, environ) -> str | None:
    """What a test needing the cluster does where it cannot be made: "fail"
    under CI (CI=true: .ci/run installs Slurm, so its absence is a broken
    setup, never a quiet skip), "skip" elsewhere; None where it can be made."""
    if why is None:
        return None
    return "fail" if environ.get("CI", "").lower() == "true" else "skip"


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.pids: list[int] = []
        self.env = dict(os.environ)

    def _write_conf(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        host = socket.gethostname().split(".")[0]
        ctld, d1, d2 = _free_ports(3)
        lines = [
            "ClusterName=rrtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/sock",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # CPUs as written here, whatever this machine has
            "PlugStackConfig=/dev/null",
            "KillWait=3", "MessageTimeout=20",
            *(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS}"
              for n, p in zip(NODES, (d1, d2))),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        (r / "slurm.conf").write_text("\n".join(lines) + "\n")
        self.env["SLURM_CONF"] = str(r / "slurm.conf")
        for name in [n for n in self.env if n.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
            if name != "SLURM_CONF":
                del self.env[name]

    def _run(self, argv: list[str], what: str) -> None:
        p = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"{what} failed ({p.returncode}): {p.stderr.strip()}\n{self.logs()}")

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        self._write_conf()
        r = self.root
        try:
            self._run([which("munged"), "--force", f"--socket={r}/munge/sock", f"--key-file={r}/munge/munge.key",
                       f"--log-file={r}/log/munged.log", f"--pid-file={r}/munge/munged.pid",
                       f"--seed-file={r}/munge/seed"], "munged")
            self._track(r / "munge" / "munged.pid")
            self._run([which("slurmctld"), "-i"], "slurmctld")
            self._track(r / "slurmctld.pid")
            for n in NODES:
                self._run([which("slurmd"), "-N", n], f"slurmd -N {n}")
                self._track(r / f"slurmd-{n}.pid")
            deadline = time.monotonic() + timeout
            while True:
                p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True,
                                   text=True, timeout=30)
                states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
                if all(states.get(n) == "idle" for n in NODES):
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the nodes are not idle after {timeout:g} s: {states or p.stderr}\n"
                                       f"{self.logs()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def wait_for_job(self, job_id: str, timeout: float) -> tuple[str, str]:
        """(JobState, ExitCode) of a batch job once it has ended."""
        deadline = time.monotonic() + timeout
        while True:
            out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], env=self.env,
                                 capture_output=True, text=True, timeout=30).stdout
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields["JobState"], fields.get("ExitCode", "")
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} has not ended after {timeout:g} s: {out}\n{self.logs()}")
            time.sleep(0.2)

    def _track(self, pidfile: Path) -> None:
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pidfile} never appeared\n{self.logs()}")
            time.sleep(0.1)
        self.pids.append(int(pidfile.read_text().split()[0]))

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Stops the daemons this cluster started (by pid), the slurmd ones first."""
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.pids.clear()
