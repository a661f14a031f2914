"""A bus server in its own process whose main thread is CPU-bound (pure Python) while its
I/O thread answers pings; used by test_cross_process.py.

Prints its endpoint, then spins until a line arrives on stdin, then prints how many spin
rounds it did and exits: the test knows the main thread was spinning the whole time it was
being served, without timing anything.
"""

import select
import sys

from bus.loop import IOLoop
from bus.sockets import SocketFactory
from bus.streams import StreamServer, serve_ping


def main() -> None:
    loop = IOLoop().start()
    srv = StreamServer(loop, SocketFactory(), lambda req: serve_ping(req) or req.fail("x", "y"))
    print(srv.endpoint, flush=True)
    rounds = 0
    n = 0
    while not select.select([sys.stdin], [], [], 0)[0]:  # hold the GIL as much as we can
        for _ in range(20):
            n += sum(i * i for i in range(1000))
        rounds += 1
    print(f"spun {rounds}", flush=True)
    loop.stop()


if __name__ == "__main__":
    main()
