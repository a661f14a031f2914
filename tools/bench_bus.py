"""`specbus bench bus`: latency, throughput and zero-copy between two processes on loopback.

The server runs in a separate process with the real bus (IOLoop + StreamServer). The client
measures, in one run:
  * round-trip time of a small request through the full bus path (caller thread -> I/O thread
    -> socket -> server I/O thread -> back), and, as the floor it is compared against, a raw
    pyzmq DEALER owned by the caller talking to the same server;
  * throughput of tensor frames of 4 KiB .. 16 MiB, pipelined (many requests in flight);
  * whether received tensors are views over the ZeroMQ frame (checked on the server by walking
    the array's base chain to the `zmq.Frame`, not assumed).
Both tcp and ipc transports.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-",
                        help="also write the results as JSON to PATH (or stdout with no PATH)")
    parser.add_argument("--rtt-count", type=int, default=3000,
                        help="round trips per latency measurement (default 3000)")
    parser.add_argument("--seconds", type=float, default=1.5,
                        help="time budget per throughput size (default 1.5 s)")


def _frame_backed(arr: np.ndarray) -> bool:
    """True if the array's memory is the received zmq.Frame's buffer (no copy happened)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, zmq.Frame)


def _serve(endpoints: list[str], conn) -> None:
    """Server process: real bus, pong for ping, ack + zero-copy check for blobs."""
    from bus.loop import IOLoop
    from bus.sockets import SocketFactory
    from bus.streams import StreamServer, serve_ping
    from codec.messages import make

    zero_copy: dict[str, bool] = {}

    def handler(req):
        if serve_ping(req):
            return
        if req.message.type == "blob":
            for t in req.message.tensors:
                key = str(t.nbytes)
                zero_copy[key] = zero_copy.get(key, True) and _frame_backed(t)
            req.reply(make("done", finish_reason="ok"))
        elif req.message.type == "snapshot_req":  # report and quit
            req.reply(make("done", finish_reason="ok", stats={"zero_copy": zero_copy}))
        else:
            req.fail("unsupported", req.message.type)

    loop = IOLoop(name="bench-server-io").start()
    factory = SocketFactory()
    servers = [StreamServer(loop, factory, handler, bind_endpoint=ep) for ep in endpoints]
    conn.send([s.endpoint for s in servers])
    conn.recv()  # parent says stop
    loop.stop()


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50": round(statistics.median(s) * 1e6, 1),
        "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1),
    }


def _rtt_bus(client, endpoint: str, count: int) -> dict[str, float]:
    from codec.messages import make

    for _ in range(200):  # warm up connection and caches
        client.request(endpoint, make("ping"), timeout=5).result()
    samples = []
    for _ in range(count):
        t0 = time.perf_counter()
        client.request(endpoint, make("ping"), timeout=5).result()
        samples.append(time.perf_counter() - t0)
    return _percentiles(samples)


def _rtt_raw(factory, endpoint: str, count: int) -> dict[str, float]:
    from codec.messages import decode, encode, make

    sock = factory.dealer()
    sock.connect(endpoint)
    try:
        samples = []
        for i in range(count + 200):
            t0 = time.perf_counter()
            sock.send_multipart(encode(make("ping", rid=i + 1)), copy=False)
            decode(sock.recv_multipart(copy=False))
            if i >= 200:
                samples.append(time.perf_counter() - t0)
        return _percentiles(samples)
    finally:
        sock.close(linger=0)


def _throughput(client, endpoint: str, nbytes: int, seconds: float) -> float:
    """GB/s of tensor payload, pipelined with a window of requests in flight."""
    from codec.messages import make

    payload = np.ones(nbytes, dtype=np.uint8)  # never mutated while sends are in flight
    window = max(2, min(64, (64 << 20) // nbytes))
    client.request(endpoint, make("blob", tensors=[payload]), timeout=30).result()
    sent = 0
    inflight = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or sent < 4:
        while len(inflight) < window:
            inflight.append(client.request(endpoint, make("blob", tensors=[payload]), timeout=30))
            sent += 1
        inflight.pop(0).result()
    for call in inflight:
        call.result()
    elapsed = time.perf_counter() - t0
    return round(sent * nbytes / elapsed / 1e9, 3)


def measure(rtt_count: int = 3000, seconds: float = 1.5) -> dict:
    from bus.loop import IOLoop
    from bus.sockets import SocketFactory
    from bus.streams import StreamClient
    from codec.messages import make

    tmp = tempfile.mkdtemp(prefix="specbus-bench-")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(["tcp://127.0.0.1:0", f"ipc://{tmp}/bus.ipc"], child))
    proc.start()
    try:
        tcp, ipc = parent.recv()
        loop = IOLoop(name="bench-client-io").start()
        factory = SocketFactory()
        client = StreamClient(loop, factory, sender="bench")
        result: dict = {"rtt_us": _rtt_bus(client, tcp, rtt_count)}
        result["rtt_raw_pyzmq_us"] = _rtt_raw(factory, tcp, rtt_count)
        result["rtt_ipc_us"] = _rtt_bus(client, ipc, rtt_count)
        result["throughput_gbps"] = {k: _throughput(client, tcp, n, seconds)
                                     for k, n in SIZES.items()}
        result["throughput_ipc_gbps"] = {k: _throughput(client, ipc, n, seconds)
                                         for k, n in SIZES.items()}
        report = client.request(tcp, make("snapshot_req", cluster="bench"), timeout=10).result()
        by_size = report["stats"]["zero_copy"]
        result["zero_copy_by_size"] = {k: by_size.get(str(n)) for k, n in SIZES.items()}
        result["zero_copy"] = all(by_size.get(str(n)) for n in SIZES.values() if n >= 64 << 10)
        loop.stop()
        return result
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        for p in Path(tmp).glob("*"):
            p.unlink()
        Path(tmp).rmdir()


def render(result: dict) -> str:
    lines = [
        "specbus bench bus (two processes, loopback)",
        f"{'measure':34} {'tcp':>12} {'ipc':>12}",
        f"{'RTT p50 bus (us)':34} {result['rtt_us']['p50']:>12} {result['rtt_ipc_us']['p50']:>12}",
        f"{'RTT p99 bus (us)':34} {result['rtt_us']['p99']:>12} {result['rtt_ipc_us']['p99']:>12}",
        f"{'RTT p50 raw pyzmq floor (us)':34} {result['rtt_raw_pyzmq_us']['p50']:>12} {'':>12}",
        f"{'RTT p99 raw pyzmq floor (us)':34} {result['rtt_raw_pyzmq_us']['p99']:>12} {'':>12}",
    ]
    for k in SIZES:
        lines.append(f"{'throughput ' + k + ' (GB/s)':34} {result['throughput_gbps'][k]:>12} "
                     f"{result['throughput_ipc_gbps'][k]:>12}")
    zc = ", ".join(f"{k}={v}" for k, v in result["zero_copy_by_size"].items())
    lines.append(f"zero-copy receive: {result['zero_copy']} ({zc})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.rtt_count <= 0 or args.seconds <= 0:
        raise SystemExit("specbus bench bus: --rtt-count and --seconds must be positive")
    result = measure(args.rtt_count, args.seconds)
    print(render(result))
    if args.json == "-":
        print(json.dumps(result))
    elif args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
