"""The suite's one way to wait for something to happen.

`wait_until(pred, timeout)` polls `pred` until it holds and returns whether it did. The
timeout is a generous bound for "it happens" on a loaded CI machine, never a speed verdict
(docs/testing.md): a test asserts the returned bool, not how long it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], object], timeout: float = 20.0, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
