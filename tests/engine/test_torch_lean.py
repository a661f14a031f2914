"""The lean float32 forward (`torch_lean`) and the in-place cache (`growing_cache`): every logit
and captured hidden state bit for bit what transformers' own forward over `DynamicCache`
gives, on the tiny model and on the real SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache, DynamicLayer

from nodes.backends.growing_cache import GrowingLayer, new_cache
from tests.engine.conftest import needs_kernel


def _session(backend, prompt: list[int], lean: bool) -> list[np.ndarray]:
    """A verifier's life on one backend: a prompt, steps, a chain verify, a tree and its
    compaction, a batch of three (one capturing hidden states, one a prompt), the captures."""
    saved = backend.lean
    backend.lean = saved if lean else None
    try:
        def cache():
            return backend.new_cache() if lean else DynamicCache(config=backend.model.config)

        a = cache()
        out = [backend.forward_last(a, prompt), backend.forward(a, [42]),
               backend.forward(a, [43, 44, 45, 46])]
        base = len(prompt) + 3
        backend.crop(a, base)
        out.append(backend.forward_tree(a, [7, 8, 9, 10, 11], [-1, 0, 0, 1, 2]))
        backend.compact(a, base, [0, 2, 4])
        out.append(backend.forward(a, [12, 13]))
        b, c = cache(), cache()
        backend.capture_hidden(b, (0, 1))
        out += backend.forward_batch(
            [a, b, c], [([50, 51, 52], [-1, 0, 0]),
                        (prompt[:30], list(range(-1, 29))), ([60], [-1])])
        out.append(backend.take_hidden(b).numpy())
        out.append(backend.forward(b, [5, 6]))
        out.append(backend.take_hidden(b).numpy())
        return out
    finally:
        backend.lean = saved


def _assert_same(backend, prompt):
    assert backend.lean is not None, "the lean forward should serve this Llama model on a CPU"
    ref, got = _session(backend, prompt, lean=False), _session(backend, prompt, lean=True)
    assert len(ref) == len(got)
    for i, (x, y) in enumerate(zip(ref, got, strict=True)):
        assert x.shape == y.shape, i
        assert np.array_equal(x, y), f"output {i} differs: max {np.abs(x - y).max()}"


@needs_kernel
def test_lean_forward_is_transformers_forward_bit_for_bit_tiny(tiny_torch, prompt_ids):
    _assert_same(tiny_torch, list(prompt_ids) * 3)


@needs_kernel
@pytest.mark.slow
def test_lean_forward_is_transformers_forward_bit_for_bit_smollm2(smollm2_folder):
    from nodes.backends.torch_backend import TorchBackend

    backend = TorchBackend.load(str(smollm2_folder), device="cpu")
    prompt = backend.tokenizer.encode(
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        chat=True)
    _assert_same(backend, prompt)
    # the fused weights are the modules' own storage: no second copy of the model
    att = backend.model.model.layers[0].self_attn
    fused = backend.lean.layers[0].qkv
    assert att.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


@needs_kernel
def test_switch_keeps_transformers_forward(tiny_folder, monkeypatch):
    from nodes.backends.torch_backend import FORWARD_ENV, TorchBackend

    monkeypatch.setenv(FORWARD_ENV, "transformers")
    assert TorchBackend.load(str(tiny_folder), device="cpu").lean is None


def test_quantised_copy_keeps_transformers_forward(tiny_torch):
    from nodes.backends import torch_lean
    from nodes.drafters.int8 import quantize_int8

    assert not torch_lean.supported(quantize_int8(tiny_torch.model))


# -- the in-place cache layer ----------------------------------------------------------------
_ops = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 90)),
                          st.tuples(st.just("crop"), st.integers(1, 40)),
                          st.tuples(st.just("replace"), st.integers(0, 5))),
                min_size=1, max_size=25)


@given(_ops)
@settings(max_examples=60, deadline=None)
def test_growing_layer_holds_what_dynamic_layer_holds(ops):
    torch.manual_seed(0)
    grow, ref = GrowingLayer(), DynamicLayer()
    for op, n in ops:
        if op == "add":
            k, v = torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)
            got, want = grow.update(k, v), ref.update(k, v)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        elif op == "crop":
            n = min(n, ref.get_seq_length())
            if n:
                grow.crop(-n)
                ref.crop(-n)
        elif ref.get_seq_length():  # compaction's way: both attributes set to new tensors
            keep = min(n, ref.get_seq_length())
            for layer in (grow, ref):
                layer.keys = layer.keys[..., :keep, :].clone()
                layer.values = layer.values[..., :keep, :].clone()
        assert grow.get_seq_length() == ref.get_seq_length()
        if ref.get_seq_length():
            assert torch.equal(grow.keys, ref.keys) and torch.equal(grow.values, ref.values)


def test_growing_layer_appends_in_place():
    layer = GrowingLayer()
    layer.update(torch.zeros(1, 2, 100, 4), torch.zeros(1, 2, 100, 4))
    buffer = layer.keys.untyped_storage().data_ptr()
    for _ in range(20):  # decode steps and rejected drafts: no copy of what is cached
        layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
        layer.crop(-2)
    assert layer.get_seq_length() == 120
    assert layer.keys.untyped_storage().data_ptr() == buffer
    assert float(layer.keys[0, 0, 101:, 0].sum()) == 19.0  # each step's kept row


def test_new_cache_uses_growing_layers(tiny_torch):
    cache = new_cache(tiny_torch.model.config)
    assert cache.layers and all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert isinstance(tiny_torch.new_cache().layers[0], GrowingLayer)
