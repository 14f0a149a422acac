"""The example manifests (examples/kubernetes/) are valid YAML of the kind each
operator takes, run a script of this repository with ringrun or python, give
every pod the job secret from the one Secret, and describe the world they
say: the environment the operator derives from each manifest (as
tests/test_kubernetes_discovery.py sets it) gives ringreduce that world."""
import json
import shlex

import yaml  # pyyaml: the dev extra

from ranks import REPO
from ringreduce.core import kubernetes
from ringreduce.core.world import discover
from ringreduce.launch import ringrun
from test_kubernetes_discovery import pytorchjob_v18, trainjob

DIR = REPO / "examples" / "kubernetes"
APP = "/app"  # where the images hold this repository (the manifests' comments say so)


def load(name: str) -> dict:
    docs = list(yaml.safe_load_all((DIR / name).read_text()))
    assert len(docs) == 1 and isinstance(docs[0], dict), name
    return docs[0]


def containers(spec: dict) -> list:
    return [c for replica in spec.values() for c in replica["template"]["spec"]["containers"]]


def secret_name() -> str:
    secret = load("secret.yaml")
    assert secret["kind"] == "Secret" and "secret" in secret["stringData"]
    return secret["metadata"]["name"]


def secret_refs(env: list) -> list:
    return [(e["name"], e["valueFrom"]["secretKeyRef"]) for e in env if "valueFrom" in e]


def script_of(command: list, workdir: str) -> str:
    """The repository file a command runs (after ringrun's options, `python`)."""
    at = command.index("python") + 1
    path = command[at] if command[at].startswith("/") else f"{workdir}/{command[at]}"
    assert path.startswith(APP + "/"), command
    assert (REPO / path[len(APP) + 1:]).is_file(), f"{path} is not a file of this repository"
    return path


def ringrun_np(command: list) -> int:
    assert command[0] == "ringrun", command
    return int(command[command.index("-np") + 1])


def test_every_manifest_is_yaml_of_its_operators_kind():
    kinds = {name.name: (doc := load(name.name))["kind"] + " " + doc["apiVersion"] for name in DIR.glob("*.yaml")}
    assert kinds == {"secret.yaml": "Secret v1", "pytorchjob.yaml": "PyTorchJob kubeflow.org/v1",
                     "trainjob.yaml": "TrainJob trainer.kubeflow.org/v1alpha1",
                     "mpijob.yaml": "MPIJob kubeflow.org/v2beta1", "tfjob.yaml": "TFJob kubeflow.org/v1"}


def test_pytorchjob_pods_run_ringrun_as_many_times_as_nprocpernode_and_make_one_world():
    job = load("pytorchjob.yaml")
    spec = job["spec"]["pytorchReplicaSpecs"]
    assert set(spec) == {"Master", "Worker"} and spec["Master"]["replicas"] == 1
    pods = sum(r["replicas"] for r in spec.values())
    for c in containers(spec):
        assert c["name"] == "pytorch" and c["image"] == containers(spec)[0]["image"]
        assert ringrun_np(c["command"]) == int(job["spec"]["nprocPerNode"])
        script_of(c["command"], c["workingDir"])
        assert secret_refs(c["env"]) == [("RINGREDUCE_SECRET", {"name": secret_name(), "key": "secret"})]
    master = spec["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port")
    nproc = job["spec"]["nprocPerNode"]
    ranks = []
    for pod in range(pods):  # what the operator sets on each pod, then ringrun in it
        env = {**pytorchjob_v18(pod, pods, nproc), "MASTER_ADDR": f"{job['metadata']['name']}-master-0",
               "MASTER_PORT": str(port), "RINGREDUCE_SECRET": "s"}
        envs = ringrun.pod_envs(kubernetes.pod_job(env), ringrun_np(master["command"]), "", None)
        ranks += [(int(e["RINGREDUCE_RANK"]), int(e["RINGREDUCE_SIZE"]), e["RINGREDUCE_ADDR"]) for e in envs]
    assert ranks == [(r, 4, f"ringreduce-digits-master-0:{port + 1}") for r in range(4)]


def test_trainjob_runs_ringrun_as_many_times_as_numprocpernode_and_makes_one_world():
    job = load("trainjob.yaml")
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert ringrun_np(trainer["command"]) == trainer["numProcPerNode"]
    script_of(trainer["command"], APP)
    assert secret_refs(trainer["env"]) == [("RINGREDUCE_SECRET", {"name": secret_name(), "key": "secret"})]
    ranks = []
    for pod in range(trainer["numNodes"]):
        env = {**trainjob(pod, trainer["numNodes"], str(trainer["numProcPerNode"])), "RINGREDUCE_SECRET": "s",
               "PET_MASTER_ADDR": f"{job['metadata']['name']}-node-0-0.{job['metadata']['name']}"}
        envs = ringrun.pod_envs(kubernetes.pod_job(env), ringrun_np(trainer["command"]), "", None)
        ranks += [(int(e["RINGREDUCE_RANK"]), int(e["RINGREDUCE_SIZE"]), e["RINGREDUCE_ADDR"]) for e in envs]
    assert ranks == [(r, 4, "ringreduce-digits-node-0-0.ringreduce-digits:29401") for r in range(4)]


def test_mpijob_launcher_runs_ringrun_on_every_slot_of_its_workers(tmp_path):
    job = load("mpijob.yaml")
    spec = job["spec"]["mpiReplicaSpecs"]
    launcher = spec["Launcher"]["template"]["spec"]["containers"][0]
    worker = spec["Worker"]["template"]["spec"]["containers"][0]
    assert launcher["image"] == worker["image"] and launcher["workingDir"] == worker["workingDir"]
    assert worker["command"][0].endswith("sshd")  # ringrun reaches them over the operator's ssh
    command = launcher["command"]
    assert ringrun_np(command) == job["spec"]["slotsPerWorker"] * spec["Worker"]["replicas"]
    script_of(command, launcher["workingDir"])
    assert "BatchMode=yes" in shlex.split(command[command.index("--ssh") + 1])
    # the hostfile as the operator writes it for Open MPI; ringrun fills every slot of it
    hostfile = tmp_path / "hostfile"
    name = job["metadata"]["name"]
    hostfile.write_text("".join(f"{name}-worker-{i}.{name}-worker.default.svc slots={job['spec']['slotsPerWorker']}\n"
                                for i in range(spec["Worker"]["replicas"])))
    hosts = ringrun.parse_hosts(ringrun.parse_hostfile(str(hostfile)), ringrun_np(command))
    assert len(hosts) == 4 and len(set(hosts)) == 2


def test_tfjob_pods_are_the_chief_then_the_workers():
    job = load("tfjob.yaml")
    spec = job["spec"]["tfReplicaSpecs"]
    assert set(spec) == {"Chief", "Worker"}
    for c in containers(spec):
        assert c["name"] == "tensorflow" and c["command"][0] == "python"
        script_of(c["command"], c["workingDir"])
        assert secret_refs(c["env"]) == [("RINGREDUCE_SECRET", {"name": secret_name(), "key": "secret"})]
    name = job["metadata"]["name"]
    cluster = {"chief": [f"{name}-chief-0.default.svc:2222"],
               "worker": [f"{name}-worker-{i}.default.svc:2222" for i in range(spec["Worker"]["replicas"])]}
    tasks = [("chief", 0)] + [("worker", i) for i in range(spec["Worker"]["replicas"])]
    worlds = [discover({"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": t, "index": i},
                                                 "environment": "cloud"}), "RINGREDUCE_SECRET": "s"})
              for t, i in tasks]
    assert [(w.rank, w.size, w.addr) for w in worlds] == [(r, 2, (f"{name}-chief-0.default.svc", 2222))
                                                          for r in range(2)]
