"""Does compression cost accuracy? The same Keras model trained on N ranks
through DistributedOptimizer with each Compression, from the same start on
the same data; final test accuracy and the loss curves.

    .venv/bin/python benchmarks/compression_accuracy.py                 # digits and the 20M+ synthetic task
    .venv/bin/python benchmarks/compression_accuracy.py --tasks digits
    .venv/bin/python benchmarks/compression_accuracy.py --quick         # a few steps, into /tmp
    .venv/bin/python benchmarks/compression_accuracy.py --tasks synthetic --seeds 0,1,2 \
        --compressions "none;powersgd:rank=4;int8"                    # the spread over seeds
    .venv/bin/python benchmarks/compression_accuracy.py --tasks synthetic --seeds 0 --decay cosine \
        --compressions "none;powersgd:rank=4,warmup_steps=26"         # the learning rate to zero at the end

Tasks:
  digits     scikit-learn's 8x8 digits (1797 images; 360 held out), an MLP
             64-256-128-10, SGD with momentum, --epochs.
  synthetic  a task big enough to need a 20M+ parameter model: 4096 input
             features that are a noisy linear image of a 32-dimensional
             latent; the label is the argmax of a fixed linear map of the
             latent (10 classes). MLP 4096-4096-1024-10 (21.0M parameters).
A seed sets the model's initial weights and the order of the training rows
(seed 0: their stored order); the task's data are the same for every seed.
Everything is real (no stand-ins): every rank computes its own shard of each
global batch. Ranks run on this machine's loopback (accuracy does not depend
on link speed).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
PY = sys.executable

COMPRESSIONS = ("none", "powersgd:rank=4", "int8", "topk:ratio=0.01")
DIGITS_EPOCHS, SYNTHETIC_EPOCHS = 30, 1
DIGITS_LR, SYNTHETIC_LR = 0.05, 0.01
# synthetic's test set: 16384 rows, so that one run's accuracy is good to ~0.3 points (binomial, at 82%),
# not ~0.85; the first 2048 are the test set of the results measured before it grew (kept apart, see label)
FIRST_TEST, SYNTHETIC_TEST = 2048, 16384


def data(task: str, quick: bool, seed: int = 0):
    import numpy as np
    if task == "digits":
        from sklearn.datasets import load_digits
        d = load_digits()
        x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
        order = np.random.default_rng(0).permutation(len(x))
        x, y = x[order], y[order]
        (x, y), test = (x[:1437], y[:1437]), (x[1437:], y[1437:])
    else:
        rng = np.random.default_rng(0)
        n_train, n_test = (2048, 512) if quick else (16384, FIRST_TEST)
        z = rng.standard_normal((n_train + n_test, 32)).astype(np.float32)
        a = rng.standard_normal((32, 4096)).astype(np.float32) / np.sqrt(32)
        x = z @ a + 0.5 * rng.standard_normal((len(z), 4096)).astype(np.float32)
        label_map = rng.standard_normal((32, 10)).astype(np.float32)
        y = np.argmax(z @ label_map, axis=1)
        (x, y), test = (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
        if not quick:  # more test rows of the same task, drawn after (so the first 2048 and the training rows
            more = np.random.default_rng(1)  # are the ones earlier results were measured on, bit for bit)
            zt = more.standard_normal((SYNTHETIC_TEST - FIRST_TEST, 32)).astype(np.float32)
            xt = zt @ a + 0.5 * more.standard_normal((len(zt), 4096)).astype(np.float32)
            test = (np.concatenate([test[0], xt]), np.concatenate([test[1], np.argmax(zt @ label_map, axis=1)]))
    if seed:  # the same task, its training rows in another order
        order = np.random.default_rng(seed).permutation(len(x))
        x, y = x[order], y[order]
    return (x, y), test


def model(task: str, seed: int = 0):
    import keras
    keras.utils.set_random_seed(seed)
    dims = [64, 256, 128] if task == "digits" else [4096, 4096, 1024]
    layers = [keras.Input((dims[0],))] + [keras.layers.Dense(d, activation="relu") for d in dims[1:]]
    return keras.Sequential(layers + [keras.layers.Dense(10)])


def worker(args) -> None:
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    import ringreduce as rr
    import ringreduce.tensorflow as rrtf
    from compression_speed import make_compressor
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rrtf.init()
    n, r = rrtf.size(), rrtf.rank()
    (x, y), (xt, yt) = data(args.task, args.quick, args.seed)
    # fp16: a cast (2^-11 relative rounding each step), the noise-floor control for the compressors' gaps
    comp = None if args.compression == "fp16" else make_compressor(args.compression)
    compression = (rrtf.Compression.fp16 if args.compression == "fp16" else
                   rrtf.Compression.none if comp is None else rrtf.compression.EngineCompression(comp))
    net = model(args.task, args.seed)
    lr = args.lr
    if args.decay == "cosine":  # to zero at the last step: the error feedback's lag (lr x residual) with it
        steps = args.epochs * -(-len(x[r::n]) // args.batch)
        lr = keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=steps)
    net.compile(optimizer=rrtf.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9),
                                                    compression=compression),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

    class Curve(keras.callbacks.Callback):
        losses: list = []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(float(logs["loss"]))

    curve = Curve()
    # Rank r's shard of every global batch: rows r, r + n, ... of each epoch's order.
    rr.reset_stats()
    net.fit(x[r::n], y[r::n], batch_size=args.batch, epochs=args.epochs, shuffle=False, verbose=0,
            callbacks=[curve])
    sent = rr.stats()["bytes_sent"]
    steps = len(curve.losses)
    right = np.argmax(net.predict(xt, verbose=0), axis=1) == yt
    acc = float(np.mean(right))
    same = all(np.array_equal(w, rr.broadcast(w, root=0)) for w in net.get_weights())
    if r == 0:
        print("RESULT", json.dumps({"test_acc": acc, "test_acc_first_2048": float(np.mean(right[:FIRST_TEST])),
                                    "losses": curve.losses, "bytes_per_step": sent / steps,
                                    "params": net.count_params(), "weights_agree": same}), flush=True)
    from ringreduce.engine import engine
    engine().shutdown()


def run(args, task: str, compression: str, seed: int) -> dict:
    from training_scaling import Hosts, _base_env, _result
    hosts = Hosts(None)
    port, secret = hosts.port(0), secrets.token_hex(16)
    argv = [PY, str(Path(__file__).resolve()), "--worker", "--task", task, "--compression", compression,
            "--epochs", str(args.epochs if task == "digits" else args.synthetic_epochs), "--batch",
            str(args.batch), "--lr", str(args.lr if task == "digits" else args.synthetic_lr), "--seed", str(seed),
            "--decay", args.decay]
    if args.quick:
        argv.append("--quick")
    procs = []
    for r in range(args.n):
        env = {**_base_env(), "RINGREDUCE_RANK": str(r), "RINGREDUCE_SIZE": str(args.n),
               "RINGREDUCE_ADDR": f"127.0.0.1:{port}", "RINGREDUCE_SECRET": secret,
               "RINGREDUCE_LOCAL_RANK": str(r), "RINGREDUCE_LOCAL_SIZE": str(args.n),
               # bytes are counted on links: the ranks share this host, whose arena would carry
               # PowerSGD's small P and Q allreduces and every header uncounted (docs/api.md, stats)
               "RINGREDUCE_ARENA_BYTES": "0"}
        procs.append(hosts.popen(r, argv, env))
    return _result(procs, f"{task} {compression} seed {seed}", args.timeout)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    tasks = list(results)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for spec, runs in results[task].items():
            losses = np.mean([r["losses"] for r in runs.values()], axis=0)  # the mean over seeds
            k = max(1, len(losses) // 50)  # a moving mean: per-batch losses are noisy
            smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
            acc = 100 * np.mean([r["test_acc"] for r in runs.values()])
            ax.plot(np.arange(len(smooth)) + k - 1, smooth,
                    label=f"{spec} (test acc {acc:.2f}%, {len(runs)} seed{'s' * (len(runs) > 1)})")
        first = next(iter(results[task].values()))
        ax.set_title(f"{task} ({next(iter(first.values()))['params'] / 1e6:.2f}M parameters)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (moving mean; mean over seeds)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def table(results: dict) -> list[str]:
    """Per task and compressor, over its seeds: test accuracy's mean, range
    and standard deviation; against none, the mean, its standard error, the
    range and the standard deviation of the difference paired by seed (the
    same start and data order). A task that differs from another only in its
    learning rate ('synthetic:lr=0.0100001') pairs with that task's none: a
    nudge to the learning rate is the control for how far any harmless
    change moves a seed's result."""
    import numpy as np
    out = ["| task | compression | seeds | test accuracy, mean | min .. max | std (points) | vs none, paired by seed "
           "(points): mean +- standard error (min .. max) | std of the paired differences | MB sent per step, rank 0 "
           "| weights agree |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for task, rows in results.items():
        head = unnudged(task)
        lr_only = head != task and head in results  # a learning-rate control: paired with its task's none
        base = results[head].get("none", {}) if lr_only else rows.get("none", {})
        for spec, runs in rows.items():
            acc = 100 * np.array([r["test_acc"] for r in runs.values()])
            paired = [100 * (r["test_acc"] - base[s]["test_acc"]) for s, r in runs.items() if s in base]
            sem = f" +- {np.std(paired, ddof=1) / np.sqrt(len(paired)):.2f}" if len(paired) > 1 else ""
            own = spec == "none" and not lr_only
            diff = (f"{np.mean(paired):+.2f}{sem} ({min(paired):+.2f} .. {max(paired):+.2f})"
                    if paired and not own else "")
            spread = f"{np.std(paired, ddof=1):.2f}" if len(paired) > 1 and not own else ""
            out.append(f"| {task} | {spec} | {','.join(runs)} | {acc.mean():.2f}% | "
                       f"{acc.min():.2f} .. {acc.max():.2f} | "
                       f"{acc.std(ddof=1) if len(acc) > 1 else 0:.2f} | {diff} | {spread} | "
                       f"{np.mean([r['bytes_per_step'] for r in runs.values()]) / 1e6:.3f} | "
                       f"{all(r['weights_agree'] for r in runs.values())} |")
    return out


def unnudged(task: str) -> str:
    """The task a learning-rate control belongs to ('synthetic:lr=0.0100001,decay=cosine' ->
    'synthetic:decay=cosine'); a task that is no control, itself."""
    head, _, extra = task.partition(":")
    parts = [p for p in extra.split(",") if p]
    rest = [p for p in parts if not p.startswith("lr=")]
    if len(rest) == len(parts):
        return task
    return f"{head}:{','.join(rest)}" if rest else head


def against_two_baselines(results: dict) -> list[str]:
    """Each row of a task against the mean, per seed, of its none and the
    none of its learning-rate controls ('synthetic:lr=...'): two equally
    good uncompressed runs, so the baseline's own luck at a seed counts half."""
    import numpy as np
    out = []
    for task, rows in results.items():
        nudged = [results[t]["none"] for t in results if t != task and unnudged(t) == task and "none" in results[t]]
        if "none" not in rows or not nudged:
            continue
        seeds = [s for s in rows["none"] if all(s in n for n in nudged)]
        base = {s: np.mean([rows["none"][s]["test_acc"]] + [n[s]["test_acc"] for n in nudged]) for s in seeds}
        out.append(f"{task}: against the mean of none and its learning-rate nudge, seeds {','.join(seeds)}:")
        for spec, runs in rows.items():
            d = [100 * (runs[s]["test_acc"] - base[s]) for s in seeds if s in runs]
            if len(d) > 1:
                out.append(f"  {spec}: {np.mean(d):+.2f} +- {np.std(d, ddof=1) / np.sqrt(len(d)):.2f} "
                           f"({' '.join(f'{x:+.2f}' for x in d)}; seeds {','.join(s for s in seeds if s in runs)})")
    return out


def label(args, task: str) -> str:
    """The key a task's runs are saved under: its name, plus the epochs when
    they are not the default, so that runs of another length sit beside the
    default ones (as 'synthetic:epochs=2') rather than overwrite them; the
    same for the learning rate ('synthetic:lr=0.0100001')."""
    if args.quick:
        return task
    epochs, lr = (args.synthetic_epochs, args.synthetic_lr) if task == "synthetic" else (args.epochs, args.lr)
    default_epochs, default_lr = (SYNTHETIC_EPOCHS, SYNTHETIC_LR) if task == "synthetic" else (DIGITS_EPOCHS, DIGITS_LR)
    parts = ([f"epochs={epochs}"] if epochs != default_epochs else []) + ([f"lr={lr!r}"] if lr != default_lr else []) \
        + ([f"decay={args.decay}"] if args.decay != "none" else [])
    return f"{task}:{','.join(parts)}" if parts else task


def _by_seed(results: dict) -> dict:
    """Saved results as task -> compression -> seed -> result (an older file held one run, seed 0, per compression)."""
    return {task: {spec: {"0": res} if "test_acc" in res else res for spec, res in rows.items()}
            for task, rows in results.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="digits,synthetic")
    p.add_argument("--compressions", default=";".join(COMPRESSIONS),
                   help="';'-separated; also 'fp16' (the cast, Compression.fp16: a control)")
    p.add_argument("-n", type=int, default=2, help="ranks")
    p.add_argument("--epochs", type=int, default=DIGITS_EPOCHS,
                   help="digits (another number is saved as its own task, 'digits:epochs=E')")
    p.add_argument("--synthetic-epochs", type=int, default=SYNTHETIC_EPOCHS,
                   help="synthetic (another number is saved as its own task, 'synthetic:epochs=E')")
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=DIGITS_LR,
                   help="digits (another value is saved as its own task, 'digits:lr=L')")
    p.add_argument("--synthetic-lr", type=float, default=SYNTHETIC_LR,
                   help="synthetic (another value is saved as its own task, 'synthetic:lr=L')")
    p.add_argument("--timeout", type=float, default=3600,
                   help="per run, s (one synthetic run took 11 min at load 10 and over 20 at load 19 on 2 cores)")
    p.add_argument("--decay", choices=("none", "cosine"), default="none",
                   help="the learning rate's schedule: constant, or cosine to zero at the last step (saved as its "
                        "own task, 'synthetic:decay=cosine')")
    p.add_argument("--seeds", default="0", help="','-separated; each sets the initial weights and the data order")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--table", action="store_true", help="print the saved results' table (and plot them); run nothing")
    p.add_argument("--out", default=str(REPO / "docs"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task", help=argparse.SUPPRESS)
    p.add_argument("--compression", default="none", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.epochs, args.out = 2, "/tmp"
    out = Path(args.out)
    if args.table:  # the saved results' table and plot, nothing run
        results = _by_seed(json.loads((out / "compression_accuracy.json").read_text())["results"])
        plot({task: rows for task, rows in results.items() if "test=2048" not in task and ":lr=" not in task},
             out / "compression_accuracy.png")
        print("\n".join(table(results) + against_two_baselines(results)))
        return
    saved = out / "compression_accuracy.json"
    # Runs not made now keep their saved results: tasks, compressions and seeds can be run a few at a time.
    results: dict = _by_seed(json.loads(saved.read_text())["results"]) if saved.exists() and not args.quick else {}
    for task in args.tasks.split(","):
        for seed in args.seeds.split(","):
            for spec in args.compressions.split(";"):
                res = run(args, task, spec, int(seed))
                if saved.exists() and not args.quick:  # re-read: another run of this script may have saved since
                    results = _by_seed(json.loads(saved.read_text())["results"])
                results.setdefault(label(args, task), {}).setdefault(spec, {})[seed] = res
                print(f"{label(args, task)} {spec} seed {seed}: test accuracy {100 * res['test_acc']:.2f}%, "
                      f"{res['bytes_per_step'] / 1e6:.3f} MB/step", flush=True)
                part = saved.with_name(f"{saved.name}.{os.getpid()}")  # whole or not at all, for a reader
                part.write_text(json.dumps({"argv": sys.argv[1:], "results": results}))
                os.replace(part, saved)
    # not the earlier runs (the same training as today's rows of their seed) nor the learning-rate controls
    plot({task: rows for task, rows in results.items() if "test=2048" not in task and ":lr=" not in task},
         out / "compression_accuracy.png")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
