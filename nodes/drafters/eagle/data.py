"""Training data for a head, made here from the verifier itself (nothing downloaded).

1. Responses: the verifier answers a built-in list of varied prompts in batches, greedy and
   sampled; prompt + response is one sequence. Local text, when given, is cut into chunks that
   are sequences as they are (teacher forcing labels them with the verifier's distributions
   whatever the text: generating is ~10x dearer per token than teacher forcing on a CPU).
2. Draft vocabulary: the most frequent tokens of those sequences (what the verifier says).
3. Teacher forcing: each sequence goes once through the verifier, which gives, from the same
   pass, the three hidden states the head reads and the verifier's next-token distribution at
   every position, kept as its top `TOPK` entries over the draft vocabulary (renormalised
   there) and its full-vocabulary argmax (for top-1 accuracy).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TOPK = 16  # soft-target entries kept per position

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
class Sequences:
    """Token sequences (prompt + response) before teacher forcing."""

    tokens: list[list[int]]


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
                   done: list[list[int]] | None = None, deadline: float | None = None,
                   on_batch=None) -> Sequences:
    """The verifier's own answers to `prompts` (chat template), generated in left-padded
    batches. Default: every prompt once per temperature (sequence k answers prompt
    k % len(prompts)). `cycle`: every prompt once, batch b at temperature
    temperatures[b % len(temperatures)] (sequence k answers prompt k).
    `done`: sequences already made (resume: generation goes on after them); `deadline`
    (time.monotonic()): no new batch starts after it; `on_batch(seqs)` after every batch."""
    torch.manual_seed(seed)
    tok = backend.tokenizer
    inputs = [tok.encode(p, chat=tok.has_chat_template) for p in prompts]
    eos = sorted(tok.eos_token_ids)
    pad = eos[0] if eos else 0
    if cycle:
        jobs = [(k, temperatures[(k // batch) % len(temperatures)]) for k in range(len(inputs))]
    else:
        jobs = [(k, t) for t in temperatures for k in range(len(inputs))]
    out: list[list[int]] = list(done or [])
    while len(out) < len(jobs):
        if deadline is not None and time.monotonic() >= deadline:
            log.info("responses: time is up after %d sequences", len(out))
            break
        start = len(out)
        temp = jobs[start][1]
        chunk = []
        for k, t in jobs[start : start + batch]:
            if t != temp:
                break
            chunk.append(inputs[k])
        torch.manual_seed(seed * 1_000_003 + start)
        out += _generate(backend, chunk, max_new, temp, pad, eos)
        log.info("responses: %d sequences (temperature %.1f)", len(out), temp)
        if on_batch is not None:
            on_batch(out)
    return Sequences(out)


@torch.inference_mode()
def _generate(backend, chunk: list[list[int]], max_new: int, temp: float, pad: int,
              eos: list[int]) -> list[list[int]]:
    width = max(len(c) for c in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(chunk):
        ids[i, width - len(c) :] = torch.tensor(c)
        mask[i, width - len(c) :] = 1
    kwargs = dict(do_sample=True, temperature=temp, top_p=0.95, top_k=0) if temp > 0 else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)
    gen = backend.model.generate(ids.to(backend.device), attention_mask=mask.to(backend.device),
                                 max_new_tokens=max_new, eos_token_id=eos or None,
                                 pad_token_id=pad, **kwargs)
    seqs = []
    for i, c in enumerate(chunk):
        new = gen[i, width:].tolist()
        for j, t in enumerate(new):
            if t in eos:
                new = new[: j + 1]
                break
        seqs.append(list(c) + new)
    return seqs


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
