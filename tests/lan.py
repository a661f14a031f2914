"""The suite's one way to get a LAN of network namespaces (`tools.netns.Lan`) for a test.

`lan_or_skip(hosts, prefix)` builds it, closes it (deleting every namespace) on exit, and skips
the test where namespaces cannot be made here (not root, no iproute2): the netns tests'
fixtures wrap it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tools.netns import Lan, NetnsUnavailable


@contextmanager
def lan_or_skip(hosts: int, prefix: str) -> Iterator[Lan]:
    try:
        net = Lan(hosts=hosts, prefix=prefix)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with net:
        yield net
