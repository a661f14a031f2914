"""A few daemon threads running queued calls, for blocking zeroconf calls off its callbacks.

Not `concurrent.futures.ThreadPoolExecutor`: its workers are joined when the interpreter exits,
and a zeroconf call caught by `Zeroconf.close()` (a lookup or registration whose coroutine is
scheduled as zeroconf's loop stops) waits its own timeout plus zeroconf's 10 s safety margin:
a node told to stop then took 11-12 s to exit. Daemon workers never hold the exit; work still
queued at `close()` is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class DaemonWorkers:
    """`submit(fn, *args)` runs `fn(*args)` on one of `count` daemon threads."""

    def __init__(self, count: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for t in self._threads:
            t.start()

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        return tuple(self._threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue a call; False once closed (the call is not run)."""
        if self._closed:
            return False
        self._queue.put((fn, args))
        return True

    def close(self) -> None:
        """Drop queued calls and let each worker end after its current one; never blocks."""
        self._closed = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put(_STOP)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._closed:
                continue
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one failed call must not end the worker
                log.exception("background call %r failed", fn)
