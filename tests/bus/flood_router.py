"""Run as a process: a ROUTER made by the node's own SocketFactory, flooded by DEALERs that hang
up while it is not reading, round after round (tests/bus/test_flood_hangup.py). Prints `alive`
at the end; libzmq 4.3.5 aborts the process on the way when the ROUTER has a receive HWM."""

from __future__ import annotations

import sys
import time

import zmq

from bus.sockets import SocketFactory

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def main() -> None:
    factory = SocketFactory()
    router = factory.router()
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ctx = zmq.Context()
    for _ in range(ROUNDS):
        attackers = []
        for _ in range(20):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.HEARTBEAT_IVL, 100)
            s.connect(f"tcp://127.0.0.1:{port}")
            attackers.append(s)
        time.sleep(0.3)
        for s in attackers:  # far more than a receive HWM of 1000 holds
            for _ in range(3000):
                s.send(b"x" * 200)
        time.sleep(0.3)
        for s in attackers:
            s.close(linger=0)  # hang up while the ROUTER's input may be stopped
        time.sleep(0.5)
        for _ in range(500):  # read a little: restart_input
            try:
                router.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
    router.close(linger=0)
    ctx.term()
    factory.close()
    print("alive", flush=True)


if __name__ == "__main__":
    main()
