"""Sampling controls (issue 47, item 1): top_k, min_p, repetition/presence/frequency penalties
and logit_bias, applied by the verifier at every position it checks, so speculation never
changes the output.

- greedy under each control equals an independent reference over HF logits: the model's own
  forward each step, HF's `RepetitionPenaltyLogitsProcessor` for the repetition penalty, a
  plain numpy loop for OpenAI's presence/frequency penalties and the bias;
- with speculation (ngram, scripted chains, a scripted tree, a batch) identical to plain;
- sampled: a function of the seed whatever drafts it; top_k/min_p (and a penalty) distributed
  as an exact reference computed with HF's warpers (chi-square).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams, SamplingParams
from nodes.engine.errors import BadRequestError
from nodes.engine.sampling import History, adjust_logits
from nodes.engine.sources import DraftSource
from nodes.engine.state import Stats
from nodes.engine.tree import DraftTree
from tests.engine.conftest import step_together

N = 24
EOS_NONE = frozenset({49151})


def controls(ref: list[int]) -> dict[str, SamplingParams]:
    """Each control alone and together; the bias bans tokens plain greedy picks."""
    ban = ((ref[0], -100.0), (ref[3], -100.0), (ref[5], -50.0), (1234, 8.0))
    return {
        # this random model never repeats by itself: a repetition penalty below 1 makes it
        # repeat, the presence and frequency penalties are tried against that
        "repetition": SamplingParams(repetition_penalty=2.5),
        "repetition_below_1": SamplingParams(repetition_penalty=0.5),
        "presence": SamplingParams(repetition_penalty=0.5, presence_penalty=2.0),
        "frequency": SamplingParams(repetition_penalty=0.5, frequency_penalty=1.0),
        "logit_bias": SamplingParams(logit_bias=tuple(sorted(ban))),
        "top_k_min_p": SamplingParams(top_k=3, min_p=0.3),
        "all": SamplingParams(top_k=40, min_p=0.05, repetition_penalty=0.6,
                              presence_penalty=0.5, frequency_penalty=0.8,
                              logit_bias=tuple(sorted(ban))),
    }


def reference_adjust(scores, input_ids: list[int], n_prompt: int, sp: SamplingParams):
    """The reference: HF's processor for repetition_penalty, then OpenAI's penalties and the
    bias written out plainly (numpy), over one row of HF logits (torch [1, vocab])."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    if sp.repetition_penalty is not None:
        scores = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(
            torch.tensor([input_ids]), scores.clone())
    x = scores[0].double().numpy().copy()
    generated = input_ids[n_prompt:]
    for tok in set(generated):
        count = generated.count(tok)
        x[tok] -= (sp.presence_penalty or 0.0) * (count > 0)
        x[tok] -= (sp.frequency_penalty or 0.0) * count
    for tok, b in sp.logit_bias or ():
        x[tok] += b
    return x


def reference_greedy(backend, prompt_ids, sp, n=N):
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            scores = backend.model(torch.tensor([ids])).logits[:, -1, :].float()
            ids.append(int(np.argmax(reference_adjust(scores, ids, len(prompt_ids), sp))))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def plain_ref(tiny_torch, prompt_ids):
    return reference_greedy(tiny_torch, prompt_ids, SamplingParams())


@pytest.fixture(scope="module")
def refs(tiny_torch, prompt_ids, plain_ref):
    return {name: reference_greedy(tiny_torch, prompt_ids, sp)
            for name, sp in controls(plain_ref).items()}


def params(sp: SamplingParams, n=N) -> GenerationParams:
    return GenerationParams(max_tokens=n, sampling=sp, eos_token_ids=EOS_NONE)


NAMES = list(controls([0] * 8))


def test_the_controls_change_greedy_output(refs, plain_ref):
    """The penalties and the bias really bite on this model (else the tests below prove
    nothing); top_k/min_p keep the argmax, so greedy is unchanged by them."""
    for name in ("repetition_below_1", "presence", "frequency", "logit_bias", "all"):
        assert refs[name] != plain_ref, name
    # the presence and frequency penalties change what the repetition penalty alone makes
    assert refs["presence"] != refs["repetition_below_1"] != refs["frequency"]
    # (a repetition penalty above 1 does not bite here: this model never repeats; its rule is
    # checked against HF's processor on random rows, `test_adjust_logits_matches_...`)
    assert refs["top_k_min_p"] == plain_ref


@pytest.mark.parametrize("name", NAMES)
def test_plain_greedy_matches_the_reference(tiny_torch, prompt_ids, plain_ref, refs, name):
    sp = controls(plain_ref)[name]
    out = Engine(tiny_torch).generate(prompt_ids, params(sp)).token_ids
    assert out == refs[name]


class ScriptedChain(DraftSource):
    """Drafts from a known continuation, right or wrong at random (a deterministic drafter)."""

    name = "scripted"

    def __init__(self, reference, vocab, seed=0, right=0.7):
        self.reference, self.vocab = list(reference), vocab
        self.rng, self.right = np.random.default_rng(seed), right

    def propose(self, committed, budget):
        truth = self.reference[len(committed): len(committed) + budget]
        out = [t if self.rng.random() < self.right else int(self.rng.integers(self.vocab))
               for t in truth]
        return DraftTree.of_chain(out)


class ScriptedTree(ScriptedChain):
    """The truth among decoys: a wrong first branch and a wrong turn at every depth."""

    name = "scripted-tree"

    def propose(self, committed, budget):
        truth = self.reference[len(committed): len(committed) + budget]
        out = [[(t + 1) % self.vocab for t in truth[:2]]]
        for cut in range(1, len(truth)):
            out.append([*truth[:cut], int(self.rng.integers(self.vocab))])
        out.append(truth)
        return DraftTree.from_paths([(p, None) for p in out if p])


@pytest.mark.parametrize("name", NAMES)
def test_greedy_with_speculation_equals_plain(tiny_torch, prompt_ids, plain_ref, refs, name):
    sp = controls(plain_ref)[name]
    want = refs[name]
    full = list(prompt_ids) + want + [7] * 32
    vocab = tiny_torch.vocab_size
    got = Engine(tiny_torch, NgramDrafter(), fixed_k=4).generate(prompt_ids, params(sp))
    assert got.token_ids == want
    out, stats = [], Stats()  # a scripted chain: right and wrong drafts
    for block in Engine(tiny_torch, fixed_k=5).stream(
            prompt_ids, params(sp), stats=stats, sources=[ScriptedChain(full, vocab, seed=1)]):
        out.extend(block.token_ids)
    assert out == want and stats.accepted > 0
    stats, out = Stats(), []
    for block in Engine(tiny_torch, fixed_k=8).stream(
            prompt_ids, params(sp), stats=stats, sources=[ScriptedTree(full, vocab, seed=2)]):
        out.extend(block.token_ids)
    assert out == want and stats.tree_blocks > 0 and stats.accepted > 0


def test_a_batch_of_different_controls_equals_each_alone(tiny_torch, prompt_ids, plain_ref,
                                                          refs):
    """Each sequence of one batch under its own control (and drafts) as it would be alone."""
    cs = controls(plain_ref)
    names = ["repetition", "frequency", "logit_bias", "all"]
    vocab = tiny_torch.vocab_size
    engine = Engine(tiny_torch, fixed_k=4)
    seqs = [engine.start(prompt_ids, params(cs[n]), sources=[
        ScriptedChain(list(prompt_ids) + refs[n] + [7] * 32, vocab, seed=i)])
        for i, n in enumerate(names)]
    outs = step_together(engine, seqs)
    for s in seqs:
        engine.release(s)
    assert outs == [refs[n] for n in names]


@pytest.mark.parametrize("name", ["repetition", "all"])
def test_a_seed_gives_one_text_whatever_drafts_it(tiny_torch, prompt_ids, plain_ref, name):
    from dataclasses import replace

    sp = replace(controls(plain_ref)[name], temperature=1.0, seed=99)
    plain = Engine(tiny_torch).generate(prompt_ids, params(sp)).token_ids
    full = list(prompt_ids) + plain + [7] * 32
    assert Engine(tiny_torch, NgramDrafter(), fixed_k=4).generate(
        prompt_ids, params(sp)).token_ids == plain
    out = []
    for block in Engine(tiny_torch, fixed_k=8).stream(
            prompt_ids, params(sp), sources=[ScriptedTree(full, tiny_torch.vocab_size)]):
        out.extend(block.token_ids)
    assert out == plain
    other = Engine(tiny_torch).generate(prompt_ids, params(replace(sp, seed=100))).token_ids
    assert other != plain


def test_adjust_logits_matches_the_reference_on_random_rows():
    import torch

    rng = np.random.default_rng(0)
    for trial in range(20):
        row = rng.normal(0, 3, 500).astype(np.float32)
        prompt = list(rng.integers(0, 500, 30))
        gen = list(rng.integers(0, 500, 20))
        sp = SamplingParams(repetition_penalty=float(rng.uniform(0.3, 3)),
                            presence_penalty=float(rng.uniform(-2, 2)),
                            frequency_penalty=float(rng.uniform(-2, 2)),
                            logit_bias=((3, 5.0), (int(gen[0]), -100.0)))
        got = adjust_logits(row, sp, History(prompt, gen))
        want = reference_adjust(torch.tensor(row[None]), [int(t) for t in prompt + gen],
                                len(prompt), sp)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5, err_msg=str(trial))


def test_bad_controls_are_refused(tiny_torch, prompt_ids):
    engine = Engine(tiny_torch)
    bad = [SamplingParams(logit_bias=((tiny_torch.vocab_size, 1.0),)),
           SamplingParams(logit_bias=((5, 101.0),)),
           SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))),
           SamplingParams(min_p=1.5), SamplingParams(repetition_penalty=0.0),
           SamplingParams(presence_penalty=2.5), SamplingParams(frequency_penalty=-3)]
    for sp in bad:
        with pytest.raises(BadRequestError) as info:
            engine.generate(prompt_ids, params(sp, 2))
        assert info.value.field in ("logit_bias", "min_p", "repetition_penalty",
                                    "presence_penalty", "frequency_penalty"), sp


# ---- distributions under sampling ---------------------------------------------------------
LENGTH = 3
SAMPLES = 500


def chi2_crit(df: int, z: float = 3.0902) -> float:
    """The chi-square critical value at alpha 1e-3 (Wilson-Hilferty; within 1% for df >= 3)."""
    h = 2.0 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


DIST_CASES = {
    "top_k": SamplingParams(temperature=2.5, top_k=3),
    # min_p alone: 6 sequences where the unfiltered distribution has thousands
    "min_p": SamplingParams(temperature=0.5, min_p=0.3),
    "min_p_presence": SamplingParams(temperature=1.5, min_p=0.3, top_k=4,
                                     presence_penalty=1.5),
}


def exact_dist(backend, prompt_ids, sp):
    """{tokens: probability} of the first LENGTH tokens, from HF's warpers over the model's
    logits (and the reference penalties): independent of `probs_from_logits`."""
    import torch
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    def dist(prefix):
        with torch.no_grad():
            scores = backend.model(torch.tensor([prefix])).logits[:, -1, :].float()
        scores = torch.tensor(reference_adjust(scores, prefix, len(prompt_ids), sp)[None])
        ids = torch.tensor([prefix])
        scores = TemperatureLogitsWarper(sp.temperature)(ids, scores)
        if sp.top_k:
            scores = TopKLogitsWarper(sp.top_k)(ids, scores)
        if sp.min_p:
            scores = MinPLogitsWarper(sp.min_p)(ids, scores)
        p = torch.softmax(scores, -1)[0].numpy()
        return {int(t): float(p[t]) for t in np.nonzero(p > 0)[0]}

    out = {(): 1.0}
    for _ in range(LENGTH):
        out = {seq + (t,): pr * pt for seq, pr in out.items()
               for t, pt in dist(list(prompt_ids) + list(seq)).items()}
    return out


@pytest.fixture(scope="module")
def short_prompt(tiny_torch):
    return tiny_torch.tokenizer.encode("The quick brown fox")


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_sampled_distribution_matches_hf_warpers(tiny_torch, short_prompt, case):
    from dataclasses import replace

    from tests.engine.test_engine_sampling import GreedyModelDrafter

    sp = DIST_CASES[case]
    exact = exact_dist(tiny_torch, short_prompt, sp)
    assert 4 <= len(exact) and min(exact.values()) * SAMPLES >= 5, sorted(exact.values())
    assert abs(sum(exact.values()) - 1) < 1e-6
    engines = {"plain": Engine(tiny_torch),
               "speculative": Engine(tiny_torch, GreedyModelDrafter(tiny_torch), fixed_k=2)}
    for which, engine in engines.items():
        counts: dict = {}
        for seed in range(SAMPLES):
            gen = engine.generate(short_prompt, GenerationParams(
                max_tokens=LENGTH, sampling=replace(sp, seed=seed), eos_token_ids=frozenset()))
            counts[tuple(gen.token_ids)] = counts.get(tuple(gen.token_ids), 0) + 1
        assert set(counts) <= set(exact), f"{which}: sampled outside the support"
        chi2 = sum((counts.get(s, 0) - SAMPLES * p) ** 2 / (SAMPLES * p)
                   for s, p in exact.items())
        assert chi2 < chi2_crit(len(exact) - 1), (which, chi2, len(exact))


def test_sampled_distribution_under_a_grammar(tiny_torch, short_prompt):
    """Issue 46: sampling under a grammar draws from the model's distribution masked to the
    tokens the grammar allows and renormalised, plain and speculating alike. The reference
    masks independently of llguidance: a token is allowed where its text keeps the output a
    prefix of the regex `[a-d]{2}` (EOS once it is whole), from the vocabulary's own strings.
    Outcomes a reference gives under 5 expected draws are pooled into one cell."""
    import re
    from dataclasses import replace

    import torch

    from nodes.engine.grammar import Constraint
    from tests.engine.test_engine_sampling import GreedyModelDrafter

    hf = tiny_torch.tokenizer.hf
    eos = sorted(tiny_torch.tokenizer.eos_token_ids)[0]
    vocab = tiny_torch.vocab_size
    text = [hf.decode([t]) for t in range(vocab)]
    sp = SamplingParams(temperature=4.0)  # spread: the random model is peaked

    def dist(prefix_ids, done_text):
        with torch.no_grad():
            logits = tiny_torch.model(torch.tensor([prefix_ids])).logits[0, -1].float()
        if len(done_text) == 2:
            return {eos: 1.0}
        ok = [t for t in range(vocab) if text[t] and t != eos and
              re.fullmatch(r"[a-d]{1,2}", text[t]) and len(done_text + text[t]) <= 2]
        p = torch.softmax(logits[ok] / sp.temperature, -1).numpy()
        return dict(zip(ok, p.tolist(), strict=True))

    exact = {(): 1.0}
    for _ in range(2):
        nxt = {}
        for seq, pr in exact.items():
            done = "".join(text[t] for t in seq if t != eos)
            if seq and seq[-1] == eos:
                nxt[seq] = pr
                continue
            for t, pt in dist(list(short_prompt) + list(seq), done).items():
                nxt[seq + (t,)] = pr * pt
        exact = nxt
    c = Constraint("regex", "[a-d]{2}")
    engines = {"plain": Engine(tiny_torch, grammar_drafts=False),
               "speculative": Engine(tiny_torch, GreedyModelDrafter(tiny_torch), fixed_k=2)}
    big = {s for s, p in exact.items() if p * SAMPLES >= 5}
    assert len(big) >= 3
    for which, engine in engines.items():
        counts: dict = {}
        for seed in range(SAMPLES):
            gen = engine.generate(short_prompt, GenerationParams(
                max_tokens=2, sampling=replace(sp, seed=seed), constraint=c))
            key = tuple(gen.token_ids) + ((eos,) if len(gen.token_ids) == 1 else ())
            counts[key] = counts.get(key, 0) + 1
        assert set(counts) <= set(exact), f"{which}: sampled outside the masked support"
        rest_p = sum(p for s, p in exact.items() if s not in big)
        rest_n = sum(n for s, n in counts.items() if s not in big)
        cells = [(counts.get(s, 0), exact[s]) for s in big]
        if rest_p * SAMPLES >= 5:
            cells.append((rest_n, rest_p))
        chi2 = sum((n - SAMPLES * p) ** 2 / (SAMPLES * p) for n, p in cells)
        assert chi2 < chi2_crit(len(cells) - 1), (which, chi2, len(cells))
