"""Bandwidth scaling report: ring allreduce vs a parameter server on an
emulated cluster (one network namespace per host, tc-shaped links).

    sudo python benchmarks/scaling_report.py                 # writes docs/scaling.md and docs/scaling_*.png
    sudo python benchmarks/scaling_report.py --quick         # a 1-minute smoke run into /tmp

The training section of docs/scaling.md comes from benchmarks/training_scaling.py.

The claim under test: each ring rank sends 2(N-1)/N of the tensor whatever N
is, so allreduce time stays nearly flat as N grows, while a parameter
server's link carries N tensors in and N out.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from cluster import Cluster, can_build  # noqa: E402
from ps_baseline import parse_bytes  # noqa: E402

PY = sys.executable
RING_JOB = """
import json, time, numpy as np, ringreduce as rr
rr.init()
out = {}
for nbytes in %(sizes)s:
    x = np.ones(nbytes // 4, dtype=np.float32); y = np.empty_like(x)
    rr.allreduce(x, out=y)                      # warm-up
    times = []
    for _ in range(%(repeats)d):
        rr.barrier(); t = time.perf_counter(); rr.allreduce(x, out=y); times.append(time.perf_counter() - t)
    out[nbytes] = float(rr.allreduce(np.array([min(times)]), op="max")[0])
    assert y[0] == rr.size()
if rr.rank() == 0:
    print("RESULT", json.dumps(out))
"""
HOP_JOB = """
import json, time, numpy as np, ringreduce as rr
rr.init()
x = np.ones(1, dtype=np.float32)
for _ in range(20): rr.allreduce(x)
rr.barrier(); t = time.perf_counter()
for _ in range(50): rr.allreduce(x)
if rr.rank() == 0:
    print("RESULT", json.dumps((time.perf_counter() - t) / 50))
"""
TCP_PAYLOAD = 1448 / 1538  # TCP payload per byte on an Ethernet wire (MTU 1500, timestamps)


def rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[:-len(u)]) * f / 8
    raise ValueError(f"rate like 1gbit or 500mbit, got {rate}")


def run_ranks(cluster: Cluster, n: int, code: str, env_extra=None, timeout=900):
    secret, port = secrets.token_hex(16), 29000 + n
    procs = [cluster.popen(i, [PY, "-c", code],
                           {**cluster.ring_env(i, port, secret, n), "PYTHONPATH": str(REPO), **(env_extra or {})},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(o[1][-2000:] for o in outs))
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError("rank 0 printed no result:\n" + outs[0][0] + outs[0][1])


def ring_times(cluster, n, sizes, repeats) -> dict:
    return {int(k): v for k, v in run_ranks(cluster, n, RING_JOB % {"sizes": sizes, "repeats": repeats}).items()}


def hop_latency(cluster, n) -> float:
    """Seconds per ring hop: a one-element ring allreduce (forced through the
    ring) costs (N-1) header hops plus 2(N-1) data hops."""
    return run_ranks(cluster, n, HOP_JOB, {"RINGREDUCE_SMALL_BYTES": "0"}) / (3 * (n - 1))


def ps_time(cluster, n, shards, nbytes, server_hosts, iters=2) -> float:
    """Slowest worker's best step of a synchronous parameter server."""
    servers = []
    for k in range(shards):
        host = server_hosts[k]
        servers.append(cluster.popen(host, [PY, str(HERE / "ps_baseline.py"), "server", "--port", str(7000 + k),
                                            "--workers", str(n), "--shards", str(shards), "--shard", str(k),
                                            "--bytes", str(nbytes), "--iters", str(iters)],
                                     {**os.environ, "PYTHONPATH": str(REPO)}))
    addrs = ",".join(f"{cluster.addresses[server_hosts[k]]}:{7000 + k}" for k in range(shards))
    workers = [cluster.popen(i, [PY, str(HERE / "ps_baseline.py"), "worker", "--servers", addrs,
                                 "--bytes", str(nbytes), "--iters", str(iters)],
                             {**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
               for i in range(n)]
    outs = [w.communicate(timeout=1800)[0] for w in workers]
    for s in servers:
        s.wait(timeout=60)
    per_worker = [min(json.loads(o)["times"]) for o in outs]
    return max(per_worker)


def progress(total):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="job", file=sys.stderr)
    except ImportError:
        class Quiet:
            def update(self, k=1): pass
            def set_description(self, d): print(d, file=sys.stderr)
            def close(self): pass
        return Quiet()


def measure(args) -> dict:
    ns = [int(x) for x in args.ns.split(",")]
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    max_n, max_shards = max(ns), max(max(n // 2 for n in ns), 1)
    server_hosts = list(range(max_n, max_n + max_shards))
    data = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "rate": args.rate,
            "date": time.strftime("%Y-%m-%d %H:%M"), "ns": ns, "sizes": sizes, "ring": {}, "hop": {},
            "ps1": {}, "psk": {}, "halved": {}}
    jobs = len(ns) * (2 + 2 * len(sizes)) + 4
    bar = progress(jobs)
    with Cluster(max_n + max_shards, rate=args.rate) as cluster:
        for n in ns:
            bar.set_description(f"ring N={n}")
            data["ring"][n] = ring_times(cluster, n, sizes, args.repeats)
            data["hop"][n] = hop_latency(cluster, n)
            bar.update(2)
            for nbytes in sizes:
                bar.set_description(f"PS N={n} {nbytes >> 20} MiB")
                data["ps1"].setdefault(n, {})[nbytes] = ps_time(cluster, n, 1, nbytes, server_hosts)
                bar.update()
                data["psk"].setdefault(n, {})[nbytes] = ps_time(cluster, n, max(n // 2, 1), nbytes, server_hosts)
                bar.update()
    # Links, not cores: halve the rate and the ring's time should double.
    n_check, size_check = ns[len(ns) // 2], max(s for s in sizes if s <= 64 << 20)
    half = f"{rate_bytes(args.rate) * 8 / 2 / 1e6:.0f}mbit"
    bar.set_description(f"ring N={n_check} at {half}")
    with Cluster(n_check, rate=half) as cluster:
        data["halved"] = {"n": n_check, "bytes": size_check, "rate": half,
                          "seconds": ring_times(cluster, n_check, [size_check], args.repeats)[size_check]}
    bar.set_description(f"ring N={max_n} unshaped")
    with Cluster(max_n) as cluster:
        data["unshaped"] = {"n": max_n, "bytes": size_check,
                            "seconds": ring_times(cluster, max_n, [size_check], args.repeats)[size_check]}
    bar.update(2)
    bar.close()
    return data


# ----------------------------------------------------------------- the report


def models(data):
    B = rate_bytes(data["rate"]) * TCP_PAYLOAD
    ring = {n: {s: 2 * (n - 1) * data["hop"][n] + 2 * (n - 1) / n * s / B for s in data["sizes"]} for n in data["ns"]}
    ps = {n: {s: (n * s / B, 2 * n * s / B) for s in data["sizes"]} for n in data["ns"]}
    return B, ring, ps


def plots(data, out_dir: Path, stem: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    B, ring_model, ps_model = models(data)
    ns, sizes = data["ns"], data["sizes"]
    files = []
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, s in zip(axes[0], sizes):
        ax.plot(ns, [data["ring"][n][s] for n in ns], "o-", color="C0", label="ring (measured)")
        ax.plot(ns, [ring_model[n][s] for n in ns], "--", color="C0", alpha=0.6, label="ring (model)")
        ax.plot(ns, [data["ps1"][n][s] for n in ns], "s-", color="C3", label="PS, 1 server (measured)")
        ax.fill_between(ns, [ps_model[n][s][0] for n in ns], [ps_model[n][s][1] for n in ns], color="C3",
                        alpha=0.12, label="PS, 1 server (model: N S/B .. 2N S/B)")
        ax.plot(ns, [data["psk"][n][s] for n in ns], "^-", color="C2", label="PS, N/2 servers (measured)")
        ax.set_title(f"allreduce of {s >> 20} MiB, links {data['rate']}")
        ax.set_xlabel("N (hosts)")
        ax.set_ylabel("seconds")
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"ring vs parameter server, emulated cluster, {data['date']}")
    fig.tight_layout()
    files.append(f"{stem}_time.png")
    fig.savefig(out_dir / files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, s in enumerate(sizes):
        ax.plot(ns, [2 * (n - 1) / n * s / data["ring"][n][s] / 1e6 for n in ns], "o-", color=f"C{i}",
                label=f"ring busbw, {s >> 20} MiB")
        ax.plot(ns, [2 * (n - 1) / n * s / data["ps1"][n][s] / 1e6 for n in ns], "s:", color=f"C{i}",
                label=f"PS (1 server) 'busbw', {s >> 20} MiB")
    ax.axhline(B / 1e6, color="k", lw=0.8, ls="--", label="link payload rate")
    ax.set_xlabel("N (hosts)")
    ax.set_ylabel("busbw (MB/s)")
    ax.set_xticks(ns)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"busbw = 2(N-1)/N * S / time, links {data['rate']}")
    fig.tight_layout()
    files.append(f"{stem}_busbw.png")
    fig.savefig(out_dir / files[-1], dpi=110)
    plt.close(fig)
    return files


def report(data, files) -> str:
    B, ring_model, ps_model = models(data)
    ns, sizes = data["ns"], data["sizes"]
    mib = lambda s: f"{s >> 20} MiB"  # noqa: E731
    lines = [
        "# Scaling: ring allreduce vs parameter server",
        "",
        f"Made by `{data['command']}` on {data['date']}: one network namespace per host on this",
        f"2-core machine, every host's link shaped to {data['rate']} each way with tc (tbf), one",
        "ringreduce rank per host over TCP; the parameter server (benchmarks/ps_baseline.py) runs",
        "on hosts of its own. Times are the best of the repeats, the slowest rank's.",
        "",
        f"Model (alpha-beta): B = link rate x {TCP_PAYLOAD:.3f} (TCP payload per wire byte) = "
        f"{B / 1e6:.1f} MB/s; alpha = measured per-hop latency.",
        "ring: 2(N-1) alpha + 2(N-1)/N S/B. PS with one server: between N S/B (pulls overlap pushes)",
        "and 2 N S/B.",
        "",
    ]
    lines += [f"![time]({files[0]})", "", f"![busbw]({files[1]})", ""]
    lines += ["## Allreduce time (seconds)", "",
              "| N | " + " | ".join(f"ring {mib(s)} (model, error) | PS-1 {mib(s)} (model) | PS-N/2 {mib(s)}" for s in sizes) + " |",
              "|---|" + "---|---|---|" * len(sizes)]
    for n in ns:
        cells = []
        for s in sizes:
            r, m = data["ring"][n][s], ring_model[n][s]
            lo, hi = ps_model[n][s]
            cells.append(f"{r:.3f} ({m:.3f}, {100 * (r - m) / m:+.0f}%) | {data['ps1'][n][s]:.2f} ({lo:.2f}-{hi:.2f}) | "
                         f"{data['psk'][n][s]:.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    big = max(s for s in sizes if s <= 64 << 20)
    n0, n8 = ns[0], ns[-1]
    ring_growth = data["ring"][n8][big] / data["ring"][n0][big]
    ps_growth = data["ps1"][n8][big] / data["ps1"][n0][big]
    bus = lambda n, s: 2 * (n - 1) / n * s / data["ring"][n][s]  # noqa: E731
    worst = max(abs(data["ring"][n][big] - ring_model[n][big]) / ring_model[n][big] for n in ns)
    h, u = data["halved"], data["unshaped"]
    full = data["ring"][h["n"]][h["bytes"]]
    link_mb = lambda m: 2 * (m["n"] - 1) / m["n"] * m["bytes"] / m["seconds"] / 1e6  # noqa: E731
    lines += ["", "## Against the targets", "",
              "| target | measured | |", "|---|---|---|",
              f"| ring within 15% of the model at every N, {mib(big)} | worst {100 * worst:.1f}% | "
              f"{'met' if worst <= 0.15 else 'not met'} |",
              f"| ring >= 3x faster than the 1-server PS at N={n8} ({mib(big)}) | "
              f"{data['ps1'][n8][big] / data['ring'][n8][big]:.2f}x | "
              f"{'met' if data['ps1'][n8][big] >= 3 * data['ring'][n8][big] else 'not met'} |",
              f"| ring busbw at N={n8} >= 85% of N={n0} ({mib(big)}) | {100 * bus(n8, big) / bus(n0, big):.0f}% | "
              f"{'met' if bus(n8, big) >= 0.85 * bus(n0, big) else 'not met'} |",
              f"| time N={n0} -> N={n8}: ring <= 1.75x, single server ~4x ({mib(big)}) | ring {ring_growth:.2f}x, "
              f"PS {ps_growth:.2f}x | {'met' if ring_growth <= 1.75 else 'not met'} |",
              "",
              f"Links, not cores: at N={h['n']}, {mib(h['bytes'])}, halving the rate to {h['rate']} took the ring "
              f"from {full:.3f} s to {h['seconds']:.3f} s ({h['seconds'] / full:.2f}x; 2x if the link is the "
              f"bottleneck). Unshaped, the same ring at N={u['n']} moves {link_mb(u):.0f} MB/s per link, "
              f"{link_mb(u) / (B / 1e6):.1f}x the shaped payload rate: the cores have room to spare.", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="each host's link rate (tc tbf)")
    p.add_argument("--ns", default="2,3,4,6,8")
    p.add_argument("--sizes", default="4M,64M,256M")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "docs"), help="where scaling.md and the plots go")
    p.add_argument("--quick", action="store_true", help="N=2,3, 1M and 4M, into /tmp: checks the pipeline")
    p.add_argument("--from-json", help="re-draw the report from a saved scaling.json")
    args = p.parse_args()
    if args.quick:
        args.ns, args.sizes, args.repeats, args.out = "2,3", "1M,4M", 1, "/tmp/ringreduce-scaling"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text(), object_hook=_int_keys)
    else:
        reason = can_build()
        if reason:
            sys.exit(f"scaling_report: {reason}; run it as root on Linux with iproute2")
        data = measure(args)
        (out / "scaling.json").write_text(json.dumps(data, indent=1))
    files = plots(data, out, "scaling")
    (out / "scaling.md").write_text(report(data, files))
    training = out / "training_scaling.json"
    if training.exists():  # the training section: benchmarks/training_scaling.py re-draws scaling.md with it, kept
        # (training_scaling builds on this module, so this one runs it rather than importing it)
        subprocess.run([sys.executable, str(Path(__file__).with_name("training_scaling.py")),
                        "--from-json", str(training), "--out", str(out)], check=True)
    print(f"wrote {out / 'scaling.md'} and {', '.join(files)}")


def _int_keys(d):
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in d.items()}


if __name__ == "__main__":
    main()
