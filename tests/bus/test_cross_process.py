"""Real processes: a server whose main thread is busy still answers from its I/O thread."""

import select
import subprocess
import sys
from pathlib import Path

import pytest

from bus.streams import RequestTimeout, StreamClient
from codec.messages import make

ROOT = Path(__file__).resolve().parents[2]
BOUND = 10.0  # generous "it happens" bound on a loaded machine; never a performance verdict
PING_BOUND = 30.0


def read_line(proc, bound=BOUND):
    """The server's next stdout line, or "" if none comes within `bound` (no hang)."""
    ready, _, _ = select.select([proc.stdout], [], [], bound)
    return proc.stdout.readline().strip() if ready else ""


@pytest.mark.parametrize("work", ["python", "torch"])
def test_busy_main_thread_does_not_block_replies(loop, factory, work):
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("busy_server.py")), work],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        endpoint = read_line(proc, 60 if work == "torch" else BOUND)  # importing torch
        assert endpoint.startswith("tcp://127.0.0.1:")
        client = StreamClient(loop, factory)
        for i in range(40):
            # A ping waits for the GIL the busy thread holds: a forced switch every 5 ms
            # (measured here: at most ~20 ms a ping, idle machine). 30 s is a "never" bound for
            # a loaded CI machine, no performance verdict. On failure, say whether the ping was
            # sent and whether its pong came late, so a lost message and a slow one differ.
            call = client.request(endpoint, make("ping"), timeout=PING_BOUND)
            try:
                assert call.result().type == "pong"
            except RequestTimeout:
                pytest.fail(f"ping {i} unanswered within {PING_BOUND}s: sent {client.sent}, "
                            f"late replies {client.late}, in flight {client.in_flight}")
        # the main thread spins until told to stop: every ping above was answered while it
        # held the GIL in pure Python, and it is still spinning now
        assert proc.poll() is None
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        line = read_line(proc).split() or ["(nothing)"]
        assert line[0] == "spun" and int(line[1]) > 0
        assert proc.wait(BOUND) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
