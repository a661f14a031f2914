"""`specbus bench bus`: latency, throughput and zero-copy between two processes on loopback.

One run measures, all against the same idle-or-loaded machine so the figures compare:
  * the raw floor: a bare pyzmq DEALER in this process and a bare pyzmq ROUTER echo in a
    separate process (no specbus code on either end), tcp and ipc;
  * the full bus path on the hot path: `DirectClient.request(...).result()`, the calling
    thread owning its DEALER (as the verifier's compute thread does), to a real `StreamServer`
    (behind its I/O thread) in another process, tcp and ipc, and its ratio to the raw floor;
  * the same through the I/O-thread client, `StreamClient.request(...).result()` from a
    caller thread (two thread hand-offs per round trip), and its ratio;
  * a per-stage breakdown of where the bus spends its time: encode, decode + validate, the
    caller <-> I/O thread hand-off, and the bus server's path (raw DEALER -> real server);
  * throughput of tensor frames of 4 KiB .. 16 MiB, pipelined (many requests in flight),
    through both clients;
  * whether received tensors are views over the ZeroMQ frame (checked on the server by walking
    the array's base chain to the `zmq.Frame`, not assumed).
Figures are medians / percentiles of this run only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
WARMUP = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-",
                        help="also write the results as JSON to PATH (or stdout with no PATH)")
    parser.add_argument("--rtt-count", type=int, default=3000,
                        help="round trips per latency measurement (default 3000)")
    parser.add_argument("--seconds", type=float, default=1.5,
                        help="time budget per throughput size (default 1.5 s)")
    parser.add_argument("--secret-file", metavar="F", default=None,
                        help="measure CURVE (this cluster secret) vs plain in one run instead: "
                             "RTT p50/p90 and 1 MiB throughput, interleaved (tools/bench_curve)")


def _frame_backed(arr: np.ndarray) -> bool:
    """True if the array's memory is the received zmq.Frame's buffer (no copy happened)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, zmq.Frame)


def _serve_raw(endpoints: list[str], conn) -> None:
    """Raw floor server process: bare pyzmq ROUTER echo, no specbus code at all."""
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for ep in endpoints:
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(ep)
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    poller.register(conn.fileno(), zmq.POLLIN)
    conn.send([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks])
    try:
        while True:
            ready = dict(poller.poll())
            if conn.fileno() in ready:
                return
            for s in socks:
                if s in ready:
                    s.send_multipart(s.recv_multipart(copy=False), copy=False)
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def _serve_bus(endpoints: list[str], conn) -> None:
    """Bus server process: real IOLoop + StreamServer, pong for ping, ack + zero-copy check."""
    from bus.loop import IOLoop
    from bus.sockets import SocketFactory
    from bus.streams import StreamServer, serve_ping
    from codec.structs import Done

    zero_copy: dict[str, bool] = {}

    def handler(req):
        if serve_ping(req):
            return
        if req.message.type == "blob":
            for t in req.message.tensors:
                key = str(t.nbytes)
                zero_copy[key] = zero_copy.get(key, True) and _frame_backed(t)
            req.reply(Done("ok").to_message())
        elif req.message.type == "snapshot_req":  # report: zero-copy verdicts, CPU used
            req.reply(Done("ok", stats={"zero_copy": zero_copy,
                                        "cpu_s": time.process_time()}).to_message())
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


def _timed(fn, count: int) -> dict[str, float]:
    """p50/p99 of `fn()` over `count` calls after a warm-up."""
    return _interleaved({"x": fn}, count, rounds=1)["x"]


def _interleaved(fns: dict, count: int, rounds: int = 10) -> dict[str, dict[str, float]]:
    """p50/p99 of each `fn()`, measured in alternating slices so that load changes during the
    run (other processes on a shared machine) hit every path alike and ratios stay honest."""
    for fn in fns.values():
        for _ in range(WARMUP):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    per_round = max(1, count // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            out = samples[name]
            for _ in range(per_round):
                t0 = clock()
                inner = fn()  # a path that times itself returns its own duration
                out.append(inner if type(inner) is float else clock() - t0)
    return {name: _percentiles(xs) for name, xs in samples.items()}


def _bus_rtt(client, endpoint: str):
    from codec.structs import Ping

    return lambda: client.request(endpoint, Ping().to_message(), timeout=5).result()


def _direct_rtt(client, endpoint: str):
    """A round trip on a DirectClient: the calling thread owns the DEALER, no hand-off."""
    from codec.structs import Ping

    return lambda: client.request(endpoint, Ping().to_message(), timeout=5).result()


def _bus_rtt_in_loop(client, endpoint: str):
    """A round trip issued and completed on the I/O thread (request from a loop callback,
    reply to an `on_reply` callback): the bus client's own cost without any thread hand-off.
    Timed on the loop thread; the caller only waits for the figure."""
    import queue as queue_mod

    from codec.structs import Ping

    box: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    clock = time.perf_counter

    def start() -> None:
        t0 = clock()
        client.request(endpoint, Ping().to_message(), timeout=5,
                       on_reply=lambda call, item: box.put(clock() - t0))

    def once() -> float:
        client.loop.call_soon(start)
        return box.get(timeout=5)

    return once


class _RawDealer:
    """A bare pyzmq DEALER (own context): send `frames`, wait for the echo; no specbus code."""

    def __init__(self, endpoint: str, frames: list) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.frames = frames

    def __call__(self) -> None:
        self.sock.send_multipart(self.frames, copy=False)
        self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _stages(loop, count: int, on_tcp: dict) -> dict[str, float]:
    """Where the time of one request/reply goes (p50, microseconds; tcp).

    The codec stages and the thread hand-off are timed on their own; the rest are differences
    between paths measured interleaved in the same run (each side of the bus against a bare
    pyzmq peer), so they add up to the full path only roughly.
    """
    from codec.messages import decode, encode
    from codec.structs import Ping, Pong

    pong_frames = [zmq.Frame(bytes(f)) for f in encode(Pong().to_message(sender="srv", rid=1))]
    ping = Ping().to_message(sender="bench", rid=1)
    box: queue.SimpleQueue = queue.SimpleQueue()
    raw = on_tcp["raw"]["p50"]
    caller = on_tcp["bus_client_to_raw"]["p50"]
    in_loop = on_tcp["bus_client_in_loop_to_raw"]["p50"]
    return {
        # each message is encoded once (sender) and decoded + validated once (receiver)
        "encode_us": _timed(lambda: encode(ping), count)["p50"],
        "decode_validate_us": _timed(lambda: decode(pong_frames), count)["p50"],
        # caller thread -> I/O thread -> caller thread alone (call_soon, a queue back)
        "handoff_roundtrip_us": _timed(
            lambda: (loop.call_soon(lambda: box.put(None)), box.get()), count)["p50"],
        # bare DEALER <-> bare ROUTER echo, separate processes
        "socket_roundtrip_us": raw,
        # bus client on its own I/O thread vs the bare echo, minus the floor: the client's
        # Python (encode, send, poll, recv, decode, bookkeeping) without hand-offs
        "client_loop_us": round(in_loop - raw, 1),
        # a caller thread instead of the loop thread: the hand-offs and GIL switches in situ
        "client_handoff_us": round(caller - in_loop, 1),
        # DirectClient (the calling thread owns the DEALER) vs the bare echo, minus the floor:
        # the direct client's whole cost, with no hand-off to remove
        "client_direct_us": round(on_tcp["direct_to_raw"]["p50"] - raw, 1),
        # bare DEALER against the real bus server, minus the floor: the server's share
        "server_us": round(on_tcp["raw_to_bus_server"]["p50"] - raw, 1),
    }


def _server_cpu(client, endpoint: str) -> float:
    """The bus server process's CPU time so far (all threads), asked over the bus."""
    from codec.messages import make

    reply = client.request(endpoint, make("snapshot_req", cluster="bench"), timeout=10)
    return reply.result()["stats"]["cpu_s"]


def _cpu_per_rtt(client, direct, endpoint: str, raw, count: int) -> dict[str, float]:
    """CPU time (all threads, user + system) per round trip, in this process and in the bus
    server's: unlike wall-clock latency, barely moved by other processes on the machine."""
    out = {}
    paths = (("bus", _bus_rtt(client, endpoint)), ("direct", _direct_rtt(direct, endpoint)))
    for name, fn in paths:
        c0, s0 = time.process_time(), _server_cpu(client, endpoint)
        for _ in range(count):
            fn()
        c1, s1 = time.process_time(), _server_cpu(client, endpoint)
        out[f"{name}_client_cpu_us"] = round((c1 - c0) / count * 1e6, 1)
        out[f"{name}_server_cpu_us"] = round((s1 - s0) / count * 1e6, 1)
    c0 = time.process_time()
    for _ in range(count):
        raw()
    out["raw_client_cpu_us"] = round((time.process_time() - c0) / count * 1e6, 1)
    return out


def _mib_ab(client, direct, endpoint: str, seconds: float, rounds: int = 3) -> dict:
    """1 MiB frames through both clients in alternating slices (paired A/B on a loaded
    machine): GB/s and CPU per MiB in this process and in the server (all threads), medians."""
    samples: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for name, c in (("StreamClient", client), ("DirectClient", direct)):
            c0, s0 = time.process_time(), _server_cpu(client, endpoint)
            sent, elapsed = _pipelined(c, endpoint, 1 << 20, seconds / rounds)
            gbps = sent * (1 << 20) / elapsed / 1e9
            mib = sent + 1  # and the warm-up request
            c1, s1 = time.process_time(), _server_cpu(client, endpoint)
            row = samples.setdefault(name, {"gbps": [], "client_cpu_us_per_mib": [],
                                            "server_cpu_us_per_mib": []})
            row["gbps"].append(gbps)
            row["client_cpu_us_per_mib"].append((c1 - c0) / mib * 1e6)
            row["server_cpu_us_per_mib"].append((s1 - s0) / mib * 1e6)
    return {name: {k: round(statistics.median(v), 2 if k == "gbps" else 1) for k, v in row.items()}
            for name, row in samples.items()}


def _throughput(client, endpoint: str, nbytes: int, seconds: float) -> float:
    """GB/s of tensor payload, pipelined with a window of requests in flight."""
    sent, elapsed = _pipelined(client, endpoint, nbytes, seconds)
    return round(sent * nbytes / elapsed / 1e9, 3)


def _throughputs(client, direct, tcp: str, ipc: str, seconds: float) -> dict:
    """GB/s per size and transport for both clients, each size measured in two alternating
    slices per client (so load changes hit both alike), the mean of the two."""
    out: dict[str, dict[str, float]] = {}
    for transport, endpoint in (("tcp", tcp), ("ipc", ipc)):
        for k, n in SIZES.items():
            runs: dict[str, list[float]] = {transport: [], f"{transport}_direct": []}
            for _ in range(2):
                runs[transport].append(_throughput(client, endpoint, n, seconds / 2))
                runs[f"{transport}_direct"].append(_throughput(direct, endpoint, n, seconds / 2))
            for key, xs in runs.items():
                out.setdefault(key, {})[k] = round(statistics.fmean(xs), 3)
    return out


def _pipelined(client, endpoint: str, nbytes: int, seconds: float) -> tuple[int, float]:
    """Send `nbytes` tensors for about `seconds`, a window of requests in flight; returns
    (requests sent, seconds taken), after one warm-up request."""
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
    return sent, time.perf_counter() - t0


def _start(target, endpoints: list[str], ctx):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(endpoints, child))
    proc.start()
    return proc, parent, parent.recv()


def _stop(proc, conn) -> None:
    try:
        conn.send("stop")
    except (BrokenPipeError, OSError):
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()


def measure(rtt_count: int = 3000, seconds: float = 1.5) -> dict:
    from bus.direct import DirectClient
    from bus.loop import IOLoop
    from bus.sockets import SocketFactory
    from bus.streams import StreamClient
    from codec.messages import encode, make
    from codec.structs import Ping

    tmp = tempfile.mkdtemp(prefix="specbus-bench-")
    ctx = mp.get_context("spawn")
    procs = []
    loop = direct = None
    try:
        raw = _start(_serve_raw, ["tcp://127.0.0.1:0", f"ipc://{tmp}/raw.ipc"], ctx)
        procs.append(raw[:2])
        bus = _start(_serve_bus, ["tcp://127.0.0.1:0", f"ipc://{tmp}/bus.ipc"], ctx)
        procs.append(bus[:2])
        raw_tcp, raw_ipc = raw[2]
        tcp, ipc = bus[2]
        ping = encode(Ping().to_message(sender="bench", rid=1))  # same bytes the bus sends
        loop = IOLoop(name="bench-client-io").start()
        client = StreamClient(loop, SocketFactory(), sender="bench")
        direct = DirectClient(SocketFactory(), sender="bench")  # owned by this thread
        dealers = [_RawDealer(ep, ping) for ep in (raw_tcp, raw_ipc, tcp)]
        try:
            # tcp: the floor, the full path, and each side of the bus against a bare peer
            on_tcp = _interleaved({
                "raw": dealers[0], "bus": _bus_rtt(client, tcp),
                "direct": _direct_rtt(direct, tcp),
                "raw_to_bus_server": dealers[2],
                "direct_to_raw": _direct_rtt(direct, raw_tcp),
                "bus_client_to_raw": _bus_rtt(client, raw_tcp),  # the echo returns our ping
                "bus_client_in_loop_to_raw": _bus_rtt_in_loop(client, raw_tcp),
            }, rtt_count)
            on_ipc = _interleaved({"raw": dealers[1], "bus": _bus_rtt(client, ipc),
                                   "direct": _direct_rtt(direct, ipc)}, rtt_count)
            cpu = _cpu_per_rtt(client, direct, tcp, dealers[0], rtt_count)
        finally:
            for d in dealers:
                d.close()
        result: dict = {
            "raw_floor_us": {"tcp": on_tcp["raw"], "ipc": on_ipc["raw"]},
            "direct_us": {"tcp": on_tcp["direct"], "ipc": on_ipc["direct"]},
            "bus_us": {"tcp": on_tcp["bus"], "ipc": on_ipc["bus"]},
        }
        for key, path in (("ratio_direct_over_raw_p50", "direct_us"),
                          ("ratio_bus_over_raw_p50", "bus_us")):
            result[key] = {
                t: round(result[path][t]["p50"] / result["raw_floor_us"][t]["p50"], 2)
                for t in ("tcp", "ipc")
            }
        result["stages_us"] = _stages(loop, rtt_count, on_tcp)
        result["cpu_per_rtt_us"] = cpu
        result["throughput_gbps"] = _throughputs(client, direct, tcp, ipc, seconds)
        result["mib_ipc_ab"] = _mib_ab(client, direct, ipc, 3 * seconds)
        report = client.request(tcp, make("snapshot_req", cluster="bench"), timeout=10).result()
        by_size = report["stats"]["zero_copy"]
        result["zero_copy_by_size"] = {k: by_size.get(str(n)) for k, n in SIZES.items()}
        result["zero_copy"] = all(by_size.get(str(n)) for n in SIZES.values() if n >= 64 << 10)
        return result
    finally:
        if direct is not None:
            direct.close()
        if loop is not None:
            loop.stop()
        for proc, conn in procs:
            _stop(proc, conn)
        for p in Path(tmp).glob("*"):
            p.unlink()
        Path(tmp).rmdir()


def render(result: dict) -> str:
    raw = result["raw_floor_us"]
    lines = [
        "specbus bench bus (two processes per pair, loopback)",
        f"{'measure':52} {'tcp':>10} {'ipc':>10}",
    ]
    paths = (("raw floor, bare pyzmq", raw),
             ("full bus path (hot path, DirectClient)", result["direct_us"]),
             ("bus via I/O-thread client (StreamClient)", result["bus_us"]))
    for label, rows in paths:
        for p in ("p50", "p99"):
            lines.append(f"{f'RTT {p} {label} (us)':52} {rows['tcp'][p]:>10} {rows['ipc'][p]:>10}")
    for label, key in (("ratio DirectClient / raw (p50)", "ratio_direct_over_raw_p50"),
                       ("ratio StreamClient / raw (p50)", "ratio_bus_over_raw_p50")):
        lines.append(f"{label:52} {result[key]['tcp']:>10} {result[key]['ipc']:>10}")
    tp = result["throughput_gbps"]
    for k in SIZES:
        for label, t, i in (("StreamClient", "tcp", "ipc"),
                            ("DirectClient", "tcp_direct", "ipc_direct")):
            lines.append(f"{f'throughput {k} {label} (GB/s)':52} {tp[t][k]:>10} {tp[i][k]:>10}")
    zc = ", ".join(f"{k}={v}" for k, v in result["zero_copy_by_size"].items())
    lines.append(f"zero-copy receive: {result['zero_copy']} ({zc})")
    lines.append("per-stage breakdown (p50, us; tcp):")
    for k, v in result["stages_us"].items():
        lines.append(f"  {k:50} {v:>10}")
    lines.append("1 MiB over ipc, the two clients in alternating slices (medians):")
    for name, row in result["mib_ipc_ab"].items():
        lines.append(f"  {name:14} {row['gbps']:>6} GB/s, CPU per MiB: client "
                     f"{row['client_cpu_us_per_mib']} us, server {row['server_cpu_us_per_mib']} us")
    lines.append("CPU per round trip (us, all threads of the process; tcp):")
    for k, v in result["cpu_per_rtt_us"].items():
        lines.append(f"  {k:50} {v:>10}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.secret_file:
        from tools.bench_curve import main as curve_vs_plain

        extra = [] if args.json in (None, "-") else ["--json", args.json]
        return curve_vs_plain(["--secret-file", args.secret_file, *extra])
    if args.rtt_count <= 0 or args.seconds <= 0:
        raise SystemExit("specbus bench bus: --rtt-count and --seconds must be positive")
    result = measure(args.rtt_count, args.seconds)
    print(render(result))
    if args.json == "-":
        print(json.dumps(result))
    elif args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
