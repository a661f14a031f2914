"""Fixtures for engine tests: a tiny random Llama with the real SmolLM2 tokenizer, real models.

The tiny model is random but deterministic (fixed seed); what matters is that the engine's
output equals the reference generator's on the *same* model, token for token.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

import numpy as np
import pytest

from nodes.backends import few_rows
from nodes.drafters.base import Drafter
from nodes.engine.sources import DraftSource
from nodes.engine.tree import DraftTree

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Engine tests run with one torch thread, restored afterwards.

    With other suites running on the same 2 cores, 2-thread CPU forwards stall (measured 4x
    slower); one thread keeps these tests' time predictable and costs little on tiny models.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_folder():
    """The exported embedded model (exported once into the user's specbus cache)."""
    from nodes import models

    return models.resolve(models.DEFAULT_MODEL).path


def _tokenizer_files(src, dst) -> None:
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name in (
            "chat_template.jinja",
            "special_tokens_map.json",
        ):
            shutil.copy(os.path.join(src, name), dst)


def build_tiny(folder, tokenizer_src, seed: int = 0, layers: int = 2, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.5,  # peaked logits: varied greedy output, no near-ties
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    _tokenizer_files(tokenizer_src, folder)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, smollm2_folder):
    folder = tmp_path_factory.mktemp("tiny")
    build_tiny(folder, smollm2_folder, seed=0)
    return folder


@pytest.fixture(scope="session")
def tiny_draft_folder(tmp_path_factory, smollm2_folder):
    """Another random tiny model, same tokenizer: a drafter that disagrees often."""
    folder = tmp_path_factory.mktemp("tiny_draft")
    build_tiny(folder, smollm2_folder, seed=1)
    return folder


@pytest.fixture(scope="session")
def tiny_torch(tiny_folder):
    from nodes.backends.torch_backend import TorchBackend

    return TorchBackend.load(str(tiny_folder), device="cpu")


@pytest.fixture(scope="session")
def tiny_mlx(tiny_folder):
    from mlx_lm import load

    from nodes.backends.mlx_backend import MlxBackend
    from nodes.backends.tokenizer import Tokenizer

    model, _ = load(str(tiny_folder))
    return MlxBackend(model, Tokenizer(tiny_folder), "tiny")


@pytest.fixture(scope="session")
def prompt_ids(tiny_torch):
    return tiny_torch.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick")


# ---- a scripted drafter: drafts derived from a known reference continuation ---------------------
class ScriptedDrafter(Drafter):
    """Proposes drafts from the reference continuation in a chosen way (perfect/wrong/...).

    Not a mock of the model: the verifier is real; this only controls what is proposed.
    """

    name = "scripted"
    fingerprint = None

    def __init__(self, reference: Sequence[int], mode: str, vocab: int, seed: int = 0):
        self.reference = list(reference)  # full sequence: prompt + reference continuation
        self.mode, self.vocab, self.seed = mode, vocab, seed

    def open(self, prompt_ids, params):
        return _ScriptedSession(self, list(prompt_ids))


class _ScriptedSession:
    def __init__(self, drafter: ScriptedDrafter, tokens: list[int]):
        self.d, self.tokens = drafter, tokens
        self.rng = np.random.default_rng(drafter.seed)

    def extend(self, delta):
        self.tokens.extend(int(t) for t in delta)

    def draft(self, k):
        d, pos = self.d, len(self.tokens)
        assert self.tokens == d.reference[:pos] or d.mode in ("wrong", "random"), "desync"
        truth = d.reference[pos : pos + k]
        truth += [7] * (k - len(truth))  # past the reference end: anything
        if d.mode == "perfect":
            out = truth
        elif d.mode == "long":  # more than asked and past max tokens: engine must cut
            out = d.reference[pos : pos + k + 10]
        elif d.mode == "wrong":
            out = [(t + 1) % d.vocab for t in truth]
        elif d.mode == "random":
            out = [t if self.rng.random() < 0.6 else int(self.rng.integers(d.vocab)) for t in truth]
        elif d.mode == "empty":
            out = []
        else:
            raise ValueError(d.mode)
        return np.asarray(out, dtype=np.int32), None

    def close(self):
        pass


@pytest.fixture(scope="session")
def scripted():
    return ScriptedDrafter


def node_path(tokens, parents, node) -> list[int]:
    """The tokens of a tree's path from its root to `node` (`parents`: -1 at the root)."""
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def hf_greedy(backend, prompt_ids, max_new, eos_id):
    """The reference: Hugging Face `generate(do_sample=False)` on a torch backend's model."""
    import torch

    out = backend.model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    return out[0, len(prompt_ids) :].tolist()


class DecoyTree(DraftSource):
    """Proposes the true continuation among decoys: a wrong first branch, a wrong turn at
    every depth, and the truth cut short; the verifier must find the true path in one go.
    Deterministic for a seed; asserts that the committed tokens follow `reference`."""

    name = "scripted-tree"

    def __init__(self, reference, vocab, seed=0):
        self.reference, self.vocab = list(reference), vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, committed, budget):
        pos = len(committed)
        assert list(committed) == self.reference[:pos], "desync"
        truth = self.reference[pos : pos + budget]
        wrong = [(t + 1) % self.vocab for t in truth]
        out = [wrong[:2]]  # the decoy comes first
        for cut in range(1, len(truth)):  # at each depth, a wrong turn after the true prefix
            out.append([*truth[:cut], int(self.rng.integers(self.vocab))])
        out.append(truth[: max(1, len(truth) - 1)])
        return DraftTree.from_paths([(p, None) for p in out if len(p)])


def stream_checked(engine, prompt_ids, params, **kw):
    """`engine.stream` to the end, checking the K/V invariant after every block (the cache
    holds every committed token but the pending last one) and that no drafter failed;
    returns (tokens, stats). `kw`: `stream`'s (`sources`)."""
    from nodes.engine import Stats

    out, stats = [], Stats()
    for block in engine.stream(prompt_ids, params, stats=stats, **kw):
        assert block.cache_len == block.committed_len - 1, "cache must hold committed minus pending"
        out.extend(block.token_ids)
    assert stats.drafter_errors == 0
    return out, stats


def step_together(engine, seqs):
    """Step started sequences in one batch (`engine.step_batch` over the unfinished ones)
    until all finish; each one's tokens from these steps."""
    outs = [[] for _ in seqs]
    while any(s.finish_reason is None for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        for i, block in zip(live, engine.step_batch([seqs[i] for i in live]), strict=True):
            outs[i].extend(block.token_ids)
    return outs


def step_live(engine, live, out):
    """One scheduler step over the running sequences {index: state}: their blocks' tokens go
    to `out[index]`, finished ones are closed and leave `live`."""
    order = sorted(live)
    for i, block in zip(order, engine.step_batch([live[i] for i in order]), strict=True):
        out[i] += block.token_ids
    for i in order:
        if live[i].finish_reason is not None:
            live.pop(i).close()


def primed_caches(backend, prompts, capture_layers=()):
    """A fresh cache per prompt holding all of it but its last token (which a step feeds);
    with `capture_layers`, a capturing cache (the prompt's own hidden states taken away)."""
    caches = []
    for ids in prompts:
        cache = backend.new_cache()
        if capture_layers:
            backend.capture_hidden(cache, capture_layers)
        backend.forward(cache, ids[:-1])
        if capture_layers:
            backend.take_hidden(cache)
        caches.append(cache)
    return caches


class Ahead:
    """`DraftState.draft_ahead`'s tree read back as chain and branches: the chain (`ids`,
    `conf`) and each alternative leaf's path as an `(at, tokens, conf)` branch off it (its
    first token an alternative to chain token `at`)."""

    def __init__(self, tree: DraftTree) -> None:
        paths = tree.path_tokens()
        self.ids = (paths[0][0].astype(np.int64) if paths else np.zeros(0, dtype=np.int64))
        self.conf = paths[0][1] if paths else None
        chain = self.ids.tolist()
        branches = []
        for toks, conf in paths[1:]:
            toks = toks.tolist()
            at = 0
            while at < min(len(chain), len(toks)) and chain[at] == toks[at]:
                at += 1
            if at < len(toks):
                alt_conf = None if conf is None else tuple(float(c) for c in conf[at:])
                branches.append(Branch(at, toks[at:], alt_conf))
        self.branches = tuple(branches)


class Branch(tuple):
    """(at, tokens, conf) with names."""

    def __new__(cls, at, tokens, conf=None):
        return super().__new__(cls, (at, tuple(tokens), conf))

    at = property(lambda self: self[0])
    tokens = property(lambda self: self[1])
    conf = property(lambda self: self[2])


# ---- the few-row kernel and int8 drafters ---------------------------------------------------
needs_kernel = pytest.mark.skipif(
    few_rows.buildable() is not None or shutil.which("g++") is None,
    reason="the few-row kernel is x86 AVX2 code built with g++")


@pytest.fixture(scope="module")
def kernel():
    module = few_rows.load()
    assert module is not None, (
        f"`make setup` should have built {few_rows.build_dir()}: "
        "run `python -m nodes.backends.few_rows build -v` to see why it did not")
    return module


AGREEMENT_PROMPTS = (
    "Describe a rainy afternoon in a small harbour town.",
    "What are three good habits for writing clear emails?",
    "Explain how a refrigerator keeps food cold.",
)


def greedy_agreement(verifier, drafters, prompts=AGREEMENT_PROMPTS, new_tokens: int = 32):
    """Teacher-forced greedy agreement of each drafting backend with `verifier` over the
    verifier's own greedy continuations of `prompts` (deterministic): the share of
    continuation tokens each backend's argmax gets right."""
    import torch

    continuations = []
    with torch.no_grad():
        for text in prompts:
            ids = verifier.tokenizer.encode(text, chat=True)
            out = verifier.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                          do_sample=False)
            continuations.append((out[0].tolist(), len(ids)))
    shares = []
    for backend in drafters:
        hits = total = 0
        for sequence, start in continuations:
            logits = torch.from_numpy(backend.forward(backend.new_cache(), sequence))
            guess = logits[start - 1 : -1].argmax(-1)
            hits += int((guess == torch.tensor(sequence[start:])).sum())
            total += len(sequence) - start
        shares.append(hits / total)
    return shares


def kv_bytes_after(b, positions):
    """(K/V bytes, cache) of a fresh cache of backend `b` after `positions` positions: the
    prompt in chunks, then 8 decode steps each with a rejected draft (a verify of 3, a crop of
    2), as a bounded cache meets them; the backend's last reported bytes agree."""
    cache = b.new_cache()
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 1000, positions).tolist()
    for start in range(0, positions - 8, 256):
        b.forward_last(cache, ids[start:min(start + 256, positions - 8)])
    for t in ids[positions - 8:]:  # decode steps with a rejected draft each
        b.forward(cache, [t, 5, 6])
        b.crop(cache, b.cache_length(cache) - 2)
    assert b.cache_length(cache) == positions and b.last_kv_bytes == b.kv_bytes(cache)
    return b.kv_bytes(cache), cache


def check_overlay_commits(b, freed) -> None:
    """A bounded backend `b`'s resident K/V is sinks + window rows, and a verify's fed rows
    live in a transient overlay the crop commits (accepted rows) and frees (`freed(cache)`:
    the backend's own view of that); a rollback of one position is held, one past the band
    refused."""
    cache = b.new_cache()
    b.forward_last(cache, list(range(100, 300)))
    b.crop(cache, 200)
    resident = b.kv_bytes(cache)
    b.forward(cache, [7, 8, 9, 10])  # a verify of 4 rows: the overlay exists until the crop
    assert b.cache_length(cache) == 204 and b.kv_bytes(cache) > resident
    b.crop(cache, 202)  # two accepted
    assert b.cache_length(cache) == 202 and b.kv_bytes(cache) == resident
    assert freed(cache)
    b.crop(cache, 201)  # one position back: its band is still held
    assert b.cache_length(cache) == 201
    with pytest.raises(ValueError, match="roll back"):
        b.crop(cache, 190)
