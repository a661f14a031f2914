"""A stranger trying the request streams of a node: `python stranger.py ENDPOINT [SECRET]`.

Sends a `session_open` and a `generate_req` from a DEALER (CURVE client with keys from
SECRET if given, else plain) and prints one JSON line: what came back within 3 s each."""

from __future__ import annotations

import json
import sys

import numpy as np

from bus.loop import IOLoop
from bus.security import Security
from bus.sockets import SocketFactory
from bus.streams import BusError, StreamClient
from codec.messages import make


def main(endpoint: str, secret: str | None) -> None:
    loop = IOLoop(name="stranger").start()
    factory = SocketFactory(security=Security.from_file(secret) if secret else None)
    client = StreamClient(loop, factory, sender="stranger")
    out = {}
    for name, msg in (
        ("session_open", make("session_open", session="x", lease_s=300.0,
                              tensors=[np.arange(8, dtype=np.int32)])),
        ("generate_req", make("generate_req", prompt="hello", max_tokens=4)),
    ):
        try:
            out[name] = client.request(endpoint, msg, timeout=3.0).result(5).type
        except BusError as exc:
            out[name] = type(exc).__name__
    loop.stop()
    factory.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
