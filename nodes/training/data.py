"""Training data for a head, made here from the verifier itself (nothing downloaded).

1. Responses: the verifier answers a built-in list of varied prompts in batches, greedy and
   sampled; prompt + response is one sequence. With `layers`, the generation forwards also
   keep, at every position, the three hidden states the head reads and the verifier's
   next-token distribution (its `CANDIDATES` likeliest tokens over the whole vocabulary and
   its argmax): the labels come from the very pass that generates, so responses need no
   second forward (on a CPU teacher forcing costs per token what batched generation does).
2. Local text, when given, is cut into chunks that are sequences as they are, teacher-forced
   (`teacher_force`): one verifier pass gives their hidden states and labels.
   Prompts can be written by the verifier itself (`model_written_prompts`): fed only its chat
   template up to the user's turn, an instruction-tuned model samples what users ask it (the
   "Magpie" trick). Templates x topics (prompts.py) teach a head the answers to a few
   phrasings: a head trained on them was right 0.58 of the time on held-out template prompts
   but 0.38 on prompts written otherwise; the model's own user turns are as varied as what
   it was tuned on.
3. Draft vocabulary: the most frequent tokens of those sequences (what the verifier says);
   captured labels are then restricted to it (`examples_from_captured`), teacher-forced ones
   are computed over it: the verifier's distribution renormalised on the draft vocabulary,
   its top `TOPK` entries kept, and its full-vocabulary argmax (for top-1 accuracy).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TOPK = 16  # soft-target entries kept per position
#: full-vocabulary candidates kept per captured position (restricted to the draft vocabulary
#: later, when it is known); the mass beyond them is negligible for a trained LM
CANDIDATES = 64

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What are the main causes of inflation?",
    "Give me three tips for improving my sleep.",
    "Describe the water cycle in a few sentences.",
    "Write a haiku about autumn leaves.",
    "How do I make a simple tomato pasta sauce?",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a polite email asking my manager for a day off.",
    "What are some good habits for learning a new language?",
    "Explain what a black hole is.",
    "List five fun things to do on a rainy day.",
    "How does a bicycle stay upright?",
    "Write a limerick about a cat who loves cheese.",
    "What should I pack for a weekend camping trip?",
    "Explain the rules of chess briefly.",
    "Why do we have seasons on Earth?",
    "Write a short motivational message for a friend starting a new job.",
    "What is machine learning?",
    "How can I reduce my household's energy use?",
    "Describe a typical day of a medieval farmer.",
    "What are the benefits of regular exercise?",
    "Explain how vaccines train the immune system.",
    "Write a product description for a reusable water bottle.",
    "What is the Pythagorean theorem and how is it used?",
    "Give me a recipe for banana bread.",
    "How do airplanes fly?",
    "Tell me a fun fact about octopuses.",
    "What is the capital of Australia and what is it known for?",
    "Write a Python function that reverses a string.",
    "Explain recursion with a simple example.",
    "What is the difference between weather and climate?",
    "How do I start a vegetable garden?",
    "Write a short poem about the ocean.",
    "What are the planets in our solar system?",
    "Explain supply and demand.",
    "How does the internet work, in simple terms?",
    "Write a thank-you note to a teacher.",
    "What are some ways to manage stress?",
    "Describe the taste of coffee to someone who has never had it.",
    "Why do cats purr?",
    "Explain what DNA is.",
    "Give advice to someone preparing for a job interview.",
    "What happened during the French Revolution?",
    "Write a dialogue between a robot and a child.",
    "How do I calculate the area of a circle?",
    "What makes a good friend?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short review of an imaginary restaurant.",
    "What is the theory of evolution?",
    "Plan a one-day trip to a big city.",
    "How do bees make honey?",
    "Explain the difference between a list and a tuple in Python.",
    "Write a bedtime story about a dragon who is afraid of the dark.",
    "What are renewable energy sources?",
    "How can I be more productive when working from home?",
    "Describe how a volcano erupts.",
    "What is the meaning of the word 'serendipity'? Use it in a sentence.",
    "Write instructions for making a paper airplane.",
    "Why is reading important?",
    "Explain what an API is.",
    "What are the health benefits of drinking water?",
)


@dataclass
class Captured:
    """What a generating forward saw at each position of one sequence but its last token
    (whose row the loop never computes): the head's inputs and the verifier's labels over
    the whole vocabulary."""

    features: torch.Tensor  # fp16 [T-1, 3, H]
    cand_ids: torch.Tensor  # int32 [T-1, CANDIDATES]: likeliest next tokens, best first
    cand_p: torch.Tensor  # fp16 [T-1, CANDIDATES]: their probabilities
    top1: torch.Tensor  # int64 [T-1]


@dataclass
class Sequences:
    """Token sequences (prompt + response); `captured[i]` when generated with `layers`."""

    tokens: list[list[int]]
    captured: list[Captured] | None = None


@dataclass
class Example:
    """One teacher-forced sequence: what the head trains on."""

    tokens: torch.Tensor  # int64 [T]
    features: torch.Tensor  # fp16 [T, 3, H]: the verifier's hidden states at each position
    top_ids: torch.Tensor  # int64 [T, TOPK]: draft ids of the target's likeliest tokens
    top_p: torch.Tensor  # fp16 [T, TOPK]: their probabilities (renormalised on the draft vocab)
    top1: torch.Tensor  # int64 [T]: the verifier's argmax over its whole vocabulary


def make_responses(backend, prompts=PROMPTS, max_new: int = 128, batch: int = 8,
                   temperatures=(0.0, 0.8), seed: int = 0, cycle: bool = False,
                   done: Sequences | None = None, deadline: float | None = None,
                   on_batch=None, layers: tuple[int, ...] | None = None) -> Sequences:
    """The verifier's own answers to `prompts` (chat template), generated in left-padded
    batches. Default: every prompt once per temperature (sequence k answers prompt
    k % len(prompts)). `cycle`: every prompt once, batch b at temperature
    temperatures[b % len(temperatures)] (sequence k answers prompt k).
    `layers`: capture those hidden states and the labels while generating (`Captured`).
    `done`: sequences already made (resume: generation goes on after them); `deadline`
    (time.monotonic()): no new batch starts after it; `on_batch(seqs, start)` after every
    batch (`start`: where that batch begins in `seqs`)."""
    tok = backend.tokenizer
    inputs = [tok.encode(p, chat=tok.has_chat_template) for p in prompts]
    eos = sorted(tok.eos_token_ids)
    pad = eos[0] if eos else 0
    if cycle:
        jobs = [(k, temperatures[(k // batch) % len(temperatures)]) for k in range(len(inputs))]
    else:
        jobs = [(k, t) for t in temperatures for k in range(len(inputs))]
    out = Sequences(list(done.tokens) if done else [],
                    None if layers is None else list(done.captured or []) if done else [])
    while len(out.tokens) < len(jobs):
        if deadline is not None and time.monotonic() >= deadline:
            log.info("responses: time is up after %d sequences", len(out.tokens))
            break
        start = len(out.tokens)
        temp = jobs[start][1]
        chunk = []
        for k, t in jobs[start : start + batch]:
            if t != temp:
                break
            chunk.append(inputs[k])
        gen = torch.Generator().manual_seed(seed * 1_000_003 + start)
        seqs, caught = _generate(backend, chunk, max_new, temp, pad, eos, gen, layers)
        out.tokens += seqs
        if out.captured is not None:
            out.captured += caught
        log.info("responses: %d sequences (temperature %.1f)", len(out.tokens), temp)
        if on_batch is not None:
            on_batch(out, start)
    return out


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens before a user's words (system prompt, user header)."""
    a = tokenizer.encode("Hello there.", chat=True)
    b = tokenizer.encode("Why is the sea salty?", chat=True)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def model_written_prompts(backend, n: int, seed: int = 0, batch: int = 64, max_len: int = 48,
                          temperature: float = 1.0, deadline: float | None = None,
                          on_batch=None) -> list[str]:
    """Up to `n` distinct user prompts the verifier writes itself: sampled (temperature,
    nucleus 0.95) after its chat template's user header. Kept: turns the model ended within
    `max_len` tokens (longer ones ramble), of 4 tokens or more, each text once. Needs a chat
    template. `deadline` (time.monotonic()): no batch starts after it; `on_batch(prompts)`
    after every batch. At most 4x the batches `n` would need if every turn were kept: a
    model that seldom ends its turn gets a clear error, not an endless loop."""
    tok = backend.tokenizer
    if not tok.has_chat_template:
        raise ValueError("model-written prompts need a chat model (no chat template)")
    prefix = user_turn_prefix(tok)
    eos = sorted(tok.eos_token_ids)
    pad = eos[0] if eos else 0
    seen: set[str] = set()
    out: list[str] = []
    b, most = 0, 4 * -(-n // batch)
    while len(out) < n and (deadline is None or time.monotonic() < deadline):
        if b == most:
            if not out:
                raise ValueError(f"the verifier wrote no usable prompt in {b} batches of "
                                 f"{batch} (none ended its turn within {max_len} tokens): "
                                 "is it an instruction-tuned chat model?")
            log.warning("model-written prompts: %d of %d after %d batches; going on with "
                        "those", len(out), n, b)
            break
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * b + 1)
        seqs, _ = _generate(backend, [prefix] * batch, max_len, temperature, pad, eos, gen,
                            None)
        for s in seqs:
            turn = s[len(prefix):]
            if not turn or turn[-1] not in eos or len(turn) < 5:
                continue
            text = tok.decode(turn[:-1]).strip()
            if text and text not in seen:
                seen.add(text)
                out.append(text)
        b += 1
        log.info("model-written prompts: %d of %d after %d batches", len(out), n, b)
        if on_batch is not None:
            on_batch(out[:n])
    return out[:n]


@torch.inference_mode()
def _generate(backend, chunk: list[list[int]], max_new: int, temp: float, pad: int,
              eos: list[int], gen: torch.Generator, layers: tuple[int, ...] | None
              ) -> tuple[list[list[int]], list[Captured]]:
    """One left-padded batch decoded step by step over one KV cache (greedy, or temperature
    with nucleus 0.95); with `layers`, every forward's hidden states and labels are kept."""
    from transformers import DynamicCache

    model, dev = backend.model, backend.device
    width = max(len(c) for c in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(chunk):
        ids[i, width - len(c) :] = torch.tensor(c)
        mask[i, width - len(c) :] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    steps: list[tuple] = []  # per forward: (features, cand ids, cand p, top1), [B, n, ...]
    new = torch.empty((len(chunk), 0), dtype=torch.long, device=dev)
    done = torch.zeros(len(chunk), dtype=torch.bool, device=dev)
    stop = torch.tensor(eos or [-1], device=dev)
    feed = ids
    for _ in range(max_new):
        out = model(input_ids=feed, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True,
                    output_hidden_states=layers is not None,
                    logits_to_keep=0 if layers is not None else 1)
        if layers is not None:
            steps.append(_labels(out, layers))
        nxt = _pick(out.logits[:, -1].float(), temp, gen)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        new = torch.cat([new, nxt[:, None]], dim=1)
        done |= torch.isin(nxt, stop)
        if bool(done.all()):
            break
        feed = nxt[:, None]
        mask = torch.cat([mask, torch.ones_like(feed)], dim=1)
        positions = positions[:, -1:] + 1
    seqs, caught = [], []
    for i, c in enumerate(chunk):
        resp = new[i].tolist()
        for j, t in enumerate(resp):
            if t in eos:
                resp = resp[: j + 1]
                break
        seqs.append(list(c) + resp)
        if layers is None:
            continue
        # row i's real positions: the prompt's (after its left padding), then one per step;
        # the last token's row is never computed (it would take one more forward)
        n = len(c) + len(resp) - 1
        parts = [tuple(t[i, width - len(c) :] for t in steps[0])]
        parts += [tuple(t[i] for t in step) for step in steps[1 : len(resp)]]
        feats, cids, cp, top1 = (torch.cat(col)[:n] for col in zip(*parts, strict=True))
        caught.append(Captured(feats, cids, cp, top1))
    return seqs, caught


def _labels(out, layers: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """A forward's [B, n] features (fp16 [B, n, 3, H]) and labels (the CANDIDATES likeliest
    next tokens with their probabilities, and the argmax), moved to the CPU."""
    feats = torch.stack([out.hidden_states[i] for i in layers], dim=2).half().cpu()
    logits = out.logits.float()
    top = torch.topk(logits, min(CANDIDATES, logits.shape[-1]), dim=-1)  # no softmax tensor
    probs = torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
    return (feats, top.indices.int().cpu(), probs.half().cpu(), top.indices[..., 0].cpu())


def _pick(logits: torch.Tensor, temp: float, gen: torch.Generator) -> torch.Tensor:
    """The next token of each row: argmax, or a draw at `temp` from the top-p 0.95 nucleus."""
    if temp <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temp, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < 0.95  # the smallest set reaching 0.95
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    pick = torch.multinomial(sorted_p.cpu(), 1, generator=gen)[:, 0].to(logits.device)
    return order.gather(-1, pick[:, None])[:, 0]


def examples_from_captured(seqs: Sequences, draft_ids: torch.Tensor,
                           skip: int = 0) -> list[Example]:
    """Captured labels restricted to the draft vocabulary: each position's candidates that
    are draft tokens, renormalised by the draft vocabulary's mass among them, the likeliest
    `TOPK` kept (padded with zero-probability entries). `skip` as in `teacher_force`."""
    slot = torch.full((int(draft_ids.max()) + 1 if len(draft_ids) else 1,), -1,
                      dtype=torch.long)
    slot[draft_ids.long()] = torch.arange(len(draft_ids))
    out = []
    for tokens, cap in zip(seqs.tokens, seqs.captured or [], strict=True):
        n = len(tokens) - 1
        cut = skip if n - skip >= 8 else 0
        ids = cap.cand_ids[cut:n].long()
        inside = ids < len(slot)
        draft = torch.where(inside, slot[ids.clamp(max=len(slot) - 1)], -1)
        p = torch.where(draft >= 0, cap.cand_p[cut:n].float(), torch.zeros(()))
        mass = p.sum(-1, keepdim=True).clamp(min=1e-12)
        top = torch.topk(p / mass, min(TOPK, p.shape[-1]), dim=-1)  # sorted, best first
        top_ids = draft.gather(-1, top.indices).clamp(min=0)
        out.append(Example(torch.tensor(tokens[cut:n]), cap.features[cut:n],
                           top_ids, top.values.half(), cap.top1[cut:n].long()))
    return out


def text_chunks(backend, text: str, length: int = 256) -> list[list[int]]:
    """Local text as sequences of `length` tokens (the last one shorter, dropped if tiny)."""
    ids = backend.tokenizer.encode(text)
    return [ids[i : i + length] for i in range(0, len(ids), length)
            if len(ids[i : i + length]) >= 32]


def draft_vocab(seqs: Sequences, size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent token ids of the data (ascending), padded with the lowest
    unused ids when the data has fewer distinct tokens."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs.tokens:
        counts += torch.bincount(torch.tensor(s), minlength=vocab)[:vocab]
    size = min(size, vocab)
    order = torch.argsort(-counts, stable=True)[:size]
    return torch.sort(order).values


@torch.inference_mode()
def teacher_force(backend, seqs: Sequences, layers: tuple[int, ...],
                  draft_ids: torch.Tensor, max_len: int = 512, batch: int = 8,
                  skip: int = 0) -> list[Example]:
    """Verifier forwards over the sequences (similar lengths batched, right-padded: causal
    attention never lets a real position see the padding after it): hidden states and
    targets from the same pass. `skip`: the first positions (a prefix every sequence shares,
    such as a chat template's system prompt) are dropped from the examples; the verifier
    still reads them."""
    model = backend.model
    cols = draft_ids.to(backend.device)
    rows = [s[:max_len] for s in seqs.tokens]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    examples: list[Example | None] = [None] * len(rows)
    for b0 in range(0, len(order), batch):
        group = order[b0 : b0 + batch]
        width = max(len(rows[i]) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, : len(rows[i])] = torch.tensor(rows[i])
        out = model(input_ids=ids.to(backend.device), output_hidden_states=True)
        feats = torch.stack([out.hidden_states[i] for i in layers], dim=2)
        for r, i in enumerate(group):
            n = len(rows[i])
            cut = skip if n - skip >= 8 else 0
            logits = out.logits[r, cut:n].float()
            top1 = logits.argmax(-1)
            p = torch.softmax(logits[:, cols], dim=-1)
            top = torch.topk(p, min(TOPK, p.shape[-1]), dim=-1)
            examples[i] = Example(ids[r, cut:n].clone(), feats[r, cut:n].half().cpu(),
                                  top.indices.cpu(), top.values.half().cpu(), top1.cpu())
        if (b0 // batch + 1) % 16 == 0:
            log.info("teacher forcing: %d/%d sequences", b0 + len(group), len(rows))
    return examples  # type: ignore[return-value]
