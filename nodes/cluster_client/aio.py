"""The cluster client's async face: `failover.Failover` driven from an asyncio loop (the gateway).

The replies reach the loop through `loop.call_soon_threadsafe` from the bus I/O thread; the
StreamClient's `request` and `cancel` are its thread-safe entry points, so no socket is touched
here. Every decision is the core's, as in the sync face (sync.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from nodes.cluster_client.failover import POLL_S, Failover


async def events(core: Failover, client, loop: asyncio.AbstractEventLoop
                 ) -> AsyncIterator[Any]:
    """core.Started, Piece, Resuming, then Final; raises core.ClusterError. Closing the
    generator (a client that went away) cancels the verifier's work and frees the slot, or
    gives up its place in the line while it waits for one."""
    woken = asyncio.Event()
    core.wake = lambda: None if loop.is_closed() else loop.call_soon_threadsafe(woken.set)
    try:
        while not core.finished:
            woken.clear()
            att = core.begin()
            if att is None:  # every verifier is full: wait in the balancer's line
                try:
                    await asyncio.wait_for(woken.wait(), core.wait_s())
                except TimeoutError:
                    pass
                continue
            queue: asyncio.Queue = asyncio.Queue()
            call = None
            try:
                call = client.request(att.verifier.endpoint, att.message,
                                      on_reply=_forward_to(queue, loop))
                for ev in core.started(att):
                    yield ev
                while att.open:
                    try:
                        item = await asyncio.wait_for(queue.get(), POLL_S)
                    except TimeoutError:
                        item = None
                    for ev in core.quiet(att) if item is None else core.reply(att, item):
                        yield ev
            finally:
                core.end(att)
                if call is not None and not call.done:
                    call.cancel()  # thread-safe: tells the verifier to drop the work
    finally:
        core.close()  # a place still held in the line is given up (a client that left)


def _forward_to(queue: asyncio.Queue, loop: asyncio.AbstractEventLoop):
    """A reply callback (bus I/O thread) that hands each reply to the asyncio loop."""

    def forward(_call, item) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return forward
