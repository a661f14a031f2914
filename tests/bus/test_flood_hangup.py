"""A flood then a hang-up never aborts a node (issue 21).

libzmq 4.3.5 (and its master in 2026) marks an engine `_io_error` when its input stopped at
the receive high-water mark and the peer hangs up; the engine's next ZMTP heartbeat runs
`out_event`, which asserts `!_io_error` (stream_engine_base.cpp:310) and aborts the process.
2,000 forged members reached it in gateways and verifiers. Our sockets have no receive HWM, so
input never stops. The flood runs in its own process: on the old options it dies with SIGABRT
("Assertion failed: !_io_error"), checked when this test was written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_dealers_flooding_a_router_then_hanging_up_do_not_abort_it():
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("flood_router.py")), "12"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])
    assert out.stdout.strip() == "alive"
