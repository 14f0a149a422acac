"""A parameter server, the baseline the ring is measured against.

Synchronous (the seeds' description): every worker pushes its gradient, the
server sums them and sends the sum back to every worker. With k shards the
tensor is split into k nearly equal parts, one per server, and each worker
talks to all k servers at once. The busiest link, a server's, carries
N * S / k bytes in and as many out per step, so time grows with N.

Asynchronous: the server applies each push as it arrives (params += grad)
and answers that worker alone with the current parameters: no barrier.

    python ps_baseline.py server --port 7000 --workers 4 --bytes 64M --iters 5 [--async]
    python ps_baseline.py worker --servers 10.0.0.9:7000,10.0.0.10:7000 --bytes 64M --iters 5
    python ps_baseline.py worker ... --compute 0.8      # each step: 0.8 s of stand-in compute, then push/pull

A worker prints one JSON line: its per-step times (and pushes per second in
async mode). Plain numpy over TCP sockets: the links, not this code, are the
bottleneck it is built to show.
"""
from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time

import numpy as np

DTYPE = np.float32


def shard_bounds(count: int, shards: int, i: int) -> tuple[int, int]:
    """Elements of shard i: the first count % shards shards get one extra."""
    base, extra = divmod(count, shards)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def send_array(sock: socket.socket, a: np.ndarray) -> None:
    sock.sendall(struct.pack("<Q", a.nbytes))
    sock.sendall(memoryview(a).cast("B"))


def recv_into(sock: socket.socket, out: np.ndarray) -> None:
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if n != out.nbytes:
        raise ConnectionError(f"expected {out.nbytes} bytes, peer sent {n}")
    view, got = memoryview(out).cast("B"), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed")
        buf += part
    return bytes(buf)


def _tune(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _parallel(fns) -> None:
    errors = []

    def wrap(f):
        try:
            f()
        except BaseException as exc:  # surfaced below
            errors.append(exc)
    threads = [threading.Thread(target=wrap, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# ------------------------------------------------------------------- server


def serve(port: int, workers: int, count: int, iters: int, asynchronous: bool = False,
          ready: threading.Event | None = None, host: str = "0.0.0.0",
          bound: list | None = None) -> np.ndarray:
    """Serves `iters` steps to `workers` workers; returns the final parameters.
    port 0: the OS picks a free one, appended to `bound` before `ready` is set
    (no window for another process to take a port chosen in advance)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(workers)
    if bound is not None:
        bound.append(listener.getsockname()[1])
    if ready is not None:
        ready.set()
    conns = []
    for _ in range(workers):
        c, _ = listener.accept()
        _tune(c)
        conns.append(c)
    listener.close()
    params = np.zeros(count, dtype=DTYPE)
    if asynchronous:
        lock = threading.Lock()

        def one_worker(c):
            grad = np.empty(count, dtype=DTYPE)
            for _ in range(iters):
                recv_into(c, grad)
                with lock:  # apply as it arrives, answer with what is there now
                    np.add(params, grad, out=params)
                    snapshot = params.copy()
                send_array(c, snapshot)
        _parallel([lambda c=c: one_worker(c) for c in conns])
    else:
        grads = [np.empty(count, dtype=DTYPE) for _ in conns]
        for _ in range(iters):
            _parallel([lambda c=c, g=g: recv_into(c, g) for c, g in zip(conns, grads)])
            total = grads[0].copy()
            for g in grads[1:]:  # in place: np.add.reduce would first stack every gradient into one array
                total += g
            _parallel([lambda c=c: send_array(c, total) for c in conns])
            params = total
    for c in conns:
        c.close()
    return params


# ------------------------------------------------------------------- worker


def work(servers: list[tuple[str, int]], count: int, iters: int, grad: np.ndarray | None = None,
         asynchronous: bool = False, compute_s: float = 0.0) -> dict:
    """Runs `iters` push/pull steps against every shard; returns times and the last result.
    compute_s: a stand-in for the forward and backward pass, slept before each
    push and counted in the step's time (a training step, not just its traffic)."""
    k = len(servers)
    conns = []
    for host, port in servers:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = socket.create_connection((host, port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        _tune(c)
        conns.append(c)
    grad = np.ones(count, dtype=DTYPE) if grad is None else grad
    result = np.empty(count, dtype=DTYPE)
    bounds = [shard_bounds(count, k, i) for i in range(k)]
    times = []
    t_all = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        if compute_s:
            time.sleep(compute_s)

        def step(c, lo, hi):
            send_array(c, grad[lo:hi])
            recv_into(c, result[lo:hi])
        _parallel([lambda c=c, b=b: step(c, *b) for c, b in zip(conns, bounds)])
        times.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - t_all
    for c in conns:
        c.close()
    out = {"times": times, "result": result}
    if asynchronous:
        out["pushes_per_s"] = iters / elapsed
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--workers", type=int, required=True)
    s.add_argument("--shards", type=int, default=1, help="how many servers split the tensor")
    s.add_argument("--shard", type=int, default=0, help="which of them this is")
    w = sub.add_parser("worker")
    w.add_argument("--servers", required=True, help="host:port,host:port (one per shard)")
    for q in (s, w):
        q.add_argument("--bytes", required=True, help="whole tensor, e.g. 64M")
        q.add_argument("--iters", type=int, default=3)
        q.add_argument("--async", dest="asynchronous", action="store_true")
    w.add_argument("--compute", type=float, default=0.0, help="seconds of stand-in compute before each push")
    args = p.parse_args()
    count = parse_bytes(args.bytes) // np.dtype(DTYPE).itemsize
    if args.role == "server":
        lo, hi = shard_bounds(count, args.shards, args.shard)
        serve(args.port, args.workers, hi - lo, args.iters, args.asynchronous)
    else:
        servers = [(h, int(port)) for h, port in (x.rsplit(":", 1) for x in args.servers.split(","))]
        out = work(servers, count, args.iters, asynchronous=args.asynchronous, compute_s=args.compute)
        out.pop("result")
        print(json.dumps(out))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
