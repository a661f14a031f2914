"""`specbus bench memory`'s pieces without SmolLM2: registered, its long text ships with Python,
its summary's ratios, and the tiled fill extends a bounded and a full cache to the context's
shapes (a tiny random Llama)."""

from __future__ import annotations

import numpy as np
import pytest

from tools import bench
from tools import bench_memory as bm


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from nodes import models
    from tests.engine.conftest import build_tiny

    folder = tmp_path_factory.mktemp("tiny_mem")
    build_tiny(folder, models.resolve(models.DEFAULT_MODEL).path, seed=0)
    return folder


def test_registered():
    assert bench.SUBCOMMANDS["memory"][0] == "tools.bench_memory"


def test_the_long_text_ships_with_python():
    assert len(bm.long_text()) > 300_000  # ~100k tokens


def test_summary():
    rows = [{"mode": m, "context": c, "kv_bytes": kv, "tok_s": t}
            for m, c, kv, t in (("full", 1024, 100, 20.0), ("bounded", 1024, 10, 22.0),
                                ("full", 16384, 1600, 10.0), ("bounded", 16384, 10, 21.0))]
    spec = [{"oracle_speedup": 4.0, "ngram_speedup": 3.0},
            {"oracle_speedup": 3.8, "ngram_speedup": 1.5}]
    got = bm._summary(rows, spec, [1024, 16384])
    assert got["bounded_tok_s_16384_over_1024"] == pytest.approx(21 / 22, abs=1e-3)
    assert got["full_tok_s_16384_over_1024"] == 0.5
    assert got["bounded_kv_spread"] == 0 and got["kv_ratio_16384"] == 160
    assert got["oracle_speedup_bounded_over_full"] == 0.95


@pytest.mark.parametrize("bound", [None, (4, 16)])
def test_tiled_fill_reaches_the_context(tiny_folder, bound):
    from nodes.backends.torch_backend import TorchBackend

    b = TorchBackend.load(str(tiny_folder), device="cpu", weights="fp32")
    if bound:
        b.bound_kv(*bound)
    cache = b.new_cache()
    b.forward_last(cache, list(range(100, 164)))
    b.crop(cache, 64)
    bm._tiled(b, cache, 1000)
    assert b.cache_length(cache) == 1000
    logits = b.forward(cache, [5])
    b.crop(cache, 1001)
    assert np.isfinite(logits).all() and b.cache_length(cache) == 1001
    per_row = 2 * 2 * 2 * 16 * 4  # layers, K+V, kv heads, head dim, fp32
    assert b.kv_bytes(cache) == per_row * 20 if bound else b.kv_bytes(cache) >= per_row * 1001
