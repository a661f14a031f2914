"""Weight-only int8 (nodes/backends/w8.py, `linear_w8` in few_rows.cpp): the kernel against a
float64 reference of the dequantised weights, its refusals, the module and the conversion, the
fallback where the kernel is not available, and the int8 drafter built on it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nodes.backends import few_rows, w8
from tests.engine.conftest import greedy_agreement, needs_kernel


def _reference(x, layer: w8.W8Linear):
    """float64 x . (q * s)^T (+ b): what the kernel approximates in float32."""
    b = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), layer.dequantized().double(), b)


def test_quantize_and_pack_round_trip():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(13, 21, generator=gen)
    w[5] = 0  # an all-zero row: scale 1, q 0
    q, s = w8.quantize_weight(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.abs().max() <= w8.QMAX
    assert (q[5] == 0).all() and torch.isfinite(s).all()
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()  # round to nearest
    packed = w8.pack_w8(q)
    assert packed.shape == (2, 3, 8, 8) and packed.is_contiguous()
    assert torch.equal(w8.unpack_w8(packed, 13, 21), q)
    assert (packed.permute(0, 2, 1, 3).reshape(16, 24)[13:].eq(0)).all()  # padding rows
    assert (packed.permute(0, 2, 1, 3).reshape(16, 24)[:, 21:].eq(0)).all()  # padding columns


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 8), (7, 13), (9, 5), (50, 576), (97, 1000), (200, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_x_times_the_dequantised_weights(kernel, n, k, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    linear = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    layer = w8.W8Linear.from_linear(linear)
    for m in [*range(1, few_rows.MAX_ROWS + 1), 31]:  # and beyond: any M is served
        x = torch.randn(m, k, generator=gen)
        exact = _reference(x, layer)
        got = kernel.linear_w8(x, layer.packed, layer.scale, layer.bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # float32 sums of k exact products: within a few ulps of the sum of magnitudes
        dq = layer.dequantized().abs().double()
        scale = x.abs().double() @ dq.T + (0 if layer.bias is None else layer.bias.abs().double())
        assert ((got.double() - exact).abs() <= 1e-5 * scale + 1e-6).all(), (m, n, k)
        # and the quantised layer approximates the float one: |w - q s| <= s / 2 per weight
        err = (F.linear(x.double(), linear.weight.double(), None if not bias else
                        linear.bias.double()) - exact).abs()
        assert (err <= x.abs().double() @ (layer.scale.double()[:, None] / 2).expand(n, k).T
                + 1e-4).all()


@needs_kernel
def test_each_row_gets_the_result_it_gets_alone(kernel):
    gen = torch.Generator().manual_seed(7)
    layer = w8.W8Linear(torch.randn(300, 577, generator=gen))
    x = torch.randn(few_rows.MAX_ROWS, 577, generator=gen)
    together = kernel.linear_w8(x, layer.packed, layer.scale)
    for i in range(x.shape[0]):
        alone = kernel.linear_w8(x[i:i + 1].clone(), layer.packed, layer.scale)[0]
        assert torch.equal(alone, together[i])
    order = torch.randperm(x.shape[0], generator=gen)
    assert torch.equal(kernel.linear_w8(x[order].contiguous(), layer.packed, layer.scale),
                       together[order])


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_do(kernel):
    layer = w8.W8Linear(torch.randn(12, 16), torch.randn(12))
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="float32 inputs and scales only"):
        kernel.linear_w8(x.double(), layer.packed, layer.scale)
    with pytest.raises(RuntimeError, match="float32 inputs and scales only"):
        kernel.linear_w8(x, layer.packed, layer.scale.double())
    with pytest.raises(RuntimeError, match="int8 weights only"):
        kernel.linear_w8(x, layer.packed.float(), layer.scale)
    with pytest.raises(RuntimeError, match="packed int8 weights"):
        kernel.linear_w8(torch.randn(2, 24), layer.packed, layer.scale)  # K does not fit
    with pytest.raises(RuntimeError, match="packed int8 weights"):
        kernel.linear_w8(x, layer.packed, torch.ones(17))  # N does not fit
    with pytest.raises(RuntimeError, match="packed int8 weights"):
        kernel.linear_w8(x, w8.unpack_w8(layer.packed, 12, 16).contiguous(), layer.scale)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        kernel.linear_w8(x[None], layer.packed, layer.scale)
    with pytest.raises(RuntimeError, match="bad bias"):
        kernel.linear_w8(x, layer.packed, layer.scale, torch.ones(5))
    assert kernel.linear_w8(torch.empty(0, 16), layer.packed, layer.scale).shape == (0, 12)


@needs_kernel
def test_the_module_serves_any_leading_shape_and_falls_back_for_other_inputs(kernel):
    linear = torch.nn.Linear(40, 24)
    layer = w8.W8Linear.from_linear(linear)
    x = torch.randn(2, 3, 40)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y.reshape(6, 24), kernel.linear_w8(x.reshape(6, 40), layer.packed,
                                                          layer.scale, layer.bias))
    np.testing.assert_allclose(layer(x.double()).numpy(), _reference(x.reshape(6, 40), layer)
                               .reshape(2, 3, 24).numpy(), rtol=1e-10, atol=1e-10)
    grad = layer(x.clone().requires_grad_())  # autograd: torch's matmul on the dequantised
    torch.testing.assert_close(grad.detach(), y, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_quantize_linears_w8_converts_the_linears_not_skipped(kernel):
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(16, 16))
    model.add_module("block", torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(),
                                                  torch.nn.Linear(32, 16, bias=False)))
    model.add_module("head", torch.nn.Linear(16, 50))
    few_rows.install(model)  # a few-row-installed Linear still converts
    reference = copy.deepcopy(model)
    assert w8.quantize_linears_w8(model, skip={"fc", "block.2"}) == 2
    assert type(model.fc) is torch.nn.Linear and type(model.block[2]) is torch.nn.Linear
    assert isinstance(model.block[0], w8.W8Linear) and isinstance(model.head, w8.W8Linear)
    assert model.head.bias is not None and model.block[0].in_features == 16
    x = torch.randn(3, 16)
    with torch.inference_mode():
        got, exact = model(x), reference(x)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()
    assert w8.quantize_linears_w8(model) == 2  # the two skipped before; never twice


def test_without_the_kernel_nothing_is_converted_and_the_drafter_is_dynamic(
        monkeypatch, tiny_torch, caplog):
    from nodes.drafters.int8 import Int8Drafter

    monkeypatch.setenv(few_rows.ENV, "torch")
    assert w8.available() == f"{few_rows.ENV}=torch"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert w8.quantize_linears_w8(model) == 0 and type(model[0]) is torch.nn.Linear
    with caplog.at_level("INFO", logger="nodes.drafters.int8"):
        drafter = Int8Drafter.from_verifier(tiny_torch)
    backend = drafter.backend
    assert backend.lean.weights == "dynamic"
    assert drafter.tree_width > 1  # dynamic int8 (~0.90 agreement) keeps its trees
    # the fallback is said in the log (once per reason and process)
    from nodes.drafters import int8

    assert f"{few_rows.ENV}=torch" in int8._said
    forced = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert w8.quantize_linears_w8(forced, force=True) == 1  # tests and tools may still force it
    np.testing.assert_allclose(forced(torch.ones(1, 8)).detach().numpy(),
                               _reference(torch.ones(1, 8), forced[0]).numpy(), atol=1e-5)


@needs_kernel
def test_the_int8_drafter_is_weight_only_where_the_kernel_is(kernel, tiny_torch, prompt_ids):
    """Its lean forward computes what an HF copy converted by `quantize_linears_w8` does."""
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.int8 import Int8Drafter

    drafter = Int8Drafter.from_verifier(tiny_torch)
    lean = drafter.backend
    assert lean.lean.weights == "w8"
    assert drafter.tree_width == 1  # ~0.98 agreement: its chain, no trees (docs/engine.md)
    hf_model = copy.deepcopy(tiny_torch.model)
    assert w8.quantize_linears_w8(hf_model) == 7 * len(hf_model.model.layers) + 1
    hf = TorchBackend.from_model(hf_model, tiny_torch.tokenizer, "hf-w8")
    caches = hf.new_cache(), lean.new_cache()
    rows = [b.forward(c, prompt_ids) for b, c in zip((hf, lean), caches, strict=True)]
    np.testing.assert_allclose(rows[1], rows[0], atol=1e-4, rtol=1e-4)
    fp32 = tiny_torch.forward(tiny_torch.new_cache(), prompt_ids)
    assert np.abs(rows[1] - fp32).mean() < 0.05 * np.abs(fp32).mean()  # close to the model
    tokens, parents = [5, 6, 7, 8, 9], [-1, 0, 0, 2, 2]
    rows = [b.forward_tree(c, tokens, parents) for b, c in zip((hf, lean), caches, strict=True)]
    np.testing.assert_allclose(rows[1], rows[0], atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.slow
def test_weight_only_int8_agrees_with_smollm2_more_than_the_dynamic_fallback(
        kernel, smollm2_folder, monkeypatch):
    """Teacher-forced greedy agreement over the model's own continuations (deterministic)."""
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.int8 import Int8Drafter

    verifier = TorchBackend.load(str(smollm2_folder), device="cpu")
    weight_only = Int8Drafter.from_verifier(verifier).backend
    monkeypatch.setenv(few_rows.ENV, "torch")
    dynamic = Int8Drafter.from_verifier(verifier).backend
    monkeypatch.delenv(few_rows.ENV)
    assert (weight_only.lean.weights, dynamic.lean.weights) == ("w8", "dynamic")

    good, fallback = greedy_agreement(verifier, (weight_only, dynamic))
    # measured 0.94-1.00 per prompt over 10 prompts x 64 tokens (mean 0.977; dynamic 0.900)
    assert good >= 0.9, (good, fallback)
    assert good >= fallback, (good, fallback)


@pytest.mark.parametrize("form", ["w8", "dynamic"])
def test_a_tree_grown_a_level_at_a_time_computes_only_its_new_nodes(
        form, tiny_torch, prompt_ids, monkeypatch):
    """The model drafter feeds its whole tree again at each level after a crop back to the
    base; the lean backend reuses the nodes it has (their K/V depend on their ancestors only)
    and gives what a fresh forward of the whole tree gives. Not with dynamic int8, whose
    activation scale is per call."""
    from nodes.drafters.int8 import Int8Drafter

    if form == "w8" and available_reason() is not None:
        pytest.skip(f"no kernel: {available_reason()}")
    if form == "dynamic":
        monkeypatch.setenv(few_rows.ENV, "torch")
    lean = Int8Drafter.from_verifier(tiny_torch).backend
    assert lean.lean.weights == form
    grown, fresh = lean.new_cache(), lean.new_cache()
    for cache in (grown, fresh):
        lean.forward(cache, prompt_ids)
    base = len(prompt_ids)
    levels = [([5], [-1]), ([5, 6, 7], [-1, 0, 0]), ([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 2, 2])]
    fed = []
    for tokens, parents in levels:
        lean.crop(grown, base)
        logits = lean.forward_tree(grown, tokens, parents)
        fed.append(len(tokens))
        assert lean.cache_length(grown) == base + len(tokens)
    calls = []
    real = lean.lean._run
    monkeypatch.setattr(lean.lean, "_run", lambda c, t, *a: calls.append(len(t)) or real(c, t, *a))
    lean.crop(grown, base)
    again = lean.forward_tree(grown, *levels[-1])  # the same tree again: nothing computed
    lean.crop(grown, base)
    bigger = lean.forward_tree(grown, [*levels[-1][0], 11], [*levels[-1][1], 3])
    if form == "dynamic":  # activations scaled per call: the whole tree is computed again
        assert calls == [6, 7]
        return
    assert calls == [1]  # the one new node
    lean.crop(fresh, base)
    whole = lean.forward_tree(fresh, [*levels[-1][0], 11], [*levels[-1][1], 3])
    calls.clear()
    # rows are independent in the linear layers; attention rounds by query count (~2e-5)
    np.testing.assert_allclose(bigger, whole, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(again, logits, atol=0, rtol=0)
    # compaction, a plain forward or a crop below the base forget the tree
    lean.compact(grown, base, [0, 1, 3])
    assert grown.tree is None
    lean.crop(grown, base)
    other = lean.forward_tree(grown, [5, 9], [-1, 0])
    assert calls == [2] and other.shape[0] == 2
    lean.crop(grown, base - 1)
    assert grown.tree is None


def available_reason():
    return w8.available()
