"""A bus server in its own process whose main thread is CPU-bound (pure Python) while its
I/O thread answers pings; used by test_cross_process.py."""

import sys
import time

from bus.loop import IOLoop
from bus.sockets import SocketFactory
from bus.streams import StreamServer, serve_ping


def main() -> None:
    spin_s = float(sys.argv[1])
    loop = IOLoop().start()
    srv = StreamServer(loop, SocketFactory(), lambda req: serve_ping(req) or req.fail("x", "y"))
    print(srv.endpoint, flush=True)
    end = time.monotonic() + spin_s
    n = 0
    while time.monotonic() < end:  # hold the GIL as much as CPython lets us
        n += sum(i * i for i in range(1000))
    loop.stop()


if __name__ == "__main__":
    main()
