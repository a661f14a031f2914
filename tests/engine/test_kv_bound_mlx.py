"""Bounded K/V on MLX (`--kv-sink S --kv-window W`, `mlx_bound.BoundedKVCache`): every
full-attention layer attends to the first S positions and the last W (a band, a function of the
tokens alone) with re-indexed sink positions (a query at q meets sink s at distance
min(q, S + W - 1) - s, as on torch) and keeps only those K/V; a tiny Gemma 3's sliding layers
keep their own window and no more. On a tiny random Llama and a tiny random Gemma 3 (no
download), with S + W = 20 so every test crosses the bound: plain decoding equals a
from-scratch eager forward under the band and the re-indexed sink distances at every step;
speculative decoding (scripted drafts with rejections, ngram drafts) equals plain decoding
under the same bound; a resume and a chunked prefill do too; the resident K/V bytes are the
same at 300 and 1,000 positions; the same weights under the same bound decode alike on torch;
bad bounds are refused. (The MLX backend verifies chains only: no trees.)"""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import BadRequestError
from tests.engine.conftest import check_overlay_commits, kv_bytes_after, stream_checked
from tests.engine.test_hybrid_cache import EOS_NONE, build_family

mx = pytest.importorskip("mlx.core")

SINK, WINDOW = 4, 16
N = 48
TEXT = ("The quick brown fox jumps over the lazy dog, and then the dog chases the fox around "
        "the old barn twice before")


def _gemma3_folder(tmp_path_factory, smollm2_folder):
    import json

    folder = tmp_path_factory.mktemp("gemma3_bound_mlx")
    build_family(folder, smollm2_folder, "gemma3")  # window 8: layers 0, 1 sliding, 2 full
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window_pattern"] = 3  # mlx-lm's layout of the same layers
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def bounded(request, tiny_folder, tmp_path_factory, smollm2_folder):
    from mlx_lm import load

    from nodes.backends.mlx_backend import MlxBackend
    from nodes.backends.tokenizer import Tokenizer

    folder = (tiny_folder if request.param == "llama"
              else _gemma3_folder(tmp_path_factory, smollm2_folder))
    model, _ = load(str(folder))
    b = MlxBackend(model, Tokenizer(folder), f"tiny-{request.param}")
    b.bound_kv(SINK, WINDOW)
    return request.param, folder, b


@pytest.fixture(scope="module")
def prompt(bounded):
    return bounded[2].tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def plain(bounded, prompt):
    b = bounded[2]
    return stream_checked(Engine(b, None), prompt,
                          GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE))[0]


def test_the_caches_are_bounded(bounded):
    from nodes.backends.mlx_bound import BoundedKVCache

    name, _, b = bounded
    cache = b.new_cache()
    assert all(isinstance(c, BoundedKVCache) for c in cache)
    bands = [(c.sink, c.window) for c in cache]
    if name == "gemma3":  # sliding layers: their own window, no sinks
        assert bands == [(0, 8), (0, 8), (SINK, WINDOW)]
    else:
        assert bands == [(SINK, WINDOW)] * len(cache)


class _BandReference:
    """A cache layer keeping every position, with the band mask written out here (not
    `BoundedKVCache`'s); with `rope` (a full layer's), `_eager_attention` scores its sinks at
    re-indexed distances: the bounded model computed from scratch."""

    def __init__(self, sink, window, rope=None):
        self.sink, self.window, self.offset, self.rope = sink, window, 0, rope
        self.keys = self.values = None

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values, self.offset = keys, values, int(keys.shape[2])
        return keys, values

    def make_mask(self, N, return_array=False, window_size=None):  # noqa: N803 - mlx-lm's
        assert self.offset == 0
        q, k = np.arange(N)[:, None], np.arange(N)[None]
        return mx.array((k <= q) & ((k < self.sink) | (k > q - self.window)))


def _eager_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """Eager attention over all positions: scores, then (a `_BandReference` with a rope, row q
    past S + W - 1) each sink key rotated forward by q - (S + W - 1) alone for row q's sink
    scores, the band mask, softmax, values."""
    groups = queries.shape[1] // keys.shape[1]
    keys, values = mx.repeat(keys, groups, axis=1), mx.repeat(values, groups, axis=1)
    scores = (queries * scale) @ keys.transpose(0, 1, 3, 2)
    rope = getattr(cache, "rope", None)
    if rope is not None:
        _, heads, length, dim = keys.shape
        edge = SINK + WINDOW - 1
        sink_keys = keys[:, :, :SINK].reshape(1, heads * SINK, 1, dim)  # one position each
        for r in range(edge + 1, length):
            moved = rope(sink_keys, offset=r - edge).reshape(1, heads, SINK, dim)
            scores[:, :, r:r + 1, :SINK] = (queries[:, :, r:r + 1] * scale) @ moved.transpose(
                0, 1, 3, 2)
    scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype) @ values


def _reference_logits(name, b, ids, monkeypatch, reindex=True):
    """Logits of one from-scratch forward of `ids` under the bounded model written out here
    (nothing dropped; on Gemma each sliding layer under its own window of 8)."""
    from mlx_lm.models import gemma3_text, llama

    for module in (llama, gemma3_text):
        monkeypatch.setattr(module, "scaled_dot_product_attention", _eager_attention)
    layers = len(b.new_cache())
    bands = ([(0, 8), (0, 8), (SINK, WINDOW)] if name == "gemma3"
             else [(SINK, WINDOW)] * layers)
    cache = [_BandReference(*band, rope=b.model.layers[i].self_attn.rope
                            if band[0] and reindex else None)
             for i, band in enumerate(bands)]
    out = np.array(b.model(mx.array([ids]), cache=cache)[0].astype(mx.float32))
    monkeypatch.undo()
    return out


def test_plain_bounded_decoding_is_the_band_model(bounded, prompt, plain, monkeypatch):
    """Prompt + output in one forward of the bounded model written out: each row's greedy
    choice is the next token plain decoding, which dropped K/V on the way, committed."""
    name, _, b = bounded
    assert len(prompt) > SINK + WINDOW  # a prompt longer than the bound
    logits = _reference_logits(name, b, prompt + plain[:-1], monkeypatch)
    assert [int(t) for t in logits[len(prompt) - 1:].argmax(-1)] == plain


def test_sink_positions_are_reindexed_past_the_bound(bounded, prompt, plain, monkeypatch):
    """The product's logits of a whole sequence (one forward from an empty cache) are the
    re-indexed reference's at every position; the absolute reference's below S + W - 1, and
    not past it (the re-indexing really applies)."""
    name, _, b = bounded
    ids = prompt + plain
    got = b.forward(b.new_cache(), ids)
    reindexed = _reference_logits(name, b, ids, monkeypatch)
    absolute = _reference_logits(name, b, ids, monkeypatch, reindex=False)
    edge = SINK + WINDOW - 1
    np.testing.assert_allclose(got, reindexed, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[:edge + 1], absolute[:edge + 1], rtol=1e-4, atol=1e-4)
    assert np.abs(got[edge + 8:] - absolute[edge + 8:]).max(-1).min() > 1e-3


def test_a_pure_rotation_is_required(bounded):
    """Re-indexing rotates the stored sink keys further; a rotary embedding that also scales
    (or depends on the length) is refused rather than served as another model."""
    from nodes.backends.mlx_bound import BoundedKVCache

    with pytest.raises(ValueError, match="pure rotary"):
        BoundedKVCache(SINK, WINDOW).reindex(object())


def test_the_bound_changes_the_output(bounded, prompt, plain):
    from mlx_lm.generate import generate_step

    b = bounded[2]
    full = [int(t) for t, _ in generate_step(mx.array(prompt), b.model, max_tokens=N)]
    assert full != plain


@pytest.mark.parametrize("mode,k", [("random", 3), ("wrong", 4), ("perfect", 8),
                                    ("random", 12)])
def test_chain_equals_plain_under_the_bound(bounded, prompt, plain, scripted, mode, k):
    b = bounded[2]
    drafter = scripted(prompt + plain, mode, b.vocab_size, seed=k)
    out, stats = stream_checked(Engine(b, drafter, fixed_k=k), prompt,
                                GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE))
    assert out == plain and stats.drafted > 0
    if mode != "perfect":
        assert stats.accepted < stats.drafted  # rejected drafts rolled back past the bound


def test_ngram_drafts_equal_plain_under_the_bound(bounded, prompt, plain):
    from nodes.drafters.registry import make_drafter

    b = bounded[2]
    gen = Engine(b, make_drafter("ngram", b)).generate(
        prompt, GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE))
    assert gen.token_ids == plain


def test_resume_from_committed_tokens_equals_plain(bounded, prompt, plain):
    """A failover resume re-prefills prompt + what was committed: the band model is a function
    of the tokens, so it goes on as the uninterrupted run did."""
    b = bounded[2]
    cut = N // 2
    resumed, _ = stream_checked(Engine(b, None), prompt + plain[:cut],
                                GenerationParams(max_tokens=N - cut, eos_token_ids=EOS_NONE))
    assert resumed == plain[cut:]


def test_a_chunked_prefill_equals_plain(bounded, prompt, plain, monkeypatch):
    """A prompt prefilled in chunks smaller than the bound (each chunk's rows an overlay
    committed by the next) decodes as one prefilled whole."""
    from nodes.backends import mlx_backend

    b = bounded[2]
    monkeypatch.setattr(mlx_backend, "PREFILL_STEP", 7)
    out, _ = stream_checked(Engine(b, None), prompt,
                            GenerationParams(max_tokens=N // 2, eos_token_ids=EOS_NONE))
    assert out == plain[:N // 2]


def test_kv_bytes_are_constant_past_the_bound(bounded):
    name, _, b = bounded
    (short, cache), (long, _) = kv_bytes_after(b, 300), kv_bytes_after(b, 1000)
    assert short == long
    rows = [8, 8, SINK + WINDOW] if name == "gemma3" else [SINK + WINDOW] * len(cache)
    per_row = [2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.itemsize for c in cache]
    assert short == sum(r * p for r, p in zip(rows, per_row, strict=True))  # the band alone
    assert [c.rows() for c in cache] == rows


def test_the_overlay_holds_only_a_forwards_rows_and_commits_what_stays(bounded):
    """Resident K/V: sinks + window rows; a verify's fed rows live in a transient overlay that
    the crop commits (accepted rows) and frees; a rollback past the held band is refused."""
    check_overlay_commits(bounded[2], lambda cache: all(c.work_k is None and c.offset == 202
                                                        for c in cache))


def test_the_same_weights_decode_alike_on_torch(bounded, prompt, plain):
    """The torch backend under the same bound, on the same weights, decodes the same tokens
    (its lean forward on the Llama, transformers' forward with band masks on Gemma 3)."""
    from nodes.backends.torch_backend import TorchBackend

    _, folder, _ = bounded
    t = TorchBackend.load(str(folder), device="cpu")
    t.bound_kv(SINK, WINDOW)
    out, _ = stream_checked(Engine(t, None), prompt,
                            GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE))
    assert out == plain


def test_the_entry_points_pass_the_bound(bounded, prompt):
    """A verifier and `generate --local` bound a backend through `assemble._bound_kv`, which
    refused MLX before; `generate --json` reports the bound and the K/V bytes."""
    from nodes.assemble import _bound_kv
    from nodes.backends.mlx_backend import MlxBackend
    from nodes.local_run import result_dict

    _, _, b = bounded
    other = MlxBackend(b.model, b.tokenizer, b.model_name)
    _bound_kv(other, SINK, WINDOW)
    assert other.kv_bound == (SINK, WINDOW)
    engine = Engine(other, None)
    gen = engine.generate(prompt, GenerationParams(max_tokens=8, eos_token_ids=EOS_NONE))
    out = result_dict(engine, gen)
    assert out["kv_bound"] == [SINK, WINDOW] and out["backend"] == "mlx"
    assert out["kv_positions"] == "reindexed"
    assert len(prompt) + 8 > SINK + WINDOW
    assert out["kv_bytes"] == kv_bytes_after(other, 300)[0]  # the band's bytes


@pytest.mark.parametrize("sink,window,why", [
    (0, 64, "--kv-sink 0"), (-1, 64, "--kv-sink -1"), (4, 0, "--kv-window 0"),
    (4, -5, "--kv-window -5"), (4, 10**9, "absurd"), (4, None, "go together"),
    (None, 64, "go together"), (4, 1021, "context"), (2.5, 64, "whole number")])
def test_bad_bounds_are_refused(sink, window, why):
    """As on torch (the same `check_kv_bound`), against the model's own context (mlx-lm's
    `model.args`)."""
    from types import SimpleNamespace

    from nodes.backends.mlx_backend import MlxBackend

    backend = SimpleNamespace(model=SimpleNamespace(args=SimpleNamespace(
        max_position_embeddings=1024)), kv_bound=None)
    with pytest.raises(BadRequestError, match=why):
        MlxBackend.bound_kv(backend, sink, window)
    assert backend.kv_bound is None
