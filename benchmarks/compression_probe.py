"""One compressor against the exact average, step by step, on the real
gradients of compression_accuracy.py's synthetic task: is what it delivers
unbiased, how far is one step from the exact average, and does its
error-feedback residual stay bounded?

    .venv/bin/python benchmarks/compression_probe.py --compression int8 --seed 3 --steps 48

Two ranks on loopback. Each step every rank takes its shard of a global
batch of 64 (as compression_accuracy.py's runs do), computes its gradient,
and reduces it twice: exactly (rr.allreduce, avg) and through the
compressor (avg); the model then steps on the compressor's result (SGD,
momentum 0.9, lr 0.01), so the probe follows a compressed run. Per step and
tensor, rank 0 prints:
  rel    |compressed - exact| / |exact|
  resid  |this rank's error-feedback residual| / |this rank's gradient|
  along  <compressed - exact, exact> / |exact|^2   (a shrink or stretch along
         the gradient, where an unbiased compressor stays near 0)
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PY = sys.executable


def worker(args) -> None:
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    import ringreduce as rr
    from compression_accuracy import data, model
    from compression_speed import make_compressor
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rr.init()
    n, r = rr.size(), rr.rank()
    (x, y), _ = data("synthetic", False, args.seed)
    x, y = x[r::n], y[r::n]
    net = model("synthetic", args.seed)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    comp = make_compressor(args.compression)
    names = [v.path for v in net.trainable_variables]
    rows = []
    for step in range(args.steps):
        xb, yb = x[step * args.batch:(step + 1) * args.batch], y[step * args.batch:(step + 1) * args.batch]
        with tf.GradientTape() as tape:
            loss = lossf(yb, net(xb, training=True))
        grads = [g.numpy() for g in tape.gradient(loss, net.trainable_variables)]
        exact = [rr.allreduce(g, op="avg", name=f"probe.exact.{i}") for i, g in enumerate(grads)]
        got = comp.allreduce(grads, names, op="avg")
        row = {"step": step, "loss": float(loss)}
        for name, e, c, g in zip(names, exact, got, grads):
            err = comp._state[(0, name)].get("error")
            d = (c - e).ravel()
            row[name] = {"rel": float(np.linalg.norm(d) / np.linalg.norm(e)),
                         "resid": float(np.linalg.norm(err) / np.linalg.norm(g)) if err is not None else None,
                         "along": float(d @ e.ravel() / (e.ravel() @ e.ravel()))}
        row["rel_all"] = float(np.sqrt(sum(np.sum((c - e) ** 2) for c, e in zip(got, exact))
                                       / sum(np.sum(e ** 2) for e in exact)))
        rows.append(row)
        opt.apply_gradients(zip([tf.constant(c) for c in got], net.trainable_variables))
    if r == 0:
        print("RESULT", json.dumps(rows), flush=True)
    from ringreduce.engine import engine
    engine().shutdown()


def summary(rows: list) -> list[str]:
    import numpy as np
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    tenth = max(1, len(rows) // 5)
    out = [f"all tensors: rel {min(r['rel_all'] for r in rows):.4f} .. {max(r['rel_all'] for r in rows):.4f} "
           f"(mean {np.mean([r['rel_all'] for r in rows]):.4f}) over {len(rows)} steps",
           "| tensor | rel min .. max | resid min .. max | resid, first / last fifth (mean) | along min .. max |",
           "|---|---|---|---|---|"]
    for k in names:
        rel = [r[k]["rel"] for r in rows]
        res = [r[k]["resid"] for r in rows if r[k]["resid"] is not None]
        along = [r[k]["along"] for r in rows]
        res_s = (f"{min(res):.4f} .. {max(res):.4f} | {np.mean(res[:tenth]):.4f} / {np.mean(res[-tenth:]):.4f}"
                 if res else "- | -")
        out.append(f"| {k} | {min(rel):.4f} .. {max(rel):.4f} | {res_s} | {min(along):+.1e} .. {max(along):+.1e} |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compression", default="int8", help="as compression_accuracy.py's (not none or fp16)")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from training_scaling import Hosts, _base_env, _result
    hosts = Hosts(None)
    port, secret = hosts.port(0), secrets.token_hex(16)
    argv = [PY, str(Path(__file__).resolve()), "--worker", "--compression", args.compression, "--seed",
            str(args.seed), "--steps", str(args.steps), "--batch", str(args.batch)]
    procs = [hosts.popen(r, argv, {**_base_env(), "RINGREDUCE_RANK": str(r), "RINGREDUCE_SIZE": "2",
                                   "RINGREDUCE_ADDR": f"127.0.0.1:{port}", "RINGREDUCE_SECRET": secret,
                                   "RINGREDUCE_LOCAL_RANK": str(r), "RINGREDUCE_LOCAL_SIZE": "2"})
             for r in range(2)]
    print("\n".join(summary(_result(procs, f"probe {args.compression}", args.timeout))))


if __name__ == "__main__":
    main()
