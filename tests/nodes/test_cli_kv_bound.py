"""`--kv-sink/--kv-window` on `specbus generate --local` and `specbus node`: bad bounds are
refused before any model loads (exit 2, the flag named); a bounded local run reports its K/V
bytes in `--json` (the same at 1,000 and 4,000 positions: tests/engine/test_kv_bound.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def specbus(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nodes.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, says", [
    (["--kv-sink", "0", "--kv-window", "64"], "--kv-sink 0"),
    (["--kv-sink", "4", "--kv-window", "-1"], "--kv-window -1"),
    (["--kv-sink", "4", "--kv-window", "99999999999"], "absurd"),
    (["--kv-sink", "4"], "go together"),
])
def test_bad_bounds_exit_2_before_a_model_loads(flags, says):
    out = specbus("generate", "--local", "--prompt", "hello", *flags, timeout=60)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from nodes import models
    from tests.engine.conftest import build_tiny

    folder = tmp_path_factory.mktemp("tiny_kv")
    build_tiny(folder, models.resolve(models.DEFAULT_MODEL).path, seed=0)
    return folder


def test_a_bounded_local_run_reports_its_kv_bytes(tiny_folder):
    out = specbus("generate", "--local", "--model", str(tiny_folder), "--weights", "fp32",
                  "--prompt", "The quick brown fox jumps over the lazy dog " * 6,
                  "--no-chat", "--kv-sink", "4", "--kv-window", "16", "--max-tokens", "40",
                  "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["kv_bound"] == [4, 16] and got["kv_positions"] == "reindexed"
    assert got["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * (4 + 16)  # layers, K+V, heads, dim
