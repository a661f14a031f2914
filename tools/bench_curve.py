"""CURVE vs plain on the bus, in one run: `python -m tools.bench_curve --secret-file F`.

Both variants use sockets from the one factory (`SocketFactory()` vs
`SocketFactory(security=Security.from_file(F))`) on loopback, interleaved in slices so that
machine noise hits both alike:
- rtt: round trip of a small request through StreamClient -> StreamServer (`ping` -> `pong`),
  the path every draft request takes; p50 and p90 in microseconds;
- throughput: 1 MiB frames DEALER -> ROUTER with a window of 16 in flight, each acknowledged
  by a small reply (raw sockets from the factory, no codec), in GB/s.
(`specbus bench bus` belongs to tools/bench_bus.py; this script measures the CURVE cost only.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from bus.loop import IOLoop
from bus.security import Security
from bus.sockets import SocketFactory, bind
from bus.streams import StreamClient, StreamServer, serve_ping
from codec.structs import Ping

MIB = 1 << 20


def rtt_us(factory: SocketFactory, n: int) -> list[float]:
    loop = IOLoop(name="bench-curve").start()
    try:
        server = StreamServer(loop, factory, serve_ping)
        client = StreamClient(loop, factory)
        for _ in range(50):  # connect + handshake + warm-up
            client.request(server.endpoint, Ping().to_message(), timeout=5).result(6)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.request(server.endpoint, Ping().to_message(), timeout=5).result(6)
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    finally:
        loop.stop()


def throughput_gbs(factory: SocketFactory, frames: int, window: int = 16) -> float:
    router = factory.router()
    endpoint = bind(router, "tcp://127.0.0.1:0")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(100):
                peer, _ = router.recv_multipart(copy=False)
                router.send_multipart([peer, b"k"])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    dealer = factory.dealer()
    dealer.connect(endpoint)
    payload = bytes(MIB)
    try:
        for _ in range(4):  # warm-up and handshake
            dealer.send(payload, copy=False)
            dealer.recv()
        sent = acked = 0
        t0 = time.perf_counter()
        while acked < frames:
            while sent < frames and sent - acked < window:
                dealer.send(payload, copy=False)
                sent += 1
            dealer.recv()
            acked += 1
        dt = time.perf_counter() - t0
    finally:
        stop.set()
        t.join(2)
        dealer.close(linger=0)
        router.close(linger=0)
    return frames * MIB / dt / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secret-file", required=True)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved slices per variant")
    ap.add_argument("--pings", type=int, default=1000, help="round trips per slice")
    ap.add_argument("--frames", type=int, default=512, help="1 MiB frames per slice")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    security = Security.from_file(args.secret_file)
    factories = {"plain": SocketFactory(),
                 "curve": SocketFactory(security=security)}
    rtts: dict[str, list[float]] = {k: [] for k in factories}
    tputs: dict[str, list[float]] = {k: [] for k in factories}
    try:
        for _ in range(args.rounds):
            for name, f in factories.items():
                rtts[name] += rtt_us(f, args.pings)
                tputs[name].append(throughput_gbs(f, args.frames))
    finally:
        for f in factories.values():
            f.close()
    result = {}
    for name in factories:
        q = statistics.quantiles(rtts[name], n=10)
        result[name] = {"rtt_p50_us": round(statistics.median(rtts[name]), 1),
                        "rtt_p90_us": round(q[8], 1),
                        "mib_frames_gb_s": round(statistics.median(tputs[name]), 2)}
    p, c = result["plain"], result["curve"]
    result["curve_rtt_overhead_pct"] = round((c["rtt_p50_us"] / p["rtt_p50_us"] - 1) * 100, 1)
    print(f"{'':10} {'rtt p50 us':>11} {'rtt p90 us':>11} {'1 MiB GB/s':>11}")
    for name in factories:
        r = result[name]
        print(f"{name:10} {r['rtt_p50_us']:11.1f} {r['rtt_p90_us']:11.1f} "
              f"{r['mib_frames_gb_s']:11.2f}")
    print(f"CURVE adds {result['curve_rtt_overhead_pct']:.1f} % to the RTT p50 "
          "(target <= 20 %); target >= 1 GB/s on 1 MiB frames")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
