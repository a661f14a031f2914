"""A bus server in its own process that answers each request with 40 streamed replies, one
every 50 ms (a worker thread per request, like a verifier's compute thread); prints its
endpoint. Used by test_stream_liveness.py to stop and kill a real peer."""

import threading
import time

from bus.loop import IOLoop
from bus.sockets import SocketFactory
from bus.streams import StreamServer
from codec.messages import make

REPLIES = 40


def main() -> None:
    loop = IOLoop().start()

    def handler(req) -> None:
        def work() -> None:
            for i in range(REPLIES):
                time.sleep(0.05)
                req.reply(make("pong", payload=str(i)), more=i < REPLIES - 1)

        threading.Thread(target=work, daemon=True).start()

    server = StreamServer(loop, SocketFactory(), handler)
    print(server.endpoint, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
