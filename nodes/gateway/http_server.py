"""The gateway's HTTP connections, hardened: a bounded number, a deadline for the first request's
headers, and OpenAI error objects even for requests aiohttp refuses before routing.

aiohttp's `RequestHandler` holds a connection that never sends a request for its keep-alive time
(an hour by default) and answers a malformed or oversized request head with plain text. A client
opening thousands of idle connections (measured: 13,000 held for 60 s, +60 MB) or an SDK parsing
errors as JSON both suffer. Here each connection is a `GatewayConnection` (a `RequestHandler`)
made by `serve()`:
- at most `max_connections` at once; at the cap a new connection takes the place of the one
  that has waited longest without being served (idle, or still sending its request), and is
  closed at once only when every connection is being served;
- the first request's head must arrive within `header_timeout` seconds of the connect, else the
  connection is closed (a slowloris that trickles its headers keeps nothing for long);
- a request's whole body must arrive within `body_timeout` seconds of its head, else it is
  answered 408 and the connection closed (`read_body`, the app's innermost middleware): 1,030
  connections sending one body byte every 10 s once held every slot for a minute;
- idle keep-alive connections close after `keepalive` seconds;
- a request aiohttp cannot parse (oversized header, bad method, bad framing) is answered with the
  OpenAI error object, `application/json`, the status aiohttp chose (400 or 431/413).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # a whole request body (at most 1 MiB), from its head
#: after answering a request whose body was not read (413, 408), the rest of it is read and
#: dropped this long, so that a client still sending reads its answer (no broken pipe); then
#: the connection closes (aiohttp's own default is 10 s)
LINGER_S = 2.0
KEEPALIVE_S = 15.0
MAX_FIELD_SIZE = 8190  # bytes per header line (aiohttp's default, stated)


class GatewayConnection(RequestHandler):
    """One HTTP connection: closed if its first request head is late; errors as JSON."""

    def __init__(self, manager, *, header_timeout: float, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self.got_request = False
        #: a request's body is read and its handler runs (never displaced at the cap)
        self.serving = False
        #: when it last started waiting on its client (connect, a head, a response's end)
        self.since = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self._header_timeout, self._head_late)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.request_arrived()
        super().connection_lost(exc)

    def request_arrived(self) -> None:
        """A request's head was parsed (called by the app's first middleware)."""
        self.got_request = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def body_read(self) -> None:
        """Its request is all here: the handler serves it."""
        self.serving = True

    def request_done(self) -> None:
        """Its handler returned: the connection waits on its client again (keep-alive)."""
        self.serving = False
        self.since = time.monotonic()

    def displace(self) -> None:
        """Closed to make room for a new connection at the cap."""
        log.debug("gateway: at the connection cap; closing one unserved for %.1fs",
                  time.monotonic() - self.since)
        if self.transport is not None:
            self.transport.close()

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.got_request and self.transport is not None:
            log.debug("gateway: no request head within %gs; closing the connection",
                      self._header_timeout)
            self.transport.close()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request refused before routing: the OpenAI error object, not aiohttp's text."""
        if request.writer.output_size > 0:  # a response is already under way: as aiohttp does
            return super().handle_error(request, status, exc, message)
        if status >= 500:
            log.warning("gateway: request failed before routing: %s", exc)
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        text = (message or phrase).strip().splitlines()[0][:300] if (message or phrase) else ""
        body = {"error": {"message": f"{phrase}: {text}" if text != phrase else phrase,
                          "type": "invalid_request_error" if status < 500 else "server_error",
                          "param": None,
                          "code": "bad_http" if status < 500 else "internal"}}
        resp = web.Response(status=status, body=json.dumps(body).encode(),
                            content_type="application/json")
        resp.force_close()
        return resp


class ConnectionCap:
    """Counts open connections; the protocol factory refuses one over the cap (asyncio thread)."""

    def __init__(self, server: web.Server, max_connections: int, header_timeout: float,
                 keepalive: float) -> None:
        self.server = server
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.keepalive = keepalive
        self.refused = 0
        self.displaced = 0

    def __call__(self) -> asyncio.Protocol:
        conns = self.server.connections
        if len(conns) >= self.max_connections and sum(
                not _closing(c) for c in conns) >= self.max_connections:
            victim = min((c for c in conns if isinstance(c, GatewayConnection)
                          and not c.serving and not _closing(c)),
                         key=lambda c: c.since, default=None)
            if victim is None:  # every one is being served: the new one waits its turn
                self.refused += 1
                return _Refuse()
            self.displaced += 1
            victim.displace()
        return GatewayConnection(self.server, loop=asyncio.get_running_loop(),
                                 header_timeout=self.header_timeout,
                                 keepalive_timeout=self.keepalive, access_log=None,
                                 max_field_size=MAX_FIELD_SIZE, lingering_time=LINGER_S)


def _closing(conn) -> bool:
    transport = getattr(conn, "transport", None)
    return transport is None or transport.is_closing()


class _Refuse(asyncio.Protocol):
    """A connection over the cap: closed before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


@web.middleware
async def mark_request(request: web.Request, handler):
    """Tells the connection its request head arrived (stops the header deadline), and when its
    handler is done (it waits on its client again)."""
    proto = request.protocol
    if not isinstance(proto, GatewayConnection):
        return await handler(request)
    proto.request_arrived()
    try:
        return await handler(request)
    finally:
        proto.request_done()


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole request body within `timeout` seconds (TimeoutError after it: the body left
    unread closes the connection once answered, after at most LINGER_S); the connection
    is then being served. aiohttp keeps the bytes: a handler's `request.read()` gets them."""
    proto = request.protocol
    raw = await asyncio.wait_for(request.read(), timeout) if request.body_exists else b""
    if isinstance(proto, GatewayConnection):
        proto.body_read()
    return raw
