"""Delivering membership events to subscribers on their own thread.

The I/O thread only appends to a queue; a dedicated thread calls the subscribers, so a slow
or failing callback can never delay heartbeats or socket handling.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from discovery.table import Event

log = logging.getLogger(__name__)

Subscriber = Callable[[Event], None]
_STOP = object()


class EventBus:
    """Fan events out to callbacks on one thread, in order."""

    def __init__(self, name: str = "specbus-events") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self.errors = 0

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(event)` for every later event; returns an unsubscribe function."""
        with self._lock:
            self._subscribers.append(fn)
        self._ensure_started()

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    def publish(self, events: list[Event]) -> None:
        """Queue events for the subscribers of the moment (any thread, never blocks)."""
        if events:
            self._ensure_started()
        for ev in events:
            self._queue.put(ev)

    def _ensure_started(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Deliver what is queued, then stop the thread."""
        self._queue.put(_STOP)
        if self._started and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            ev = self._queue.get()
            if ev is _STOP:
                return
            with self._lock:
                subscribers = list(self._subscribers)
            for fn in subscribers:
                try:
                    fn(ev)
                except Exception:  # noqa: BLE001 - one bad subscriber must not stop the others
                    self.errors += 1
                    log.exception("membership subscriber %r failed on %s", fn, ev.kind)
