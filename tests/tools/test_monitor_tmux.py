"""The live monitor in a real terminal (tmux): each proposer's drafter is on screen (its panel and
the members table), the figures carry their labels, and the events panel is as tall as what it
holds (issue 47, item 6).

Needs tmux; skipped, saying so, where it is not installed (`apt-get install tmux`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tools.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None,
                       reason="tmux is not installed (apt-get install tmux): the live view "
                              "is captured from a tmux pane"),
]


def tmux(*args: str, socket: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout


@pytest.fixture
def proposers(tmp_path):
    c = LocalCluster(log_dir=tmp_path / "logs", mdns=False)
    try:
        c.start_node("px-ngram", "--role", "proposer", "--drafter", "ngram")
        c.start_node("px-suffix", "--role", "proposer", "--drafter", "suffix")
        yield c
    finally:
        c.stop()


def test_live_view_in_tmux_shows_each_proposers_drafter(proposers):
    socket = f"specbus-test-{uuid.uuid4().hex[:8]}"  # a tmux server of our own
    seeds = " ".join(f"--peer {n.stream.removeprefix('tcp://')}" for n in proposers.nodes)
    # COLUMNS/LINES (set under pytest) would override the pane's size for textual
    cmd = (f"cd {ROOT} && exec env -u COLUMNS -u LINES {sys.executable} -m nodes.cli monitor "
           f"--cluster {proposers.cluster} --no-mdns --interface 127.0.0.1 {seeds}")
    tmux("-f", "/dev/null", "new-session", "-d", "-x", "160", "-y", "48", "-s", "mon", cmd,
         socket=socket)
    screen = ""
    try:
        deadline = time.monotonic() + 120  # generous: a loaded machine starts textual slowly
        while time.monotonic() < deadline:
            screen = tmux("capture-pane", "-p", "-t", "mon", socket=socket)
            proposer_lines = [line for line in screen.splitlines() if "drafter " in line]
            if (any("px-ngram" in line and "drafter ngram" in line for line in proposer_lines)
                    and any("px-suffix" in line and "drafter suffix" in line
                            for line in proposer_lines)):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the live view never showed both drafters:\n{screen}")
        # the members table has a drafter column too, with each proposer's drafter in its row
        rows = {line.split()[0]: line for line in screen.splitlines()
                if line.strip().startswith("px-") and " proposer " in line}
        assert " ngram " in rows.get("px-ngram", ""), screen
        assert " suffix " in rows.get("px-suffix", ""), screen
        assert "labels: now =" in screen and "total" in screen, screen
        # the events panel (the last box on screen) is as tall as its lines, not half the pane
        lines = screen.splitlines()
        top = max(i for i, line in enumerate(lines) if line.lstrip().startswith("╭"))
        bottom = next(i for i in range(top, len(lines)) if lines[i].lstrip().startswith("╰"))
        assert "join" in lines[top + 1] and bottom - top + 1 <= 2 + 10, screen
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, timeout=30)
