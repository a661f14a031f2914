"""Capture every frame on one interface until SIGTERM (run inside a namespace we created):
`python sniff.py IFACE OUT`. Raw AF_PACKET socket, no dependency; writes the frames'
bytes back to back (the test only searches them for plaintext)."""

from __future__ import annotations

import signal
import socket
import sys

ETH_P_ALL = 0x0003


def main(iface: str, out: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((iface, 0))
    sock.settimeout(0.2)
    print("capturing", flush=True)
    with open(out, "wb") as f:
        while not stop:
            try:
                f.write(sock.recv(65535))
            except TimeoutError:
                continue
            except InterruptedError:
                continue


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
