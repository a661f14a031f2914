"""A StreamServer in its own process for the DirectClient tests (test_direct.py).

Prints its endpoint, then serves until stdin closes: `ping` -> `pong`; `generate_req` with
`max_tokens` n -> n streamed `token_chunk`s then `done`; `blob` with note `hold` -> never
answered, and prints
`cancelled <rid>` when the client cancels it.
"""

import sys

import numpy as np

from bus.loop import IOLoop
from bus.sockets import SocketFactory
from bus.streams import StreamServer, serve_ping
from codec.messages import make


def handler(req) -> None:
    if serve_ping(req):
        return
    kind = req.message.type
    if kind == "generate_req":
        for i in range(int(req.message.get("max_tokens", 3))):
            req.reply(make("token_chunk", index=i, tensors=[np.array([i], np.int32)]), more=True)
        req.reply(make("done", finish_reason="length"))
    elif kind == "blob" and req.message.get("note") == "hold":
        req.on_cancel(lambda: print(f"cancelled {req.rid}", flush=True))
    else:
        req.fail("unsupported", kind)


def main() -> None:
    loop = IOLoop(name="stream-server-io").start()
    srv = StreamServer(loop, SocketFactory(), handler, sender="proc")
    print(srv.endpoint, flush=True)
    sys.stdin.read()  # the test closes stdin (or dies): stop
    loop.stop()


if __name__ == "__main__":
    main()
