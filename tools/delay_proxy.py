"""A userspace TCP delay line: forward a port to another, holding the bytes a while each way.

This kernel has no netem, so the latency sweep of `specbus bench decode` puts this proxy in
front of a proposer's request port and starts the proposer with `--advertise PROXY`: verifiers
then reach it only through the delay. Each direction of each connection is a FIFO of
`(deliver_at, bytes)`; jitter never reorders bytes (a chunk is never delivered before the one
read ahead of it). Loopback only by default; bounded connections and buffers.

    python -m tools.delay_proxy --listen 127.0.0.1:7000 --target 127.0.0.1:6000 --rtt-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
MAX_BUFFERED = 8 * 1024 * 1024  # per direction; reading pauses above it (backpressure)
MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class Delay:
    """How long bytes are held in each direction: `one_way_s` plus uniform jitter."""

    one_way_s: float
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.one_way_s <= 10 or not 0 <= self.jitter_s <= 10:
            raise ValueError("delay and jitter must be within 0..10 s")

    def sample(self, rng: random.Random) -> float:
        return self.one_way_s + (rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0)


class _Line:
    """One direction of one connection: read, hold, then write in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 delay: Delay, rng: random.Random) -> None:
        self.reader, self.writer, self.delay, self.rng = reader, writer, delay, rng
        self.queue: deque[tuple[float, bytes]] = deque()
        self.buffered = 0
        self.ready = asyncio.Event()  # something queued
        self.room = asyncio.Event()  # under MAX_BUFFERED
        self.room.set()
        self.eof = False

    async def pump_in(self) -> None:
        last = 0.0
        while True:
            await self.room.wait()
            data = await self.reader.read(CHUNK)
            if not data:
                break
            last = max(last, time.monotonic() + self.delay.sample(self.rng))
            self.queue.append((last, data))
            self.buffered += len(data)
            if self.buffered >= MAX_BUFFERED:
                self.room.clear()
            self.ready.set()
        self.eof = True
        self.ready.set()

    async def pump_out(self) -> None:
        while True:
            if not self.queue:
                if self.eof:
                    break
                self.ready.clear()
                await self.ready.wait()
                continue
            at, data = self.queue[0]
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.queue.popleft()
            self.buffered -= len(data)
            if self.buffered < MAX_BUFFERED:
                self.room.set()
            self.writer.write(data)
            await self.writer.drain()
        if self.writer.can_write_eof():
            self.writer.write_eof()


class DelayProxy:
    """Listens on `listen_host:listen_port` (0: ephemeral) and forwards to `target`."""

    def __init__(self, target: tuple[str, int], delay: Delay,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, seed: int = 0,
                 cpus: set[int] | None = None) -> None:
        self.target, self.delay = target, delay
        #: pin the proxy's thread (Linux): a network costs the machines it joins nothing, so
        #: a sweep keeps the forwarding work off the core that plays the verifier
        self.cpus = cpus
        self.listen_host, self.listen_port = listen_host, listen_port
        self.rng = random.Random(seed)
        self.connections = 0
        self.refused = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    async def _handle(self, c_reader, c_writer) -> None:
        me = asyncio.current_task()
        self._tasks.add(me)
        try:
            await self._forward(c_reader, c_writer)
        except asyncio.CancelledError:
            # stopping the proxy cancels live connections; ending quietly keeps asyncio's
            # stream callback (Python 3.11) from logging the cancellation as an error
            pass
        finally:
            self._tasks.discard(me)

    async def _forward(self, c_reader, c_writer) -> None:
        if len(self._tasks) > MAX_CONNECTIONS * 5:
            self.refused += 1
            c_writer.close()
            return
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.warning("delay proxy: cannot reach %s:%d: %s", *self.target, exc)
            c_writer.close()
            return
        self.connections += 1
        up = _Line(c_reader, t_writer, self.delay, self.rng)
        down = _Line(t_reader, c_writer, self.delay, self.rng)
        tasks = [asyncio.ensure_future(f()) for f in
                 (up.pump_in, up.pump_out, down.pump_in, down.pump_out)]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._tasks.difference_update(tasks)
            for w in (c_writer, t_writer):
                w.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen_host,
                                                  self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]

    def start(self) -> DelayProxy:
        """Run on a thread of its own; returns once the port is bound."""
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            if self.cpus and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, self.cpus)  # this thread only
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="delay-proxy", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("delay proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.delay_proxy", description=__doc__)
    p.add_argument("--listen", type=host_port, default=("127.0.0.1", 0))
    p.add_argument("--target", type=host_port, required=True)
    p.add_argument("--rtt-ms", type=float, default=0.0, help="added round trip (half each way)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform 0..J added each way")
    p.add_argument("--seconds", type=float, default=600.0, help="stop after this long")
    args = p.parse_args(argv)
    try:
        delay = Delay(args.rtt_ms / 2000.0, args.jitter_ms / 1000.0)
    except ValueError as exc:
        p.error(str(exc))
    proxy = DelayProxy(args.target, delay, *args.listen).start()
    print(f"delay proxy {proxy.address} -> {args.target[0]}:{args.target[1]}", flush=True)
    try:
        time.sleep(max(0.0, min(args.seconds, 24 * 3600)))
    except KeyboardInterrupt:
        pass
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
