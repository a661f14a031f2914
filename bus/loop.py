"""The I/O thread: owns every socket, polls them, runs timers and cross-thread calls.

Compute threads never touch a socket of the loop (a `bus.direct.DirectClient` is the one
exception: its DEALERs belong to the thread that made it). They hand work to the loop with
`call_soon` (a deque plus a self-pipe wake-up, both safe from any thread) and get results back
through queues or callbacks. The pipe is written only when the loop may be asleep (one byte
per sleep, not per call), and code already on the loop thread sends directly, without a
hand-off. Because heartbeats and replies are sent from this thread, a long model forward in
the main thread never delays them (the forward releases the GIL in torch/mlx kernels).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from bus.sockets import close_socket

log = logging.getLogger(__name__)

ReadHandler = Callable[[zmq.Socket], None]
BATCH = 256  # messages read per wake-up: keeps timers and other sockets fair


# plain ints: pyzmq's flag enums cost ~1 us per `|` or `&`, several times per message
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_COPY_THRESHOLD = zmq.COPY_THRESHOLD  # libzmq copies below this anyway: skip the Frame object


def send_frames(sock: zmq.Socket, frames: list) -> None:
    """Send a multipart message without blocking (raises zmq.Again when the queue is full).

    Large buffers go zero-copy; small ones are copied, which pyzmq would do anyway below
    `zmq.COPY_THRESHOLD`, minus the cost of building a `zmq.Frame` around each. The caller
    must not mutate a zero-copy buffer until libzmq is done with it.
    """
    last = len(frames) - 1
    send = sock.send
    for i, frame in enumerate(frames):
        flags = _NOBLOCK if i == last else _NOBLOCK | _SNDMORE
        if type(frame) is bytes:  # headers, peer ids: skip hasattr's AttributeError (~0.5 us)
            size = len(frame)
        else:
            size = frame.nbytes if hasattr(frame, "nbytes") else len(frame)
        send(frame, flags, copy=size < _COPY_THRESHOLD)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """Receive one multipart message without blocking, as zero-copy `zmq.Frame`s."""
    recv = sock.recv
    frame = recv(_NOBLOCK, copy=False)
    parts = [frame]
    while frame.more:
        frame = recv(_NOBLOCK, copy=False)
        parts.append(frame)
    return parts


def frames_ready(sock: zmq.Socket, limit: int = BATCH):
    """Yield the multipart messages waiting on `sock` (zero-copy frames), at most `limit`.

    Asks ZMQ_EVENTS before each further read instead of reading until `zmq.Again`: raising
    and catching that exception costs ~10 us, more than the rest of a small message's path.
    """
    for i in range(limit):
        # the poller said readable, so the first read needs no check
        if i and not sock.getsockopt(_EVENTS) & _POLLIN:
            return
        try:
            yield recv_frames(sock)
        except zmq.Again:  # a handler before us drained it, or a spurious wake: rare
            return


class Timer:
    """A scheduled call on the loop; `cancel()` is safe from any thread."""

    __slots__ = ("when", "fn", "interval", "cancelled")

    def __init__(self, when: float, fn: Callable[[], Any], interval: float | None) -> None:
        self.when = when
        self.fn = fn
        self.interval = interval
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class IOLoop:
    """A thread running a zmq.Poller over registered sockets, timers and queued calls."""

    def __init__(self, name: str = "specbus-io") -> None:
        self.name = name
        self._poller = zmq.Poller()
        self._readers: dict[zmq.Socket, ReadHandler] = {}
        self._calls: collections.deque[Callable[[], Any]] = collections.deque()
        self._timers: list[tuple[float, int, Timer]] = []
        self._timer_seq = itertools.count()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._closers: list[Callable[[], None]] = []
        self._stopping = False
        self._closed = False
        self._wake_lock = threading.Lock()
        self._wake_pending = False  # a byte is in the pipe (or the loop is awake to run calls)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.errors = 0  # handler exceptions caught (logged, loop kept running)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> IOLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop: run pending calls, close owned sockets, join the thread."""
        if not self._thread.is_alive():
            return
        self.call_soon(self._request_stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _request_stop(self) -> None:
        self._stopping = True

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def in_loop(self) -> bool:
        return threading.get_ident() == self._thread.ident

    # -- scheduling (thread-safe) ---------------------------------------------------------
    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run `fn()` on the I/O thread as soon as possible."""
        with self._wake_lock:  # the pipe must not be closed (and its fd reused) mid-write
            if self._closed:
                return  # loop finished: nothing left to run it
            self._calls.append(fn)
            if self._wake_pending:
                return  # the loop has not drained the last byte yet: it will see this call
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # pipe full: the loop is already due to wake

    def run_sync(self, fn: Callable[[], Any], timeout: float | None = 10.0) -> Any:
        """Run `fn()` on the I/O thread and return its result (or raise its exception)."""
        if self.in_loop() or not self._thread.is_alive():
            return fn()
        fut: Future = Future()

        def call() -> None:
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                fut.set_exception(exc)

        self.call_soon(call)
        return fut.result(timeout)

    def call_later(self, delay: float, fn: Callable[[], Any]) -> Timer:
        return self._schedule(Timer(time.monotonic() + delay, fn, None))

    def call_every(self, interval: float, fn: Callable[[], Any],
                   first: float | None = None) -> Timer:
        when = time.monotonic() + (interval if first is None else first)
        return self._schedule(Timer(when, fn, interval))

    def _schedule(self, timer: Timer) -> Timer:
        if self.in_loop():
            heapq.heappush(self._timers, (timer.when, next(self._timer_seq), timer))
        else:
            self.call_soon(
                lambda: heapq.heappush(self._timers, (timer.when, next(self._timer_seq), timer))
            )
        return timer

    # -- sockets (loop thread only) ----------------------------------------------------------
    def add_reader(self, sock: zmq.Socket, handler: ReadHandler) -> None:
        """Call `handler(sock)` when `sock` is readable; the loop owns and will close it."""
        self._readers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_reader(self, sock: zmq.Socket, close: bool = True) -> None:
        if sock in self._readers:
            del self._readers[sock]
            self._poller.unregister(sock)
        if close:
            close_socket(sock)

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run `fn()` on the loop thread when it stops (close sockets not registered)."""
        self._closers.append(fn)

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._run_calls()
                if self._stopping:
                    break
                timeout = self._next_timeout_ms()
                for sock, _ in self._poller.poll(timeout):
                    if sock == self._wake_r:
                        self._drain_wake()
                        continue
                    handler = self._readers.get(sock)
                    if handler is not None:
                        self._guard(handler, sock)
                self._run_timers()
        finally:
            self._shutdown()

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one bad handler must not kill the I/O thread
            self.errors += 1
            log.exception("I/O loop handler %r failed", fn)

    def _run_calls(self) -> None:
        for _ in range(len(self._calls)):
            self._guard(self._calls.popleft())

    def _next_timeout_ms(self) -> int | None:
        if self._calls:
            return 0
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        if not self._timers:
            return None
        return max(0, int((self._timers[0][0] - time.monotonic()) * 1000) + 1)

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._guard(timer.fn)
            if timer.interval is not None and not timer.cancelled:
                timer.when = max(timer.when + timer.interval, now)
                heapq.heappush(self._timers, (timer.when, next(self._timer_seq), timer))

    def _drain_wake(self) -> None:
        # Clear the flag before the calls run (the loop runs calls after every poll), so a
        # call queued from now on writes a fresh byte.
        with self._wake_lock:
            self._wake_pending = False
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass

    def _shutdown(self) -> None:
        for fn in self._closers:
            self._guard(fn)
        for sock in list(self._readers):
            self.remove_reader(sock, close=True)
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
