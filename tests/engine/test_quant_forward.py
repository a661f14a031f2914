"""The quantized verifier (nodes/backends/quant_forward.py, quant_rows.cpp): its blocks read as
gguf's reference reader reads them, its rows independent of what shares a forward (bit for bit),
speculation identical to its own plain decoding, and bad input refused by name."""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodes.backends import quant_forward as qf
from nodes.engine import Engine, GenerationParams
from nodes.engine.errors import BadRequestError
from tests.engine.conftest import (
    ScriptedDrafter,
    build_tiny,
    needs_kernel,
    node_path,
    primed_caches,
    step_live,
)

pytestmark = needs_kernel

gguf = pytest.importorskip("gguf")


def _gguf_quantized(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (n, 1))
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_served_blocks_dequantize_as_ggufs_reader(type_name):
    """The block types served as they are: the weights they stand for are gguf's, exactly."""
    raw = _gguf_quantized(type_name, 12, 96)
    mat = qf.from_blocks(type_name, raw, 12, 96)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(12, 96)
    assert mat.source == type_name
    assert torch.equal(mat.dequantized(), torch.from_numpy(ref.astype(np.float32)))


def _random_k_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks with sane float16 scales (where gguf has no quantizer for them)."""
    size = {"Q4_K": 144, "Q6_K": 210}[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scale = np.full((n, k // 256, 1), 0.01, dtype=np.float16).view(np.uint8)
    if type_name == "Q4_K":  # d, dmin first
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # d last
        raw[..., -2:] = scale
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_other_block_types_are_requantized_once_to_q8_0(type_name):
    raw = _random_k_blocks(type_name, 8, 256)
    mat = qf.from_blocks(type_name, raw, 8, 256)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(8, 256)
    assert mat.kind == qf.KIND_Q8_0 and mat.source == f"{type_name} -> Q8_0"
    step = np.abs(ref).reshape(8, -1, 32).max(axis=-1, keepdims=True) / 127  # a Q8_0 step
    err = np.abs(mat.dequantized().numpy().reshape(8, -1, 32) - ref.reshape(8, -1, 32))
    # half a step, and the float16 rounding of the scale (127 x 2^-11 of a step at most)
    assert (err <= step * 0.57 + 1e-6).all()


def _matrix(kind: str, n: int, k: int, seed: int) -> qf.Matrix:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return qf.quantize(w, kind) if kind != "F32" else qf.from_blocks("F32", w, n, k)


@settings(max_examples=int(os.environ.get("SPECBUS_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["Q8_0", "Q4_1", "F32"]), n=st.integers(1, 70),
       blocks=st.integers(1, 6), rows=st.integers(1, 32), seed=st.integers(0, 2**16))
def test_each_rows_product_is_its_one_row_product_bit_for_bit(kernel, kind, n, blocks, rows,
                                                               seed):
    """Row independence of the products: any number of rows (1-32), any shape, every kind."""
    k = 32 * blocks
    mat = _matrix(kind, n, k, seed)
    q = kernel.QMat(mat.kind, mat.qs, mat.d, mat.m, mat.n, mat.k)
    x = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((rows, k))
                         .astype(np.float32))
    together = kernel.qlinear(q, x)
    for i in range(rows):
        assert torch.equal(together[i], kernel.qlinear(q, x[i:i + 1])[0]), f"row {i} of {rows}"
    # and it is the product it stands for: the weights exactly (x . dequantized w), the
    # activations rounded to their block's step (at most half of amax / 127 each, none for F32)
    w = mat.dequantized()
    ref = x @ w.T
    if kind == "F32":
        bound = 1e-4 * (x.abs() @ w.abs().T) + 1e-5
    else:
        amax = x.abs().view(rows, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32)
        rounding = (amax.reshape(rows, k) / 254) @ w.abs().T
        bound = rounding * 1.01 + 1e-4 * (x.abs() @ w.abs().T) + 1e-5
    assert ((together - ref).abs() <= bound).all()


# ---- the whole forward, on the tiny random Llama --------------------------------------------
@pytest.fixture(scope="module", params=["q8", "q4"])
def tiny_quant(request, tiny_folder):
    from nodes.backends.torch_backend import TorchBackend

    backend = TorchBackend.load(str(tiny_folder), device="cpu", weights=request.param)
    assert isinstance(backend.lean, qf.QuantForward)
    return backend


def _solo_chain(backend, past, tokens):
    """Each token's logits fed one at a time after `past`."""
    cache = backend.new_cache()
    backend.forward(cache, past)
    return np.stack([backend.forward(cache, [t])[0] for t in tokens])


def test_a_verify_chain_gives_each_token_its_one_row_logits(tiny_quant, prompt_ids):
    past, chain = prompt_ids[:-1], [prompt_ids[-1], 11, 12, 13, 14, 15, 16, 17]
    cache = tiny_quant.new_cache()
    tiny_quant.forward(cache, past)
    together = tiny_quant.forward(cache, chain)
    assert np.array_equal(together, _solo_chain(tiny_quant, past, chain))


def test_a_tree_gives_each_node_its_path_fed_alone(tiny_quant, prompt_ids):
    past = prompt_ids[:-1]
    tokens, parents = [prompt_ids[-1], 5, 6, 7, 8, 9], [-1, 0, 0, 1, 2, 4]
    cache = tiny_quant.new_cache()
    tiny_quant.forward(cache, past)
    tree = tiny_quant.forward_tree(cache, tokens, parents)
    for node in range(len(tokens)):
        path = node_path(tokens, parents, node)
        assert np.array_equal(tree[node], _solo_chain(tiny_quant, past, path)[-1])


def test_a_batch_gives_each_sequence_its_solo_logits(tiny_quant, prompt_ids):
    prompts = [prompt_ids, prompt_ids[:4], prompt_ids[2:], prompt_ids[:7]]
    shapes = [([], [-1]), ([11, 12], [-1, 0, 1]), ([5, 6, 7, 8], [-1, 0, 0, 1, 2]),
              ([21, 22], [-1, 0, 1])]
    feeds = [([p[-1], *extra], parents) for p, (extra, parents) in
             zip(prompts, shapes, strict=True)]

    solo = [tiny_quant.forward_batch([c], [f])[0]
            for c, f in zip(primed_caches(tiny_quant, prompts), feeds, strict=True)]
    batched = tiny_quant.forward_batch(primed_caches(tiny_quant, prompts), feeds)
    for got, want in zip(batched, solo, strict=True):
        assert np.array_equal(got, want)


# heads a kv group: 4 (the kernel's tiles take 3, then 1), 1; head widths 32 and 12 (not a
# multiple of 8: the scalar path)
@pytest.mark.parametrize("heads,kv_heads,hidden", [(4, 1, 128), (3, 3, 96), (8, 4, 96)])
def test_every_attention_shape_gives_each_row_its_one_row_logits(tmp_path, smollm2_folder,
                                                                 prompt_ids, heads, kv_heads,
                                                                 hidden):
    from nodes.backends.torch_backend import TorchBackend

    build_tiny(tmp_path, smollm2_folder, seed=3, hidden=hidden, heads=heads, kv_heads=kv_heads)
    backend = TorchBackend.load(str(tmp_path), device="cpu", weights="q8")
    assert isinstance(backend.lean, qf.QuantForward)
    past, chain = prompt_ids[:-1], [prompt_ids[-1], 11, 12, 13, 14, 15, 16, 17]
    cache = backend.new_cache()
    backend.forward(cache, past)
    assert np.array_equal(backend.forward(cache, chain), _solo_chain(backend, past, chain))
    backend.crop(cache, len(past))
    tokens, parents = [prompt_ids[-1], 5, 6, 7, 8], [-1, 0, 0, 1, 2]
    tree = backend.forward_tree(cache, tokens, parents)
    for node, want in ((3, [tokens[0], 5, 7]), (4, [tokens[0], 6, 8]), (2, [tokens[0], 6])):
        assert np.array_equal(tree[node], _solo_chain(backend, past, want)[-1])


PARAMS = GenerationParams(max_tokens=24, eos_token_ids=frozenset())


@pytest.mark.parametrize("mode", ["perfect", "random", "wrong"])
def test_speculation_is_the_quantized_verifiers_plain_decoding(tiny_quant, prompt_ids, mode):
    plain = Engine(tiny_quant, None).generate(prompt_ids, PARAMS).token_ids
    drafter = ScriptedDrafter(list(prompt_ids) + list(plain), mode, tiny_quant.vocab_size)
    gen = Engine(tiny_quant, drafter, max_draft=8).generate(prompt_ids, PARAMS)
    assert gen.token_ids == plain
    if mode == "perfect":
        assert gen.stats.accepted > 0  # it did speculate


def test_a_prompts_rows_and_a_tree_in_one_forward_give_each_its_own_logits(tiny_quant,
                                                                           prompt_ids):
    """`forward_tree_after`: the prompt's rows (no logits) and a tree rooted at its last token
    in one forward give each node the logits of its path fed alone after the prompt, and leave
    the prompt's K/V as a prefill does (the next step's logits equal)."""
    assert tiny_quant.rows_independent
    past = prompt_ids[:-1]
    tokens, parents = [prompt_ids[-1], 5, 6, 7, 8, 9], [-1, 0, 0, 1, 2, 4]
    cache = tiny_quant.new_cache()
    tree = tiny_quant.forward_tree_after(cache, past, tokens, parents)
    assert tree.shape == (len(tokens), tiny_quant.vocab_size)
    for node in range(len(tokens)):
        path = node_path(tokens, parents, node)
        assert np.array_equal(tree[node], _solo_chain(tiny_quant, past, path)[-1])
    tiny_quant.compact(cache, len(past), [0, 1, 3])  # keep root, 5, 7; then one more token
    after = tiny_quant.forward(cache, [42])[0]
    assert np.array_equal(after, _solo_chain(tiny_quant, past, [prompt_ids[-1], 5, 7, 42])[-1])


@pytest.mark.parametrize("chunk,reuse", [(None, False), (8, False), (None, True)],
                         ids=["whole", "chunked", "prefix-reused"])
def test_the_first_block_drafts_with_the_prompt_and_decodes_as_plain(tiny_quant, prompt_ids,
                                                                     chunk, reuse):
    """On a backend whose rows are independent the prompt's last rows carry the first draft
    tree (`Engine._prefill_drafted`): the first block commits several tokens, and every token
    is the plain decoding's, whole, chunked or after a prefix-cache hit."""
    from nodes.engine.prefix_cache import PrefixCache

    prompt = list(prompt_ids) * 2
    plain = Engine(tiny_quant, None).generate(prompt, PARAMS).token_ids
    drafter = ScriptedDrafter(prompt + list(plain), "perfect", tiny_quant.vocab_size)
    # fixed_k: the draft budget pinned (the adaptive one rests on verify costs timed at load)
    engine = Engine(tiny_quant, drafter, max_draft=8, fixed_k=8, prefill_chunk=chunk)
    if reuse:  # the prompt's first half is in the prefix cache: only the rest is fed
        engine.prefix_cache = PrefixCache(tiny_quant, 64 << 20, min_reuse=4)
        engine.generate(prompt[:len(prompt_ids)], GenerationParams(max_tokens=1))
    blocks = list(engine.stream(prompt, PARAMS))
    assert [t for b in blocks for t in b.token_ids] == plain
    first = next(b for b in blocks if b.token_ids)
    assert len(first.token_ids) > 1 and first.accepted == len(first.token_ids) - 1
    if reuse:
        assert first.fed < len(prompt)  # (the reused positions were not fed)


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "sampled"])
def test_a_constrained_first_block_drafts_the_grammars_opening(tiny_quant, prompt_ids, seed):
    """The grammar's forced opening (`{"a":`) rides with the prompt's rows, masked from the
    grammar's first state: the same tokens as constrained plain, greedy and sampled."""
    from nodes.engine.grammar import Constraint
    from nodes.engine.sampling import SamplingParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    sp = SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed)
    p = GenerationParams(max_tokens=40, sampling=sp, constraint=Constraint.json_schema(schema))
    plain = Engine(tiny_quant, None, grammar_drafts=False).generate(prompt_ids, p)
    blocks = list(Engine(tiny_quant, None, fixed_k=8).stream(prompt_ids, p))  # budget pinned
    assert [t for b in blocks for t in b.token_ids] == plain.token_ids
    assert len(blocks[0].token_ids) > 1  # `{"`, `a`, ... in the prefill's forward


class _PerPrompt(ScriptedDrafter):
    """A scripted drafter for several prompts: each session drafts from its own reference."""

    def __init__(self, references, mode, vocab):
        super().__init__([], mode, vocab)
        self.references = references

    def open(self, prompt_ids, params):
        ref = next(r for r in self.references if r[:len(prompt_ids)] == list(prompt_ids))
        drafter = ScriptedDrafter(ref, self.mode, self.vocab, seed=len(prompt_ids))
        return drafter.open(prompt_ids, params)


def test_batched_speculation_is_each_plain_decoding(tiny_quant, prompt_ids):
    prompts = [list(prompt_ids), list(prompt_ids[:5]), list(prompt_ids[3:]),
               list((prompt_ids * 3)[:30])]
    plain = [Engine(tiny_quant, None).generate(p, PARAMS).token_ids for p in prompts]
    drafter = _PerPrompt([p + out for p, out in zip(prompts, plain, strict=True)], "random",
                         tiny_quant.vocab_size)
    engine = Engine(tiny_quant, drafter, max_draft=6)
    live = {i: engine.start(p, PARAMS) for i, p in enumerate(prompts)}
    out = {i: [] for i in live}
    while live:
        step_live(engine, live, out)
    assert [out[i] for i in range(len(prompts))] == plain


# ---- bad input ------------------------------------------------------------------------------
def test_unknown_weights_are_refused(tiny_folder):
    from nodes.backends.torch_backend import TorchBackend

    with pytest.raises(BadRequestError, match="--weights 'q3'"):
        TorchBackend.load(str(tiny_folder), device="cpu", weights="q3")


def test_a_truncated_gguf_is_refused_by_name(tmp_path, smollm2_folder):
    from nodes import models
    from nodes.backends.torch_backend import TorchBackend

    shipped = models.shipped_gguf(models.resolve(models.DEFAULT_MODEL))
    cut = tmp_path / "cut.gguf"
    with open(shipped, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(3_000_000))
    backend = TorchBackend.load(None, device="cpu")
    with pytest.raises(qf.QuantError, match="cut.gguf"):
        qf.from_gguf(cut, backend.model)


def test_an_architecture_it_does_not_serve_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(qf.QuantError, match="Llama-layout"):
        qf.build(model, "q8")


def test_without_a_compiler_it_says_so_and_fp32_serves(monkeypatch, tiny_folder):
    """A kernel build failure (here: the build switched off) falls back with a clear error for
    q8/q4, and the reference mode still loads."""
    from nodes.backends import few_rows
    from nodes.backends.torch_backend import TorchBackend

    monkeypatch.setattr(few_rows, "_tried", True)
    monkeypatch.setattr(few_rows, "_loaded", None)
    monkeypatch.setenv(few_rows.ENV, "torch")
    with pytest.raises(BadRequestError, match="kernels"):
        TorchBackend.load(str(tiny_folder), device="cpu", weights="q8")
    assert TorchBackend.load(str(tiny_folder), device="cpu").weights == "fp32"


# ---- the embedded model's shipped file, as it is --------------------------------------------
@pytest.mark.slow
def test_shipped_q4_1_file_is_the_fp32_export_exactly_and_speculation_is_lossless():
    from nodes import models
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.registry import make_drafter

    backend = TorchBackend.load(None, device="cpu", weights="q4")
    assert backend.weights.startswith("file (") and "Q4_1" in backend.weights
    # the export came from this file: its blocks dequantized are the fp32 model's weights
    w = qf.from_gguf(models.shipped_gguf(models.resolve(None)), backend.model)
    layer = backend.model.model.layers[3]
    att = layer.self_attn
    for mat, lin in ((w.layers[3].q, att.q_proj), (w.layers[3].k, att.k_proj),
                     (w.layers[3].down, layer.mlp.down_proj)):
        assert torch.equal(mat.dequantized(), lin.weight.detach())
    prompt = backend.tokenizer.encode("List the planets of the solar system in order.")
    params = GenerationParams(max_tokens=64, eos_token_ids=frozenset())
    plain = Engine(backend, None).generate(prompt, params).token_ids
    spec = Engine(backend, make_drafter("ngram", backend)).generate(prompt, params)
    assert spec.token_ids == plain


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the kernels")
def test_card_weights_form_is_named(tiny_quant):
    assert tiny_quant.weights.startswith(("q8", "q4"))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_the_avx2_and_avx512_vnni_tiles_give_the_same_bits(kernel, kind):
    """The two instruction sets' tiles compute the same integers and the same float steps in
    the same order: a verifier gives the same output on either kind of CPU."""
    if kernel.quant_isa("auto") != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 tiles run here")
    mat = _matrix(kind, 37, 192, seed=3)
    q = kernel.QMat(mat.kind, mat.qs, mat.d, mat.m, mat.n, mat.k)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((11, 192)).astype(np.float32))
    try:
        kernel.quant_isa("avx2")
        avx2 = kernel.qlinear(q, x)
        kernel.quant_isa("avx512-vnni")
        vnni = kernel.qlinear(q, x)
    finally:
        kernel.quant_isa("auto")
    assert torch.equal(avx2, vnni)


# sha256 of the products' bytes (first 16 hex digits), as the AVX2 tiles of stop 62 computed
# them, which the test above had found equal to the VNNI tiles' on an AVX-512 machine
PINNED_BITS = {"Q8_0": "71f9519cede4d3ac", "Q4_1": "c5ef454a6bafe9d9"}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_the_products_bits_are_pinned_on_every_kind_of_cpu(kernel, kind):
    """The same bits on any x86 CPU: a machine without VNNI checks its AVX2 tiles against the
    pinned product of tiles that matched VNNI bit for bit (13 rows: full tiles and a rest)."""
    mat = _matrix(kind, 53, 320, seed=5)
    q = kernel.QMat(mat.kind, mat.qs, mat.d, mat.m, mat.n, mat.k)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((13, 320)).astype(np.float32))
    try:
        for isa in ("avx2", "auto"):
            kernel.quant_isa(isa)
            bits = hashlib.sha256(kernel.qlinear(q, x).numpy().tobytes()).hexdigest()[:16]
            assert bits == PINNED_BITS[kind], isa
    finally:
        kernel.quant_isa("auto")


def test_the_phase_clock_accounts_for_a_forward(kernel, tiny_quant, prompt_ids):
    """`quant_profile` (where a forward's time goes: bench vs-llamacpp prints it) counts every
    phase of a forward once it is on, and nothing once it is off."""
    cache = tiny_quant.new_cache()
    kernel.quant_profile(True)
    tiny_quant.forward(cache, prompt_ids)
    spent = kernel.quant_profile(False)
    assert len(spent) == 10 and all(ns >= 0 for ns in spent) and sum(spent) > 0
    tiny_quant.forward(cache, [5])
    assert sum(kernel.quant_profile(False)) == 0


# ---- --model FILE.gguf ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_gguf_file_as_the_model_serves_its_own_blocks():
    """`--model FILE.gguf --weights file`: exported once (keyed by the file's hash) for the
    config and tokenizer, computed on the file's own blocks: the same logits as the embedded
    model's q4, which is that same file."""
    from nodes import models
    from nodes.backends.torch_backend import TorchBackend

    shipped = models.shipped_gguf(models.resolve(None))
    ref = models.resolve(str(shipped))
    assert ref.gguf == shipped.resolve() and ref.path.name.startswith("gguf-")
    assert models.resolve(str(shipped)).path == ref.path  # exported once
    by_file = TorchBackend.load(str(shipped), device="cpu", weights="file")
    embedded = TorchBackend.load(None, device="cpu", weights="q4")
    assert by_file.weights.startswith("file (SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = embedded.tokenizer.encode("Name three rivers.")
    a, b = by_file.new_cache(), embedded.new_cache()
    assert np.array_equal(by_file.forward(a, ids), embedded.forward(b, ids))


def test_a_bad_gguf_model_file_is_refused_by_name(tmp_path):
    from nodes import models
    from nodes.engine.errors import ModelNotFoundError

    fake = tmp_path / "notes.gguf"
    fake.write_bytes(b"this is not a model, only text in a file named like one" * 4)
    with pytest.raises(ModelNotFoundError, match="notes.gguf.*not a GGUF"):
        models.resolve(str(fake))
    with pytest.raises(ModelNotFoundError, match="no such GGUF"):
        models.resolve(str(tmp_path / "missing.gguf"))


def test_file_weights_need_a_gguf_model(tiny_folder):
    from nodes.backends.torch_backend import TorchBackend

    with pytest.raises(BadRequestError, match="GGUF model's own blocks"):
        TorchBackend.load(str(tiny_folder), device="cpu", weights="file")


def test_weights_that_do_not_fit_the_config_are_refused(tiny_folder):
    """A file whose matrices disagree with its config gets a QuantError (a 400 on load), not
    the kernel's exception."""
    from nodes.backends.torch_backend import TorchBackend

    backend = TorchBackend.load(str(tiny_folder), device="cpu")
    w = qf.from_model(backend.model, "q8")
    w.layers[0].o = w.layers[0].down  # [hidden, intermediate] where [hidden, heads x dim] goes
    with pytest.raises(qf.QuantError, match="do not fit"):
        qf.QuantForward(w)
