"""The same Keras model and data trained two ways on N local workers:
TensorFlow's MultiWorkerMirroredStrategy (CommunicationImplementation.RING,
workers found through TF_CONFIG) and ringreduce's DistributedOptimizer.

    python benchmarks/keras_vs_mwms.py                  # N=2 and 4, a 21M-parameter MLP, 30 steps
    python benchmarks/keras_vs_mwms.py --np 2 --json out.json

Both train the same number of steps with the same global batch (each worker
its share of it) on a synthetic task with a learnable answer (labels from a
fixed random teacher), from the same initial weights, so their losses must
match step for step. Reported: samples/s after warm-up, the mean loss of
worker 0's last 5 steps, and the same workers' samples/s with no
communication at all (the compute ceiling of this machine).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
PY = sys.executable


# --------------------------------------------------------------------------- one worker

def make_data(args):
    import numpy as np
    rng = np.random.default_rng(0)
    n = (args.warmup + args.steps) * args.batch * args.np
    x = rng.standard_normal((n, args.features), dtype=np.float32)
    teacher = rng.standard_normal((args.features, 10), dtype=np.float32)
    return x, np.argmax(x @ teacher, axis=1)


def make_model(args):
    import keras
    keras.utils.set_random_seed(0)
    layers = [keras.Input((args.features,))]
    layers += [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
    return keras.Sequential(layers + [keras.layers.Dense(10)])


def worker(args) -> None:
    """One training loop for both: Keras 3's model.fit cannot drive
    MultiWorkerMirroredStrategy (keras-team/keras#20585), so each worker runs
    the same custom tf.function step; only how gradients are combined differs."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import time

    import keras
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    x, y = make_data(args)
    n = args.np

    def loss_fn(labels, logits):  # the plain function: Keras's Loss objects rescale under a strategy
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if args.worker == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        rank = strategy.cluster_resolver.task_id
        with strategy.scope():
            model = make_model(args)
            optimizer = keras.optimizers.SGD(args.lr)  # under the strategy it sums gradients over workers
        scale = 1.0 / n
    elif args.worker == "ringreduce":
        import ringreduce.tensorflow as rrtf
        rrtf.init()
        rank = rrtf.rank()
        model = make_model(args)
        optimizer = rrtf.DistributedOptimizer(keras.optimizers.SGD(args.lr))  # averages over ranks
        rrtf.broadcast_variables(model.variables, root_rank=0)
        scale = 1.0
    else:  # "alone": the same step with no communication, the compute ceiling
        rank = int(os.environ["WORKER_INDEX"])
        model = make_model(args)
        optimizer = keras.optimizers.SGD(args.lr)
        scale = 1.0
    # Global batch i is rows [i*gb, (i+1)*gb): worker r takes every n-th of them.
    gb, steps = args.batch * n, args.warmup + args.steps
    idx = np.array([i * gb + j for i in range(steps) for j in range(rank, gb, n)])
    local = tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(args.batch)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            scaled = loss * scale
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    if args.worker == "mwms":
        data = strategy.distribute_datasets_from_function(lambda ctx: local)
        step = tf.function(lambda xb, yb: strategy.experimental_local_results(
            strategy.run(replica_step, args=(xb, yb)))[0])
    else:
        data = local
        step = tf.function(replica_step)
    losses = []
    for i, (xb, yb) in enumerate(data):
        if i == args.warmup:
            t0 = time.perf_counter()
        losses.append(float(step(xb, yb)))
    seconds = time.perf_counter() - t0
    final = float(np.mean(losses[-5:]))  # worker 0's last few batches, for both
    if rank == 0:
        print("RESULT", json.dumps({"samples_per_s": args.steps * gb / seconds, "loss": final, "losses": losses,
                                    "params": model.count_params()}), flush=True)


# --------------------------------------------------------------------------- the launcher

def launch(args, kind: str, n: int) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RINGREDUCE_") and k != "TF_CONFIG"}
    base.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3")
    from ringreduce.core.world import free_port
    ports = [free_port("127.0.0.1") for _ in range(n)]
    secret = secrets.token_hex(16)
    argv = [PY, str(Path(__file__).resolve()), "--worker", kind, "--np", str(n)]
    for k in ("layers", "width", "features", "batch", "steps", "warmup", "lr", "threads"):
        argv += [f"--{k}", str(getattr(args, k))]
    procs = []
    for r in range(n):
        if kind == "alone":
            env = {**base, "WORKER_INDEX": str(r)}
        elif kind == "mwms":
            env = {**base, "TF_CONFIG": json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                                    "task": {"type": "worker", "index": r}})}
        else:
            env = {**base, "RINGREDUCE_RANK": str(r), "RINGREDUCE_SIZE": str(n),
                   "RINGREDUCE_ADDR": f"127.0.0.1:{ports[0]}", "RINGREDUCE_SECRET": secret}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{kind} N={n}: a worker failed:\n" + "\n".join(o[1][-3000:] for o in outs))
    line = next(ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[7:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", default="2,4", help="worker counts, comma-separated")
    p.add_argument("--layers", type=int, default=2, help="hidden Dense layers")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--steps", type=int, default=30, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=0, help="TensorFlow intra-op threads per worker (0: cores / N)")
    p.add_argument("--json")
    p.add_argument("--worker", choices=["mwms", "ringreduce", "alone"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.np = int(args.np)
        return worker(args)

    rows = []
    for n in [int(v) for v in args.np.split(",")]:
        args.threads = args.threads or max(1, (os.cpu_count() or 1) // n)
        rows.append({"np": n, **{kind: launch(args, kind, n) for kind in ("ringreduce", "mwms", "alone")}})
        print(f"N={n}: done", file=sys.stderr)
    params = rows[0]["ringreduce"]["params"]
    print(f"# keras_vs_mwms: MLP {args.features}-{'-'.join([str(args.width)] * args.layers)}-10 "
          f"({params / 1e6:.1f}M params), batch {args.batch}/worker, {args.steps} timed steps, SGD lr {args.lr}")
    print("# 'no comm': the same N workers side by side, each alone (no gradient exchange): the compute ceiling")
    print(f"{'N':>3} {'ringreduce samples/s':>21} {'MWMS RING samples/s':>20} {'ratio':>6} {'no comm':>8} "
          f"{'ringreduce loss':>16} {'MWMS loss':>10}")
    for r in rows:
        a, b, c = r["ringreduce"], r["mwms"], r["alone"]
        print(f"{r['np']:>3} {a['samples_per_s']:21.1f} {b['samples_per_s']:20.1f} "
              f"{a['samples_per_s'] / b['samples_per_s']:5.2f}x {c['samples_per_s']:8.1f} "
              f"{a['loss']:16.4f} {b['loss']:10.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
