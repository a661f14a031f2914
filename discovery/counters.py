"""Counters with one writer thread: the owner increments, every other thread reads copies.

Membership's counters are written on the node's I/O thread only; a callback arriving on
another thread (zeroconf's) posts its work to the loop instead of counting in place. `inc`
enforces that, so a new code path that breaks the rule fails loudly in tests instead of
losing increments in production.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


class WrongThread(RuntimeError):
    """A counter was written from a thread that does not own it (a programming error)."""


class Counters:
    """Named integer counters owned by the thread for which `is_owner()` is true."""

    def __init__(self, names: Iterable[str], is_owner: Callable[[], bool]) -> None:
        self._values = dict.fromkeys(names, 0)
        self._is_owner = is_owner

    def inc(self, name: str, n: int = 1) -> None:
        if not self._is_owner():
            raise WrongThread(f"counter {name!r} written from thread "
                              f"{threading.current_thread().name!r}, not its owner")
        self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        """A copy (the keys never change after creation, so copying while the owner writes is
        safe; values are each as of some moment during the copy)."""
        return dict(self._values)
