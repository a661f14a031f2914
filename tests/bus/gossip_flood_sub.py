"""Run as a process: the node's gossip SUB socket (`bus.gossip.gossip_sub`), driven over stdin
by tests/bus/test_gossip_flood.py while publishers in the test's process flood it and hang up.
Commands, one a line, each answered with one line: `connect EP`, `drain` (read what is
queued), `sub TOPIC` (a subscription: an out_event on every connection), `peak` (VmHWM in kB),
`quit` (prints `alive`). libzmq aborts the process on the way if the socket's input can stop
at its HWM while its own heartbeat runs (libzmq #3937)."""

from __future__ import annotations

import os
import sys

import zmq

from bus.gossip import gossip_sub
from bus.sockets import SocketFactory
from tools.bench_suffix_flood import status_kb


def main() -> None:
    factory = SocketFactory()
    sub = gossip_sub(factory)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "connect":
            sub.connect(arg)
            print("ok", flush=True)
        elif cmd == "drain":
            n = 0
            while sub.poll(200):
                sub.recv_multipart()
                n += 1
            print(n, flush=True)
        elif cmd == "sub":
            sub.setsockopt(zmq.SUBSCRIBE, arg.encode())
            print("ok", flush=True)
        elif cmd == "peak":
            print(status_kb(os.getpid(), "VmHWM"), flush=True)
        elif cmd == "quit":
            break
    sub.close(linger=0)
    factory.close()
    print("alive", flush=True)


if __name__ == "__main__":
    main()
