"""EAGLE-3 heads in process: hidden states from the verify forward, the published checkpoint
layout (foreign heads load, unfit ones are refused clearly), lossless greedy output with a
deliberately wrong head (chains and trees), and the head's tree and training-time unroll
agreeing with its step-by-step inference."""

from __future__ import annotations

import pytest
import torch

from nodes.drafters.eagle.cache import HeadCache
from nodes.drafters.eagle.checkpoint import VerifierShape, load_head
from nodes.drafters.eagle.source import EagleDrafter
from nodes.drafters.eagle.tree import draft_tree
from nodes.drafters.registry import make_drafter
from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import BadRequestError
from nodes.engine.sources import DraftSource
from nodes.engine.tree import DraftTree
from tests.engine.conftest import hf_greedy, needs_kernel, node_path
from tests.engine.eagle_heads import head_config, head_tensors, write_head

LAYERS = (0, 1, 1)  # the tiny verifier has 2 layers


@pytest.fixture(scope="module")
def foreign_head(tmp_path_factory):
    """A random head in the published layout (fp16, no embed_tokens: shares the verifier's)."""
    return write_head(tmp_path_factory.mktemp("eagle_foreign"), head_tensors(), head_config())


def hf_hidden(backend, ids, layers=LAYERS) -> torch.Tensor:
    """Reference: a separate HF forward with output_hidden_states, [n, layers, hidden]."""
    with torch.inference_mode():
        out = backend.model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True)
    return torch.stack([out.hidden_states[i][0] for i in layers], dim=1)


# ---- hidden states ------------------------------------------------------------------------------
def test_hidden_states_of_chains_and_trees_equal_a_separate_hf_forward(tiny_torch, prompt_ids):
    b = tiny_torch
    cache = b.new_cache()
    b.capture_hidden(cache, LAYERS)
    b.prefill(cache, prompt_ids)
    got = b.take_hidden(cache)
    assert got.shape == (len(prompt_ids), 3, 64)
    torch.testing.assert_close(got, hf_hidden(b, prompt_ids), atol=1e-4, rtol=1e-4)
    assert b.take_hidden(cache) is None  # taken once

    chain = [11, 22, 33]
    b.forward(cache, chain)
    ref = hf_hidden(b, prompt_ids + chain)[len(prompt_ids):]
    torch.testing.assert_close(b.take_hidden(cache), ref, atol=1e-4, rtol=1e-4)

    b.crop(cache, len(prompt_ids))
    tokens, parents = [5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2]
    b.forward_tree(cache, tokens, parents)
    got = b.take_hidden(cache)
    for node in range(len(tokens)):
        ref = hf_hidden(b, prompt_ids + node_path(tokens, parents, node))[-1]
        torch.testing.assert_close(got[node], ref, atol=1e-4, rtol=1e-4)


def test_a_cache_that_asked_for_nothing_captures_nothing(tiny_torch, prompt_ids):
    cache = tiny_torch.new_cache()
    tiny_torch.forward(cache, prompt_ids)
    assert tiny_torch.take_hidden(cache) is None


def test_layer_ids_out_of_range_are_refused(tiny_torch):
    with pytest.raises(BadRequestError, match="out of range"):
        tiny_torch.capture_hidden(tiny_torch.new_cache(), (0, 1, 2))


class _Recorder(DraftSource):
    """Proposes a tree (the reference path cut short among decoys) and keeps every hidden
    state the engine hands over, to compare with a separate forward afterwards."""

    name = "recorder"
    hidden_layers = LAYERS

    def __init__(self, reference):
        self.reference, self.rows = reference, []

    def propose(self, committed, budget):
        truth = self.reference[len(committed) : len(committed) + 3]
        decoy = [(t + 1) % 49152 for t in truth]
        return DraftTree.from_paths([(decoy[:2], None), (truth[:2], None),
                                     (truth[:1] + decoy[1:3], None)])

    def feedback(self, fb):
        assert fb.hidden is not None
        self.rows.append(fb.hidden)


def test_the_engine_hands_over_the_committed_paths_hidden_states(tiny_torch, prompt_ids):
    ref = hf_greedy(tiny_torch, prompt_ids, 24, 2)
    rec = _Recorder(prompt_ids + ref)
    params = GenerationParams(max_tokens=24, eos_token_ids=frozenset({2}))
    blocks = list(Engine(tiny_torch, fixed_k=6).stream(prompt_ids, params, sources=[rec]))
    out = [t for b in blocks for t in b.token_ids]
    assert out == ref
    assert any(b.accepted for b in blocks)  # trees with accepted nodes were compacted
    got = torch.cat(rec.rows)
    committed = prompt_ids + out
    assert got.shape[0] == len(committed) - 1  # every committed token but the pending one
    # the engine's forwards feed 1-7 rows (the few-row kernel's summation order), the reference
    # one long row block (torch's): float32 rounding differs by ~1e-4 after a few layers, a wrong
    # row (a decoy's state, a shifted position) by orders of magnitude more
    torch.testing.assert_close(got, hf_hidden(tiny_torch, committed[:-1]), atol=1e-3, rtol=1e-3)


# ---- lossless greedy with a wrong head ---------------------------------------------------------
@pytest.mark.parametrize("fixed_k", [None, 1, 4, 12])
@pytest.mark.parametrize("width", [1, 4])
def test_greedy_equals_hf_with_a_random_head(tiny_torch, prompt_ids, foreign_head, fixed_k,
                                             width):
    drafter = make_drafter(f"eagle:{foreign_head}", tiny_torch)
    drafter.tree_width = width
    params = GenerationParams(max_tokens=40, eos_token_ids=frozenset({2}))
    gen = Engine(tiny_torch, drafter, fixed_k=fixed_k).generate(prompt_ids, params)
    assert gen.token_ids == hf_greedy(tiny_torch, prompt_ids, 40, 2)
    assert gen.stats.drafter_errors == 0
    if fixed_k:
        assert gen.stats.drafted > 0


def test_a_head_with_its_own_embedding_and_target_hidden_size_loads(tiny_torch, prompt_ids,
                                                                      tmp_path):
    folder = write_head(tmp_path, head_tensors(own_embedding=True, seed=3),
                        head_config(layer_ids=None, target_hidden=64), dtype=torch.bfloat16)
    drafter = EagleDrafter.load(folder, tiny_torch)
    assert drafter.layers == (0, 1, 1)  # defaults for 2 layers (2, L/2, L-3 clipped)
    assert drafter.head.embed_tokens is not None
    params = GenerationParams(max_tokens=24, eos_token_ids=frozenset({2}))
    gen = Engine(tiny_torch, drafter, fixed_k=5).generate(prompt_ids, params)
    assert gen.token_ids == hf_greedy(tiny_torch, prompt_ids, 24, 2)


# ---- unfit checkpoints --------------------------------------------------------------------------
def _broken(kind):
    t, c = head_tensors(), head_config()
    if kind == "hidden":
        t, c = head_tensors(hidden=32, feature=32), head_config(hidden=32)
    elif kind == "vocab":
        t, c = head_tensors(vocab=1000, draft_vocab=100), head_config(vocab=1000,
                                                                       draft_vocab=100)
    elif kind == "missing":
        del t["midlayer.hidden_norm.weight"]
    elif kind == "extra":
        t["layers.1.mlp.up_proj.weight"] = torch.zeros(2, 2)
    elif kind == "shape":
        t["fc.weight"] = torch.zeros(64, 128)
    elif kind == "layer":
        c = head_config(layer_ids=(0, 1, 5))
    elif kind == "nan":
        t["lm_head.weight"][3, 3] = float("nan")
    elif kind == "d2t":
        t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 both map to the same verifier id
    elif kind == "arch":
        c["architectures"] = ["LlamaForCausalLM"]
    return t, c


@pytest.mark.parametrize("kind,message", [
    ("hidden", "hidden_size 32 does not match the verifier's hidden size 64"),
    ("vocab", "vocab_size 1000 does not match the verifier's 49152"),
    ("missing", r"missing tensors \['midlayer.hidden_norm.weight'\]"),
    ("extra", r"unexpected tensors \['layers.1.mlp.up_proj.weight'\]"),
    ("shape", r"fc.weight has shape \[64, 128\], expected \[64, 192\]"),
    ("layer", r"layer ids \[0, 1, 5\] out of range for a verifier of 2 layers"),
    ("nan", "lm_head.weight holds NaN"),
    ("d2t", "same verifier id"),
    ("arch", "name no Llama EAGLE-3 head"),
])
def test_an_unfit_checkpoint_is_refused_with_a_clear_error(tiny_torch, tmp_path, kind, message):
    tensors, config = _broken(kind)
    folder = write_head(tmp_path / kind, tensors, config, dtype=torch.float32)
    with pytest.raises(BadRequestError, match=message):
        make_drafter(f"eagle:{folder}", tiny_torch)


def test_a_missing_folder_is_refused(tiny_torch, tmp_path):
    with pytest.raises(BadRequestError, match="no such folder"):
        make_drafter(f"eagle:{tmp_path / 'nope'}", tiny_torch)


# ---- the head's own consistency ------------------------------------------------------------------
def _double_head(folder, backend):
    head, _ = load_head(folder, VerifierShape.of(backend))
    head = head.double()
    head.shared_embedding = head.shared_embedding.double()
    return head


def test_tree_nodes_get_what_a_chain_through_them_gets(tiny_torch, foreign_head):
    """Every tree node's draft probability equals the head's, stepped as a chain along the
    node's path (masks and positions of the level-by-level tree forwards)."""
    head = _double_head(foreign_head, tiny_torch)
    g = torch.Generator().manual_seed(0)
    m = 9
    tokens = torch.randint(0, 49152, (m + 1,), generator=g)
    feats = torch.randn(m, 3, 64, generator=g, dtype=torch.float64)
    with torch.inference_mode():
        cache = HeadCache(2, 16, torch.float64, "cpu")
        last = head.step(cache, tokens[1:], feats, torch.arange(m))[-1]
        tree = draft_tree(head, cache, last, int(tokens[-1]), budget=12, width=3)
        paths = tree.path_tokens()
        assert sum(len(t) for t, _ in paths) >= 12  # a real tree (shared prefixes)
        assert len(paths) > 1
        to_draft = {int(t): d for d, t in enumerate(head.target_ids().tolist())}
        for toks, confs in paths:
            cache.crop(m)
            h = last
            for depth, (tok, conf) in enumerate(zip(toks, confs, strict=True), 1):
                q = torch.softmax(head.logits(h[None])[0], -1)
                assert abs(float(q[to_draft[int(tok)]]) - conf) < 1e-6  # float32 softmax
                h = head.step(cache, torch.tensor([int(tok)]), h[None],
                              torch.tensor([m - 1 + depth]))[0]


def test_the_training_unroll_equals_inference(tiny_torch, foreign_head):
    """Step s of the training-time test at position j is the depth-s draft entry after the
    committed entries 0..j-s, fed the true tokens."""
    from nodes.training.train import unroll

    head = _double_head(foreign_head, tiny_torch)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 49152, (1, 12), generator=g)
    feats = torch.randn(1, 12, 3, 64, generator=g, dtype=torch.float64)
    with torch.no_grad():
        outs = unroll(head, tokens, feats, 3)
        for m in (3, 8):
            cache = HeadCache(2, 16, torch.float64, "cpu")
            h = head.step(cache, tokens[0, 1 : m + 1], feats[0, :m], torch.arange(m))
            torch.testing.assert_close(h, outs[0][0, :m])
            h = h[-1]
            for d in (1, 2):
                h = head.step(cache, tokens[0, m + d : m + d + 1], h[None],
                              torch.tensor([m - 1 + d]))[0]
                torch.testing.assert_close(h, outs[d][0, m - 1 + d])


@needs_kernel
def test_the_training_unroll_runs_on_a_weight_only_int8_head(tiny_torch, foreign_head):
    """Evaluating a head as it drafts on a CPU (int8 weights, `fc` included) goes through the
    same unroll: its first step equals the quantized head's own committed-entry forward."""
    from nodes.backends.w8 import W8Linear
    from nodes.drafters.eagle.quantize import quantize_head
    from nodes.training.train import unroll

    head, _ = load_head(foreign_head, VerifierShape.of(tiny_torch))
    head = quantize_head(head)
    assert isinstance(head.fc, W8Linear)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 49152, (1, 10), generator=g)
    feats = torch.randn(1, 10, 3, 64, generator=g)
    with torch.inference_mode():
        outs = unroll(head, tokens, feats, 2)
        cache = HeadCache(2, 16, torch.float32, "cpu")
        h = head.step(cache, tokens[0, 1:9], feats[0, :8], torch.arange(8))
    torch.testing.assert_close(h, outs[0][0, :8], rtol=1e-4, atol=1e-4)


def test_an_mlx_verifier_is_refused_clearly(tiny_mlx, foreign_head):
    """mlx-lm models give no hook on layer inputs: refused at load, and by the backend."""
    with pytest.raises(BadRequestError, match="needs a torch verifier"):
        make_drafter(f"eagle:{foreign_head}", tiny_mlx)
    with pytest.raises(BadRequestError, match="cannot capture hidden states"):
        tiny_mlx.capture_hidden(tiny_mlx.new_cache(), LAYERS)


def test_after_a_long_unread_stretch_the_head_reads_only_the_latest_entries(tiny_torch,
                                                                          foreign_head):
    """A prompt (or a gap while the head was turned down) longer than `CATCH_UP_WINDOW`: the
    source keeps and feeds the head only the last window of entries, at their true positions,
    and drafts from there; later commits are appended after them."""
    from nodes.drafters.eagle.source import CATCH_UP_WINDOW, EagleSource
    from nodes.engine.sampling import SamplingParams
    from nodes.engine.sources import Feedback

    head = _double_head(foreign_head, tiny_torch)
    g = torch.Generator().manual_seed(1)
    m = 2 * CATCH_UP_WINDOW + 36
    tokens = [int(t) for t in torch.randint(0, 49152, (m + 1,), generator=g)]
    feats = torch.randn(m, 3, 64, generator=g, dtype=torch.float64)
    source = EagleSource(head, LAYERS, tokens, SamplingParams(), 3, "eagle")
    for at in range(0, m, 10):  # commits arriving while the head is not asked
        source.feedback(Feedback((), 0, 0, 0, hidden=feats[at:at + 10]))
        assert sum(map(len, source.pending)) <= 2 * CATCH_UP_WINDOW  # bounded meanwhile
    with torch.inference_mode():
        chain = source.propose(tokens, 6).path_tokens()[0]
        assert source.cache.length == CATCH_UP_WINDOW  # the draft entries cropped away
        ref = HeadCache(2, 16, torch.float64, "cpu")
        start = m - CATCH_UP_WINDOW
        last = head.step(ref, torch.tensor(tokens[start + 1:]), feats[start:],
                         torch.arange(start, m))[-1]
        assert torch.equal(source.last, last)
        to_draft = {int(t): d for d, t in enumerate(head.target_ids().tolist())}
        h = last
        for depth, (tok, conf) in enumerate(zip(*chain, strict=True), 1):
            q = torch.softmax(head.logits(h[None])[0], -1)
            assert abs(float(q[to_draft[int(tok)]]) - conf) < 1e-6
            h = head.step(ref, torch.tensor([int(tok)]), h[None],
                          torch.tensor([m - 1 + depth]))[0]  # the true positions
        more = [int(t) for t in torch.randint(0, 49152, (3,), generator=g)]
        source.feedback(Feedback(more, 0, 0, 0, hidden=torch.randn(3, 3, 64,
                                                                   dtype=torch.float64)))
        source.propose(tokens + more, 2)
        assert source.cache.length == CATCH_UP_WINDOW + 3 and source.fed == m + 3
