"""Real processes: a server whose main thread is busy still answers from its I/O thread."""

import subprocess
import sys
import time
from pathlib import Path

from bus.streams import StreamClient
from codec.messages import make

ROOT = Path(__file__).resolve().parents[2]


def test_busy_main_thread_does_not_block_replies(loop, factory):
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("busy_server.py")), "6"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:")
        client = StreamClient(loop, factory)
        worst = 0.0
        for _ in range(40):
            t0 = time.monotonic()
            assert client.request(endpoint, make("ping"), timeout=1.0).result().type == "pong"
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
        # every ping answered within its 1 s deadline while the server's main thread spun
        assert worst < 1.0
        assert proc.poll() is None, "server should still be spinning"
    finally:
        proc.kill()
        proc.wait()
