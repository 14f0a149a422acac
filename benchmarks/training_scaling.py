"""Training throughput as workers are added: a 20M+ parameter model on the
emulated cluster, the ring (overlap on, off, with a compressor) against a
parameter server (synchronous and asynchronous).

    sudo python benchmarks/training_scaling.py                   # docs/training_scaling.json, docs/scaling_training.png, docs/scaling.md
    sudo python benchmarks/training_scaling.py --compression powersgd:rank=4
    python benchmarks/training_scaling.py --quick --no-cluster   # tiny, loopback, into /tmp (the test's run)

What is real and what stands in. This machine has 2 cores, so 8 ranks
cannot each compute at full speed; instead:
  * One rank alone measures the real model's forward and backward time at the
    full per-rank batch (and each layer's share of it).
  * In the scaled runs every rank runs the real Keras model and
    DistributedOptimizer, but on a slice of the batch (--slice rows), and a
    stand-in after every layer sleeps for that layer's measured share: in the
    forward pass for its forward time, in the backward pass (through a custom
    gradient) for its backward time, before that layer's weight gradient can
    be computed. So gradients appear in backprop's order, at the times the
    full batch would make them, and the overlap of transfer and backprop
    (ringreduce/tensorflow/overlap.py) works as it would.
  * Every gradient byte is real: the real 20M+ element gradients of the slice,
    through the engine and the ring, over TCP links shaped with tc. The
    optimizer's update is real too.
  * The parameter server's workers stand in for their whole compute with one
    sleep as long as the ring's one-rank step (compute, no communication),
    then push the gradient and pull the answer (benchmarks/ps_baseline.py).
Samples/s count the full per-rank batch the stand-in represents.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
PY = sys.executable

RING_MODES = ("overlap", "no_overlap", "compressed")


# --------------------------------------------------------------------------- the model

def layer_dims(args) -> list[tuple[int, int]]:
    """(inputs, outputs) of each Dense layer, first to last."""
    widths = [args.features] + [args.width] * args.layers + [10]
    return list(zip(widths[:-1], widths[1:]))


def param_count(args) -> int:
    return sum(i * o + o for i, o in layer_dims(args))


def _hold(x, seconds: float):
    """x, passed on only after `seconds` of sleep: compute that takes no CPU.
    Stateless, but fed by x, so it runs when x exists and is never folded."""
    import tensorflow as tf

    def sleep_then(a, s):
        time.sleep(float(s))
        return a
    y = tf.numpy_function(sleep_then, [x, tf.constant(seconds, tf.float64)], x.dtype, stateful=False,
                          name="ComputeStandIn")
    y.set_shape(x.shape)
    return y


def build_model(args, schedule=None):
    """The MLP; with a schedule, a compute stand-in after every Dense layer:
    forward, it waits the layer's forward time; backward, the layer's
    backward time, before the gradient reaches the layer's weights."""
    import keras
    import tensorflow as tf

    class ComputeStandIn(keras.layers.Layer):
        def __init__(self, fwd_s, bwd_s, **kw):
            super().__init__(**kw)
            self.fwd_s, self.bwd_s = fwd_s, bwd_s

        def call(self, x):
            @tf.custom_gradient
            def timed(x):
                return _hold(x, self.fwd_s), lambda dy: _hold(dy, self.bwd_s)
            return timed(x)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.features,))
    x = inputs
    dims = layer_dims(args)
    for i, (_, out) in enumerate(dims):
        x = keras.layers.Dense(out, activation="relu" if i < len(dims) - 1 else None, name=f"dense{i}")(x)
        if schedule is not None:
            x = ComputeStandIn(schedule["fwd"][i], schedule["bwd"][i], name=f"compute{i}")(x)
    return keras.Model(inputs, x)


def make_data(args, rank: int, rows: int):
    """A learnable synthetic task (labels from a fixed random teacher); each
    rank its own rows."""
    import numpy as np
    teacher = np.random.default_rng(0).standard_normal((args.features, 10), dtype=np.float32)
    x = np.random.default_rng(1 + rank).standard_normal((rows, args.features), dtype=np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int32)


def _tf_threads(args):
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    # Concurrent ops: the stand-in's sleep, a hand-over, a blocked wait, kernels.
    tf.config.threading.set_inter_op_parallelism_threads(4)


def _loss(labels, logits):
    import keras
    import tensorflow as tf
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


WALL: list = []  # the wall time of each timing's fastest run, for the record


def _best_time(fn, reps: int) -> float:
    """Seconds of CPU the computation takes (one thread): the least process
    CPU time of reps runs. Not wall time: on this shared machine a rank waits
    for a core much of the time (others' load), which a host of its own
    would not; on a quiet machine the two agree (cpu_over_wall ~ 1)."""
    fn()  # trace and warm up
    best = (float("inf"), 0.0)
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        best = min(best, (time.process_time() - c, time.perf_counter() - t))
    WALL.append(best[1])
    return best[0]


# --------------------------------------------------------------------------- one rank alone

def stand_in_schedule(layer_fwd, layer_bwd, fwd_total: float, fwd_bwd_total: float) -> dict:
    """Each layer's stand-in seconds: the whole model's measured forward and
    backward times, split in proportion to each layer's own measured times."""
    sf, sb = sum(layer_fwd), sum(layer_bwd)
    bwd_total = fwd_bwd_total - fwd_total
    if bwd_total <= 0.0:  # a tiny model's backward lost in timing noise: take the layers' backward/forward ratio
        bwd_total = fwd_total * sb / sf
    return {"fwd": [fwd_total * t / sf for t in layer_fwd], "bwd": [bwd_total * t / sb for t in layer_bwd],
            "fwd_s": fwd_total, "bwd_s": bwd_total}


def alone_worker(args) -> None:
    """The real model at the full per-rank batch, one rank, no communication:
    forward and forward+backward times, and each layer's alone."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf
    _tf_threads(args)
    model = build_model(args)
    x, y = make_data(args, 0, args.batch)
    x, y = tf.constant(x), tf.constant(y)
    fwd = tf.function(lambda: model(x, training=True))

    @tf.function
    def fwd_bwd():
        with tf.GradientTape() as tape:
            loss = _loss(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)
    fwd_s = _best_time(fwd, args.reps)
    fb_s = _best_time(fwd_bwd, args.reps)
    rng = np.random.default_rng(2)
    layer_fwd, layer_bwd = [], []
    for i, (din, dout) in enumerate(layer_dims(args)):
        layer = keras.layers.Dense(dout, activation="relu" if i < args.layers else None)
        xi = tf.constant(rng.standard_normal((args.batch, din), dtype=np.float32))
        dy = tf.constant(rng.standard_normal((args.batch, dout), dtype=np.float32))
        layer(xi)  # build
        targets = layer.trainable_variables if i == 0 else [xi] + layer.trainable_variables  # no dx for the input

        @tf.function
        def f():
            return layer(xi)

        @tf.function
        def fb():
            with tf.GradientTape() as tape:
                tape.watch(xi)
                out = tf.reduce_sum(layer(xi) * dy)
            return tape.gradient(out, targets)
        tf_, tfb = _best_time(f, args.reps), _best_time(fb, args.reps)
        layer_fwd.append(tf_)
        layer_bwd.append(max(tfb - tf_, 1e-6))
    print("RESULT", json.dumps({"fwd_s": fwd_s, "fwd_bwd_s": fb_s, "cpu_over_wall": fb_s / WALL[1], "fwd_bwd_wall_s": WALL[1], "layer_fwd": layer_fwd, "layer_bwd": layer_bwd,
                                "params": model.count_params(), "batch": args.batch, "threads": args.threads}),
          flush=True)


# --------------------------------------------------------------------------- one ring rank

def compression_from(spec: str):
    """'none', 'fp16', or a factory with keywords: 'powersgd:rank=4' calls
    Compression.powersgd(rank=4)."""
    from ringreduce.tensorflow import Compression
    name, _, params = spec.partition(":")
    if not hasattr(Compression, name):
        raise ValueError(f"no Compression.{name} in ringreduce.tensorflow")
    c = getattr(Compression, name)
    if params:
        kw = {}
        for pair in params.split(","):
            k, v = pair.split("=")
            kw[k] = float(v) if "." in v else int(v) if v.lstrip("-").isdigit() else v
        c = c(**kw)
    return c


def ring_worker(args) -> None:
    """The real model and DistributedOptimizer on a slice of the batch, the
    compute stand-ins of the schedule, every gradient over the ring."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    import ringreduce as rr
    import ringreduce.tensorflow as rrtf
    _tf_threads(args)
    rrtf.init()
    rank, n = rrtf.rank(), rrtf.size()
    schedule = json.loads(args.schedule)
    model = build_model(args, schedule)
    optimizer = rrtf.DistributedOptimizer(keras.optimizers.SGD(args.lr), compression=compression_from(args.compression))
    rrtf.broadcast_variables(model.variables, root_rank=0)
    steps = args.warmup + args.steps
    x, y = make_data(args, rank, steps * args.slice)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.slice)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = _loss(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    losses, windows = [], []
    for i, (xb, yb) in enumerate(data):
        if i == args.warmup:
            rrtf.allreduce(tf.zeros(1), name="training_scaling.start")  # every rank starts the clock together
            rr.reset_stats()
            t_start = time.perf_counter()
        t0 = time.monotonic()
        losses.append(float(step(xb, yb)))
        windows.append((t0, time.monotonic()))
    seconds = time.perf_counter() - t_start
    sent = rr.stats()["bytes_sent"]  # this rank's, over the timed steps (counted in C)
    check = rrtf.allreduce(tf.reduce_sum([tf.reduce_sum(v) for v in model.trainable_variables]), op=rrtf.Sum,
                           name="training_scaling.check")
    mine = float(tf.reduce_sum([tf.reduce_sum(v) for v in model.trainable_variables]))
    if rank == 0:
        print("RESULT", json.dumps({
            "samples_per_s_mean": args.steps * args.batch * n / seconds, "bytes_per_step": sent / args.steps, "windows": windows[args.warmup:], "losses": losses, "params": model.count_params(),
            # every rank holds the same weights: their sum over ranks is n times rank 0's
            "weights_agree": abs(float(check) - n * mine) <= 1e-3 * max(1.0, abs(n * mine))}), flush=True)
    from ringreduce.engine import engine
    engine().shutdown()  # closes the timeline


# --------------------------------------------------------------------------- launching

class Hosts:
    """Where processes run: the emulated cluster's hosts, or this machine's loopback."""

    def __init__(self, cluster=None):
        self.cluster = cluster

    def address(self, host: int) -> str:
        return self.cluster.addresses[host] if self.cluster else "127.0.0.1"

    def popen(self, host: int, argv, env):
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.cluster:
            return self.cluster.popen(host, argv, env, **kw)
        return subprocess.Popen(argv, env=env, **kw)

    def port(self, base: int) -> int:
        if self.cluster:
            return base
        from ringreduce.core.world import free_port
        return free_port("127.0.0.1")


def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGREDUCE_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1")
    return env


def _result(procs, what: str, timeout: float) -> dict:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"{what}: timed out after {timeout:.0f} s")
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{what}: a process failed:\n" + "\n".join(o[1][-3000:] for o in outs))
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{what}: no result:\n" + outs[0][0][-2000:] + outs[0][1][-2000:])


def model_argv(args) -> list[str]:
    out = []
    for k in ("features", "width", "layers", "batch", "slice", "steps", "warmup", "lr", "threads", "reps"):
        out += [f"--{k}", str(getattr(args, k))]
    return out


def measure_alone(args) -> dict:
    argv = [PY, str(Path(__file__).resolve()), "--worker", "alone", *model_argv(args)]

    def first_in_line():  # as root: others' load on this shared machine must not stretch the compute measured
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
        except OSError:
            pass
    return _result([subprocess.Popen(argv, env=_base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, preexec_fn=first_in_line)], "one rank alone", args.timeout)


def run_ring(args, hosts: Hosts, n: int, schedule: dict, overlap: bool, compression: str, trace: Path) -> dict:
    from overlap_bench import analyse
    port, secret = hosts.port(29100 + n), secrets.token_hex(16)
    argv = [PY, str(Path(__file__).resolve()), "--worker", "ring", *model_argv(args),
            "--schedule", json.dumps(schedule), "--compression", compression]
    procs = []
    for r in range(n):
        env = {**_base_env(), "RINGREDUCE_RANK": str(r), "RINGREDUCE_SIZE": str(n),
               "RINGREDUCE_ADDR": f"{hosts.address(0)}:{port}", "RINGREDUCE_SECRET": secret,
               "RINGREDUCE_LOCAL_RANK": "0", "RINGREDUCE_LOCAL_SIZE": "1",
               "RINGREDUCE_OVERLAP": "1" if overlap else "0"}
        if r == 0:
            env["RINGREDUCE_TIMELINE"] = str(trace)
        procs.append(hosts.popen(r, argv, env))
    out = _result(procs, f"ring N={n} overlap={overlap} compression={compression}", args.timeout)
    # The median step: on a shared machine one step stalled by others' load
    # (seconds, now and then) must not stand for all of them.
    windows = out.pop("windows")
    out["step_times"] = [b - a for a, b in windows]
    out["step_s"] = statistics.median(out["step_times"])
    out["samples_per_s"] = n * args.batch / out["step_s"]
    out["trace"] = analyse(trace, windows)  # where the step time goes, from rank 0's timeline
    return out


def run_ps(args, hosts: Hosts, n: int, compute_s: float, asynchronous: bool) -> dict:
    """One server on a host of its own (host n), n workers."""
    iters = args.warmup + args.steps
    port = hosts.port(7100 + n)
    flags = ["--bytes", str(param_count(args) * 4), "--iters", str(iters)] + (["--async"] if asynchronous else [])
    server = hosts.popen(n, [PY, str(HERE / "ps_baseline.py"), "server", "--port", str(port), "--workers", str(n),
                             *flags], _base_env())
    workers = [hosts.popen(i, [PY, str(HERE / "ps_baseline.py"), "worker", "--servers",
                               f"{hosts.address(n)}:{port}", "--compute", str(compute_s), *flags], _base_env())
               for i in range(n)]
    outs = []
    try:
        for w in workers:
            o, e = w.communicate(timeout=args.timeout)
            if w.returncode:
                raise RuntimeError(f"PS worker failed: {e[-2000:]}")
            outs.append(json.loads(o))
        server.communicate(timeout=60)
    finally:
        for p in [server, *workers]:
            if p.poll() is None:
                p.kill()
    # Each worker's own rate over its median timed step; a synchronous server keeps them equal.
    steps = [statistics.median(o["times"][args.warmup:]) for o in outs]
    return {"samples_per_s": sum(args.batch / t for t in steps), "step_s": max(steps),
            "step_times": [o["times"][args.warmup:] for o in outs]}


def measure(args, hosts: Hosts, progress=print) -> dict:
    ns = [int(v) for v in args.ns.split(",")]
    alone = measure_alone(args)
    schedule = stand_in_schedule(alone["layer_fwd"], alone["layer_bwd"], alone["fwd_s"], alone["fwd_bwd_s"])
    if args.fixed_compute:  # measured shares, a set total (tests: a tiny model's compute is too short to see)
        scale = args.fixed_compute / (schedule["fwd_s"] + schedule["bwd_s"])
        schedule = stand_in_schedule(alone["layer_fwd"], alone["layer_bwd"], alone["fwd_s"] * scale,
                                     alone["fwd_bwd_s"] * scale)
    progress(f"one rank alone: forward {alone['fwd_s']:.3f} s, forward+backward {alone['fwd_bwd_s']:.3f} s "
             f"(CPU/wall {alone['cpu_over_wall']:.2f})")
    data = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "load": os.getloadavg(), "rate": args.rate if hosts.cluster else None, "ns": ns,
            "model": {"features": args.features, "width": args.width, "layers": args.layers,
                      "params": param_count(args), "batch": args.batch, "slice": args.slice, "threads": args.threads,
                      "steps": args.steps, "warmup": args.warmup, "reps": args.reps},
            "alone": alone, "schedule": schedule, "compression": args.compression,
            "ring": {m: {} for m in RING_MODES}, "ps_sync": {}, "ps_async": {}}
    trace_dir = Path(args.out) / ".traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for n in ns:
        for mode in RING_MODES:
            if mode == "compressed" and args.compression == "none":
                continue
            r = run_ring(args, hosts, n, schedule, overlap=mode != "no_overlap",
                         compression=args.compression if mode == "compressed" else "none",
                         trace=trace_dir / f"ring-{mode}-{n}.json")
            data["ring"][mode][n] = r
            progress(f"ring {mode} N={n}: {r['samples_per_s']:.1f} samples/s, step {r['step_s']:.3f} s")
    # The PS workers' stand-in: the ring's one-rank step, all compute and no communication.
    compute_s = data["ring"]["overlap"][ns[0]]["step_s"] if ns[0] == 1 else schedule["fwd_s"] + schedule["bwd_s"]
    data["ps_compute_s"] = compute_s
    for n in ns:
        for key, asynchronous in (("ps_sync", False), ("ps_async", True)):
            data[key][n] = run_ps(args, hosts, n, compute_s, asynchronous)
            progress(f"{key} N={n}: {data[key][n]['samples_per_s']:.1f} samples/s")
    return data


def sweep(args, hosts: Hosts, data: dict, batches, progress=print) -> None:
    """At the largest N, per batch (so per compute time): the ring with
    overlap and the 1-server PS, each against its own one-worker run."""
    import copy
    big = max(data["ns"])
    data["sweep_command"] = " ".join(["python", *sys.argv])
    data.setdefault("sweep", {})
    for b in batches:
        a = copy.copy(args)
        a.batch = b
        alone = measure_alone(a)
        schedule = stand_in_schedule(alone["layer_fwd"], alone["layer_bwd"], alone["fwd_s"], alone["fwd_bwd_s"])
        one = run_ring(a, hosts, 1, schedule, True, "none", Path(args.out) / ".traces" / f"sweep-{b}-1.json")
        ring = run_ring(a, hosts, big, schedule, True, "none", Path(args.out) / ".traces" / f"sweep-{b}-{big}.json")
        ps = run_ps(a, hosts, big, one["step_s"], False)
        data["sweep"][b] = {"alone": alone, "one": one, "ring": ring, "ps_sync": ps, "n": big}
        progress(f"batch {b}: compute {alone['fwd_bwd_s']:.3f} s; N={big} ring "
                 f"{ring['samples_per_s'] / (big * one['samples_per_s']):.2f}, "
                 f"PS {ps['samples_per_s'] / (big * one['samples_per_s']):.2f}")


# --------------------------------------------------------------------------- the report

def efficiency(data, series: dict) -> dict:
    """samples/s over N times one rank alone (the ring's N=1 run: compute, no communication)."""
    one = data["ring"]["overlap"][1]["samples_per_s"]
    return {n: r["samples_per_s"] / (n * one) for n, r in series.items()}


def _series(data):
    out = [("ring, overlap on", data["ring"]["overlap"], "o-", "C0"),
           ("ring, overlap off", data["ring"]["no_overlap"], "o--", "C1")]
    if data["ring"].get("compressed"):
        out.append((f"ring, overlap on, {data['compression']}", data["ring"]["compressed"], "D-", "C2"))
    out += [("PS, 1 server, sync", data["ps_sync"], "s-", "C3"), ("PS, 1 server, async", data["ps_async"], "s:", "C4")]
    return out


def plot(data, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = data["ns"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    one = data["ring"]["overlap"][1]["samples_per_s"]
    for label, s, style, color in _series(data):
        xs = sorted(s)
        a.plot(xs, [s[n]["samples_per_s"] for n in xs], style, color=color, label=label)
        eff = efficiency(data, s)
        b.plot(xs, [eff[n] for n in xs], style, color=color, label=label)
    a.plot(ns, [n * one for n in ns], ":", color="gray", label="perfect scaling")
    b.axhline(0.85, color="C0", lw=0.7, ls=":")
    b.axhline(0.3, color="C3", lw=0.7, ls=":")
    for ax, what in ((a, "samples/s"), (b, "scaling efficiency")):
        ax.set_xlabel("N (workers, one per host)")
        ax.set_ylabel(what)
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
    b.set_ylim(0, 1.1)
    a.legend(fontsize=8)
    m = data["model"]
    where = f"links {data['rate']}" if data["rate"] else "loopback"
    fig.suptitle(f"MLP, {m['params'] / 1e6:.1f}M parameters, batch {m['batch']}/worker, {where}; "
                 f"compute stood in, communication real ({data['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    if data.get("sweep"):
        rows = sweep_rows(data)
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["compute_s"] for r in rows]
        ax.plot(xs, [r["ring"] for r in rows], "o-", color="C0", label="ring, overlap on")
        ax.plot(xs, [r["ps"] for r in rows], "s-", color="C3", label="PS, 1 server, sync")
        for r in rows:
            ax.annotate(f"batch {r['batch']}", (r["compute_s"], r["ring"]), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
        ax.axhline(0.85, color="C0", lw=0.7, ls=":")
        ax.axhline(0.3, color="C3", lw=0.7, ls=":")
        ax.axvline(rows[0]["ring_time_s"], color="gray", lw=0.8, ls="--", label="ring transfer time (model)")
        ax.set_xscale("log")
        ax.set_xlabel("one worker's forward+backward time per step (s)")
        ax.set_ylabel(f"scaling efficiency at N={rows[0]['n']}")
        ax.set_ylim(0, 1.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"efficiency vs compute per step, links {data['rate']}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path.with_name(path.stem + "_batch.png"), dpi=110)
        plt.close(fig)


def ring_transfer_s(data, n: int) -> float:
    """The alpha-beta model's bandwidth term: 2(N-1)/N of the gradient at the link's TCP payload rate."""
    from scaling_report import TCP_PAYLOAD, rate_bytes
    return 2 * (n - 1) / n * data["model"]["params"] * 4 / (rate_bytes(data["rate"] or "1gbit") * TCP_PAYLOAD)


def sweep_rows(data) -> list[dict]:
    """The main run's batch and the sweep's, by compute time: efficiency at the largest N."""
    big = max(data["ns"])
    main_one = data["ring"]["overlap"][1]["samples_per_s"]
    rows = [{"batch": data["model"]["batch"], "compute_s": data["alone"]["fwd_bwd_s"], "n": big,
             "ring": data["ring"]["overlap"][big]["samples_per_s"] / (big * main_one),
             "ps": data["ps_sync"][big]["samples_per_s"] / (big * main_one),
             "step_1": data["ring"]["overlap"][1]["step_s"], "step_n": data["ring"]["overlap"][big]["step_s"],
             "trace": data["ring"]["overlap"][big].get("trace")}]
    for b, r in data.get("sweep", {}).items():
        one = r["one"]["samples_per_s"]
        rows.append({"batch": b, "compute_s": r["alone"]["fwd_bwd_s"], "n": r["n"],
                     "ring": r["ring"]["samples_per_s"] / (r["n"] * one), "ps": r["ps_sync"]["samples_per_s"] / (r["n"] * one),
                     "step_1": r["one"]["step_s"], "step_n": r["ring"]["step_s"], "trace": r["ring"].get("trace")})
    for r in rows:
        r["ring_time_s"] = ring_transfer_s(data, r["n"])
    return sorted(rows, key=lambda r: r["batch"])


def section(data, plot_name: str) -> list[str]:
    """The training part of docs/scaling.md."""
    m, al, sch = data["model"], data["alone"], data["schedule"]
    ns = data["ns"]
    grad_mb = m["params"] * 4 / 1e6
    series = _series(data)
    lines = ["## Training throughput: a 20M-parameter model", "",
             f"Made by `{data['command']}` on {data['date']} (load average "
             f"{' '.join(f'{v:.1f}' for v in data['load'])}).", "",
             f"Model: an MLP {m['features']}-{'-'.join([str(m['width'])] * m['layers'])}-10, "
             f"{m['params'] / 1e6:.1f}M parameters ({grad_mb:.0f} MB of float32 gradient per step), "
             f"batch {m['batch']} per worker, SGD; a synthetic task with a learnable answer. "
             f"One worker per emulated host, links {data['rate']}; the parameter server on a host of its own.", "",
             "What is real and what stands in:", "",
             f"- **Measured, one rank alone** ({m['threads']} TensorFlow thread, the full batch of {m['batch']}): "
             f"forward {al['fwd_s']:.3f} s, forward + backward {al['fwd_bwd_s']:.3f} s: process CPU time, the "
             f"least of {m.get('reps', 7)} runs. CPU time, not wall time: on this shared machine (load "
             f"{data['load'][0]:.0f} on 2 cores) the rank waited for a core much of the time (wall "
             f"{al.get('fwd_bwd_wall_s', float('nan')):.3f} s, CPU/wall {al.get('cpu_over_wall', float('nan')):.2f}), "
             "which a host of its own would not. Each layer's share measured by timing that layer alone.",
             f"- **Stood in**: in the scaled runs each rank computes the real model on {m['slice']} rows of its "
             "batch, and after every layer a stand-in sleeps that layer's share of the measured time: in the "
             "forward pass its forward time, in the backward pass (a custom gradient) its backward time, before "
             "the layer's weight gradient exists. Gradients so appear last layer first, at the moments the full "
             "batch would make them, and the ring can carry a later layer's gradient while earlier layers still "
             "\"compute\"; a sleep takes no CPU, so 8 ranks on 2 cores do not compete for it.",
             f"- **Real**: every gradient byte ({grad_mb:.0f} MB per worker per step, the slice's real "
             "gradients) through DistributedOptimizer, the engine and the ring over shaped TCP links; the "
             "optimizer's update; the parameter server's pushes and pulls "
             f"(benchmarks/ps_baseline.py; each worker stands in for its compute with one sleep of "
             f"{data['ps_compute_s']:.3f} s, the ring's one-worker step, then pushes its gradient and pulls the "
             "result, no overlap).",
             "- Scaling efficiency: samples/s over N times the one-worker ring run (the same harness, "
             "no communication).", "",
             f"![training]({plot_name})", "",
             "| N | " + " | ".join(f"{label} samples/s (eff.)" for label, *_ in series) + " |",
             "|---|" + "---|" * len(series)]
    effs = [efficiency(data, s) for _, s, *_ in series]
    for n in ns:
        cells = [f"{s[n]['samples_per_s']:.0f} ({e[n]:.2f})" if n in s else "-" for (_, s, *_), e in zip(series, effs)]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Where the step time goes (rank 0's timeline, median step, seconds): the ring was busy for "
              "`ring busy`, of which `hidden` fell before backprop's last hand-over; `ring at link rate` is the "
              "time the same bytes take at the links' payload rate (the bandwidth tables' model; half for fp16).", "",
              "| N | mode | step | ring busy | ring at link rate | first hand-over | backprop end | hidden |",
              "|---|---|---|---|---|---|---|---|"]
    for mode, label in (("overlap", "overlap on"), ("no_overlap", "overlap off"), ("compressed", data["compression"])):
        for n in ns:
            r = data["ring"].get(mode, {}).get(n)
            if r and "trace" in r:
                t = r["trace"]
                wire = ring_transfer_s(data, n) / (2 if mode == "compressed" and "16" in data["compression"] else 1)
                lines.append(f"| {n} | {label} | {t['step_s']:.3f} | {t['comm_s']:.3f} | {wire:.3f} | "
                             f"{t['first_handover_s']:.3f} | {t['backprop_end_s']:.3f} | {100 * t['hidden_share']:.0f}% |")
    big = max(ns)
    ring_eff, ps_eff = efficiency(data, data["ring"]["overlap"]), efficiency(data, data["ps_sync"])
    met = ring_eff[big] >= 0.85 and ps_eff[big] < 0.3
    lines += ["", f"Target: ring with overlap >= 0.85 at N={big} where the 1-server PS falls below 0.3: at batch "
              f"{m['batch']}, ring {ring_eff[big]:.2f}, PS {ps_eff[big]:.2f}: {'met' if met else 'not met'}.", ""]
    if data.get("sweep"):
        rows = sweep_rows(data)
        lines += [f"### Efficiency at N={big} against compute per step", "",
                  f"Made by `{data['sweep_command']}` (the same model and links; each batch's compute measured "
                  "alone again, each efficiency against its own one-worker run). The ring's transfer of "
                  f"{grad_mb:.0f} MB at N={big} takes {rows[0]['ring_time_s']:.2f} s at the links' payload rate "
                  "(the alpha-beta model of the bandwidth tables); overlap can hide it only behind backprop.", "",
                  "![efficiency vs compute](scaling_training_batch.png)", "",
                  "| batch/worker | forward+backward alone (s) | step N=1 (s) | step N=%d (s) | ring busy (s) | hidden | "
                  "ring eff. | PS sync eff. |" % big, "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            t = r["trace"] or {}
            lines.append(f"| {r['batch']} | {r['compute_s']:.3f} | {r['step_1']:.3f} | {r['step_n']:.3f} | "
                         f"{t.get('comm_s', float('nan')):.3f} | {100 * t.get('hidden_share', float('nan')):.0f}% | "
                         f"{r['ring']:.2f} | {r['ps']:.2f} |")
        lines.append("")
    return lines


# --------------------------------------------------------------------------- main

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", default="1,2,4,6,8", help="worker counts; the first must be 1 (the baseline)")
    p.add_argument("--rate", default="1gbit", help="each host's link rate (tc tbf)")
    p.add_argument("--compression", default="fp16", help="the compressed ring's Compression: none, fp16, bf16, "
                                                           "or a factory with keywords, e.g. powersgd:rank=4")
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--layers", type=int, default=9, help="hidden Dense layers")
    p.add_argument("--batch", type=int, default=512, help="per worker (what the compute stand-in represents)")
    p.add_argument("--slice", type=int, default=8, help="rows each rank really computes per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads of the one-rank measurement")
    p.add_argument("--reps", type=int, default=7, help="repeats of each one-rank timing (the fastest counts)")
    p.add_argument("--fixed-compute", type=float, default=0.0,
                   help="seconds of forward+backward to stand in, split by the measured shares (0: as measured)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-cluster", action="store_true", help="loopback, no shaped links (no root needed)")
    p.add_argument("--quick", action="store_true", help="a tiny model, N=1,2, into /tmp: checks the pipeline")
    p.add_argument("--out", default=str(REPO / "docs"))
    p.add_argument("--from-json", help="re-draw the report from a saved training_scaling.json")
    p.add_argument("--sweep-batches", default="", help="also, at the largest N: ring and PS per batch, e.g. 1024,2048")
    p.add_argument("--sweep-only", action="store_true",
                   help="only the sweep, added to the training_scaling.json already in --out")
    p.add_argument("--schedule", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["alone", "ring"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "alone":
        return alone_worker(args)
    if args.worker == "ring":
        return ring_worker(args)
    if args.quick:
        args.ns, args.features, args.width, args.layers, args.batch, args.slice = "1,2", 64, 64, 3, 32, 4
        args.steps, args.warmup, args.reps, args.timeout = 3, 1, 3, 240
        args.fixed_compute = args.fixed_compute or 0.2
        if args.out == str(REPO / "docs"):
            args.out = "/tmp/ringreduce-training-scaling"
    if not args.ns.startswith("1,") and args.ns != "1":
        sys.exit("--ns must start with 1: the one-worker run is the baseline of the efficiencies")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text(), object_hook=_int_keys)
    else:
        say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        batches = [int(b) for b in args.sweep_batches.split(",") if b]

        def run(hosts):
            if args.sweep_only:
                data = json.loads((out / "training_scaling.json").read_text(), object_hook=_int_keys)
            else:
                data = measure(args, hosts, say)
                (out / "training_scaling.json").write_text(json.dumps(data, indent=1))
            if batches:
                sweep(args, hosts, data, batches, say)
            return data
        if args.no_cluster:
            data = run(Hosts())
        else:
            from cluster import Cluster, can_build
            reason = can_build()
            if reason:
                sys.exit(f"training_scaling: {reason}; run as root, or pass --no-cluster")
            with Cluster(max(int(v) for v in args.ns.split(",")) + 1, rate=args.rate) as cluster:
                data = run(Hosts(cluster))
        (out / "training_scaling.json").write_text(json.dumps(data, indent=1))
    plot(data, out / "scaling_training.png")  # and scaling_training_batch.png with a sweep
    write_scaling_md(data, out)
    print(f"wrote {out / 'training_scaling.json'}, {out / 'scaling_training.png'}, {out / 'scaling.md'}")


def write_scaling_md(data, out: Path) -> None:
    """docs/scaling.md: the bandwidth part re-drawn from scaling.json (when
    there is one), then this training section."""
    import scaling_report
    lines = []
    if (out / "scaling.json").exists():
        bw = json.loads((out / "scaling.json").read_text(), object_hook=_int_keys)
        lines = [scaling_report.report(bw, [f"scaling_{k}.png" for k in ("time", "busbw")])]
    lines += section(data, "scaling_training.png")
    (out / "scaling.md").write_text("\n".join(lines))


def _int_keys(d):
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in d.items()}


if __name__ == "__main__":
    main()
