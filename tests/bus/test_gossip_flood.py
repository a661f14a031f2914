"""A gossip publisher that floods a node holds a bounded share of its memory, and flooding then
hanging up never aborts it (issue 25: a proposer fed 1 GiB of publications stays within its
budget; `specbus bench flood` measures the whole proposer).

Publishers in this process, each with ZMTP heartbeats (so PINGs sit among the flood), send
far more than a connection may buffer to the node's gossip SUB (`bus.gossip.gossip_sub`, in
its own process) while it does not read, hang up, and the SUB then reads and subscribes (an
out_event on every connection), round after round. Without the SUB's receive HWM its resident
memory grows by everything sent (~160 MB a round); with its own heartbeat on, libzmq aborts it
(#3937; checked when this test was written)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from bus.gossip import GOSSIP_RCVHWM

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 6
PUBLISHERS = 4
MESSAGES = 5000  # per publisher per round: ~20x what a connection buffers
SIZE = 8 << 10

pytestmark = pytest.mark.slow


def _ask(proc: subprocess.Popen, line: str) -> str:
    if proc.poll() is not None:  # e.g. SIGABRT (-6): "Assertion failed: !_io_error"
        pytest.fail(f"the SUB process died ({proc.returncode}): {proc.stderr.read()[-300:]}")
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    out = proc.stdout.readline().strip()
    assert out, (line, proc.poll(), proc.stderr.read()[-500:] if proc.poll() is not None else "")
    return out


def test_a_flooding_publisher_holds_bounded_memory_and_hanging_up_never_aborts_the_node():
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gossip_flood_sub.py"))],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    ctx = zmq.Context()
    try:
        assert proc.stdout.readline().strip() == "ready"
        base_kb = int(_ask(proc, "peak"))
        payload = b"t" + b"x" * (SIZE - 1)
        sent = received = 0
        for r in range(ROUNDS):
            pubs = []
            for _ in range(PUBLISHERS):
                p = ctx.socket(zmq.PUB)
                p.setsockopt(zmq.SNDHWM, 0)  # the publisher never drops: only the node bounds
                p.setsockopt(zmq.HEARTBEAT_IVL, 100)
                p.setsockopt(zmq.LINGER, 0)
                port = p.bind_to_random_port("tcp://127.0.0.1")
                assert _ask(proc, f"connect tcp://127.0.0.1:{port}") == "ok"
                pubs.append(p)
            time.sleep(0.5)  # the subscription reaches the publishers
            for p in pubs:
                for _ in range(MESSAGES):
                    p.send(payload)
                sent += MESSAGES * SIZE
            time.sleep(0.5)
            for p in pubs:
                p.close()  # hang up while the node's input is stopped
            time.sleep(1.5)  # longer than libzmq's heartbeat interval (bus/sockets.py: 1 s)
            received += int(_ask(proc, "drain"))
            assert _ask(proc, f"sub u{r}") == "ok"
        grown_mb = (int(_ask(proc, "peak")) - base_kb) / 1024
        assert sent >= 20 * PUBLISHERS * GOSSIP_RCVHWM * SIZE
        assert received > 0  # the flood reached the node (its subscription was in place)
        # a connection buffers at most GOSSIP_RCVHWM messages (8 MiB for 4 here, plus libzmq's
        # read batches); without that bound it held what was sent, 160 MiB a round
        assert grown_mb < 64, grown_mb
        print(f"received {received} of {sent // SIZE} messages; grown {grown_mb:.1f} MiB")
        assert _ask(proc, "quit") == "alive"
        assert proc.wait(30) == 0
    finally:
        ctx.destroy(linger=0)
        if proc.poll() is None:
            proc.kill()
