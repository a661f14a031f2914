"""The gateway's HTTP connections, hardened: a bounded number, a deadline for the first request's
headers, and OpenAI error objects even for requests aiohttp refuses before routing.

aiohttp's `RequestHandler` holds a connection that never sends a request for its keep-alive time
(an hour by default) and answers a malformed or oversized request head with plain text. A client
opening thousands of idle connections (measured: 13,000 held for 60 s, +60 MB) or an SDK parsing
errors as JSON both suffer. Here each connection is a `GatewayConnection` (a `RequestHandler`)
made by `serve()`:
- at most `max_connections` at once; one over that is closed at once, before any parsing;
- the first request's head must arrive within `header_timeout` seconds of the connect, else the
  connection is closed (a slowloris that trickles its headers keeps nothing for long);
- idle keep-alive connections close after `keepalive` seconds;
- a request aiohttp cannot parse (oversized header, bad method, bad framing) is answered with the
  OpenAI error object, `application/json`, the status aiohttp chose (400 or 431/413).
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
HEADER_TIMEOUT_S = 10.0
KEEPALIVE_S = 15.0
MAX_FIELD_SIZE = 8190  # bytes per header line (aiohttp's default, stated)


class GatewayConnection(RequestHandler):
    """One HTTP connection: closed if its first request head is late; errors as JSON."""

    def __init__(self, manager, *, header_timeout: float, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self.got_request = False

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

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.max_connections:
            self.refused += 1
            return _Refuse()
        return GatewayConnection(self.server, loop=asyncio.get_running_loop(),
                                 header_timeout=self.header_timeout,
                                 keepalive_timeout=self.keepalive, access_log=None,
                                 max_field_size=MAX_FIELD_SIZE)


class _Refuse(asyncio.Protocol):
    """A connection over the cap: closed before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


@web.middleware
async def mark_request(request: web.Request, handler):
    """Tells the connection its request head arrived (stops the header deadline)."""
    proto = request.protocol
    if isinstance(proto, GatewayConnection):
        proto.request_arrived()
    return await handler(request)
