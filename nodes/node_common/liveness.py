"""Work dies with its connection: a periodic probe of every connection that has work here.

A role that keeps work for a client (a verifier's queued or running generations, a proposer's
draft sessions) must not keep it for a client that is gone, and must not rely on the client
being a member to find out: a raw DEALER that queues work and vanishes never joins, and a
member's `leave` can be forged on a cluster without a secret. So the connection decides.
While any request of the watched types is in flight, the I/O thread probes each requesting
connection every `every_s` seconds (`StreamServer.peer_connected`: a killed process's
connection is gone at once, a stalled one keeps it) and drops the work of those that are gone,
answering each with an `error` (`client_gone`) so a client that is in fact listening learns
its stream ended. `check(sender)` probes one sender's connections at once (membership said it
left or died). Runs on the I/O thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from bus.streams import Request
from nodes.node_common.host import RoleHost

log = logging.getLogger(__name__)

CLIENT_GONE = "client_gone"
SWEEP_S = 2.0


class ConnectionSweep:
    def __init__(self, node: RoleHost, types: tuple[str, ...], every_s: float = SWEEP_S,
                 on_drop: Callable[[Request], None] | None = None) -> None:
        self.node = node
        self.types = types
        self.every_s = every_s
        self.on_drop = on_drop  # counts a drop (I/O thread)
        self._armed = False

    def arm(self) -> None:
        """Make sure a sweep is due (call whenever work is accepted)."""
        if not self._armed:
            self._armed = True
            self.node.loop.call_later(self.every_s, self._sweep)

    def check(self, sender: str) -> None:
        """Probe the connections of one sender now (membership says it left or died)."""
        reqs = [r for r in self._requests() if r.message.sender == sender]
        if reqs:
            self._drop_gone(reqs, f"client {sender} left or died and its connection closed")

    def _requests(self) -> list[Request]:
        server = self.node.server
        return [r for t in self.types for r in server.requests(t)]

    def _sweep(self) -> None:
        self._armed = False
        reqs = self._requests()
        if not reqs:
            return  # nothing in flight: the next accepted request arms a sweep again
        self._drop_gone(reqs, "its connection closed")
        self.arm()

    def _drop_gone(self, reqs: list[Request], why: str) -> None:
        server = self.node.server
        connected: dict[bytes, bool] = {}
        dropped = 0
        for r in reqs:
            if r.peer not in connected:
                connected[r.peer] = server.peer_connected(r.peer)
            if not connected[r.peer]:
                dropped += 1
                if self.on_drop is not None:
                    self.on_drop(r)
                # answers `client_gone`, then cancels the work
                server.drop(r, CLIENT_GONE, f"dropped: {why}")
        if dropped:
            log.info("dropped %d request(s) of %s: %s", dropped, "/".join(self.types), why)
