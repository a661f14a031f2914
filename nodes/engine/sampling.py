"""Token selection: logits processing (temperature, top-k, top-p) and draft acceptance.

Greedy acceptance is exact argmax matching. Sampling draws the token at each position by the
Gumbel-max trick with noise that is a function of the request's seed and the position alone
(`position_noise`): token = argmax(log p + g(seed, position)), an exact draw from p. Acceptance
follows at once: a draft token is accepted exactly when it is that token, so the committed
text is a function of the seed, the positions and the verifier's distributions, never of which
drafts were proposed, by whom, in which batch or on which verifier after a failover (issue 24:
the same seeded request gave another text in 2 of 40 runs under rejection sampling, whose
random draws depended on the drafts). A deterministic drafter's token x is accepted with
probability p(x), as under rejection sampling with a point mass; a sampling drafter is accepted
as often as its draw meets the verifier's.

The settings are `codec.sampling.SamplingParams`, the type the wire, the CLI and the gateway
hold too (re-exported here, where the drafters import it); `check_sampling` is its one range
check, reported as the engine's own error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from codec.errors import BadRequest
from codec.sampling import SamplingParams
from nodes.engine.errors import BadRequestError

if TYPE_CHECKING:
    from nodes.engine.tree import TokenTree

__all__ = ["History", "SamplingParams", "accept_greedy", "adjust_logits", "accept_tree_greedy",
           "accept_tree_keyed", "accept_tree_masked", "choose", "check_sampling",
           "keyed_sample", "position_noise", "probs_from_logits", "sample"]


def check_sampling(params: SamplingParams) -> None:
    """`SamplingParams.check`, raising `BadRequestError` naming the field."""
    try:
        params.check()
    except BadRequest as exc:
        raise BadRequestError(f"{exc.field}: {exc.reason}", exc.field) from None


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rows of sampling probabilities (float64), processed like HF: temperature, top-k, then
    min-p and top-p (min-p keeps the tokens at least `min_p` times as likely as the most likely
    one: a prefix of the sorted order, so it commutes with top-p). Greedy choice is unchanged
    by all of them (each keeps the argmax). History-dependent controls come first, on the
    logits (`adjust_logits`)."""
    x = np.asarray(logits, dtype=np.float64)
    x = np.atleast_2d(x) / max(params.temperature, 1e-8)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if params.min_p:  # relative to the most likely token: the same set before or after top_p
        p = np.where(p < params.min_p * p.max(axis=-1, keepdims=True), 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a probability row (inverse CDF: cheap, deterministic per seed)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


def accept_greedy(logits: np.ndarray, drafts: np.ndarray) -> tuple[int, int]:
    """(number of drafts accepted, next token): longest argmax-matching prefix, then the fix."""
    targets = np.argmax(logits, axis=-1)
    k = len(drafts)
    mismatch = np.nonzero(targets[:k] != drafts)[0]
    n = int(mismatch[0]) if mismatch.size else k
    return n, int(targets[n])


def position_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """Gumbel(0, 1) noise over the vocabulary for one position of one seeded generation: a
    function of (seed, position) alone. Philox keyed by the seed; the position is the high
    half of its 256-bit counter, so positions never share draws."""
    gen = np.random.Generator(np.random.Philox(key=int(seed) % 2**64,
                                               counter=int(position) << 128))
    u = 1.0 - gen.random(vocab)  # (0, 1]
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(u))


def keyed_sample(p: np.ndarray, noise: np.ndarray) -> int:
    """The token Gumbel-max picks from probability row `p` with `noise`: an exact draw."""
    with np.errstate(divide="ignore"):
        return int(np.argmax(np.log(p) + noise))


def accept_tree_greedy(logits: np.ndarray, tree: TokenTree) -> tuple[list[int], int]:
    """(accepted path nodes, next token): follow the child equal to the argmax at its parent.

    Siblings are distinct tokens, so at most one child matches: this is the deepest path whose
    every token is the verifier's greedy choice, as a chain would find it.
    """
    targets = np.argmax(logits, axis=-1)
    node, path = 0, []
    while True:
        child = tree.children[node].get(int(targets[node]))
        if child is None:
            return path, int(targets[node])
        path.append(child)
        node = child


def accept_tree_keyed(
    logits: np.ndarray,
    tree: TokenTree,
    params: SamplingParams,
    noise_at: Callable[[int], np.ndarray],
) -> tuple[list[int], int]:
    """(accepted path nodes, next token) when sampling: at each node the verifier's token is
    the Gumbel-max draw with the noise of that node's position (`noise_at(depth)`, depth 0 the
    pending token's row); the child holding it is followed, else that token is the next one.
    Greedy acceptance over perturbed scores: the path is the one a plain run would sample."""
    rows = probs_from_logits(logits, params)
    node, path = 0, []
    while True:
        token = keyed_sample(rows[node], noise_at(tree.depths[node]))
        child = tree.children[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def choose(row: np.ndarray, params: SamplingParams, noise: Callable[[], np.ndarray]) -> int:
    """The verifier's token from one row of logits: its argmax (greedy), else the Gumbel-max
    draw from its processed distribution with the position's noise (`noise()`, made only when
    sampling)."""
    if params.greedy:
        return int(np.argmax(row))
    return keyed_sample(probs_from_logits(row, params)[0], noise())


def accept_tree_masked(
    logits: np.ndarray,
    tree: TokenTree,
    params: SamplingParams,
    noise_at: Callable[[int], np.ndarray],
    mask: Callable[[np.ndarray], tuple[np.ndarray, int | None]],
    advance: Callable[[int], None],
) -> tuple[list[int], int]:
    """`accept_tree_greedy` / `accept_tree_keyed` under a constraint: at each node walked, the
    row is masked first (`mask(row)`: the forbidden tokens at -inf, from the constraint's state
    after the path so far, and the greedy pick where the mask found it already), the
    verifier's token is chosen from the masked row (greedy: its argmax; sampling: the keyed
    draw from the masked, renormalised distribution), and the
    constraint advances by it (`advance`). The same token a plain constrained run picks at that
    position, so the text never depends on the drafts here either."""
    node, path = 0, []
    while True:
        row, token = mask(logits[node])
        logits[node] = row
        if token is None:
            depth = tree.depths[node]
            token = choose(row, params, lambda d=depth: noise_at(d))
        advance(token)
        child = tree.children[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


class History:
    """What the logit controls read at a position: the tokens seen (prompt and generated: the
    repetition penalty's) and how often each generated token occurred (presence and frequency
    penalties'). `add` follows a walk down a tree path; `copy` before walking."""

    __slots__ = ("counts", "seen")

    def __init__(self, prompt: list[int] | tuple[int, ...] = (),
                 generated: list[int] | tuple[int, ...] = ()) -> None:
        self.seen: set[int] = set(prompt)
        self.counts: dict[int, int] = {}
        for t in generated:
            self.add(t)

    def add(self, token: int) -> None:
        token = int(token)
        self.seen.add(token)
        self.counts[token] = self.counts.get(token, 0) + 1

    def copy(self) -> History:
        h = History()
        h.seen, h.counts = set(self.seen), dict(self.counts)
        return h


def adjust_logits(row: np.ndarray, params: SamplingParams, history: History) -> np.ndarray:
    """One position's logits under the history-dependent controls, as a new float64 row:
    HF's repetition penalty over every seen token (a positive logit divided by it, a negative
    one multiplied), then OpenAI's presence and frequency penalties over the generated tokens
    (`logit - presence * [count > 0] - frequency * count`), then `logit_bias` added. A function
    of the verifier's row and the history alone, so the verifier applying it at each position
    it checks keeps speculation lossless."""
    x = np.array(row, dtype=np.float64)
    width = x.shape[-1]
    rp = params.repetition_penalty
    if rp is not None and rp != 1.0 and history.seen:
        ids = np.fromiter((t for t in history.seen if t < width), dtype=np.int64)
        v = x[ids]
        x[ids] = np.where(v > 0, v / rp, v * rp)
    pres, freq = params.presence_penalty or 0.0, params.frequency_penalty or 0.0
    if (pres or freq) and history.counts:
        items = [(t, c) for t, c in history.counts.items() if t < width]
        ids = np.fromiter((t for t, _ in items), dtype=np.int64, count=len(items))
        counts = np.fromiter((c for _, c in items), dtype=np.float64, count=len(items))
        x[ids] -= pres + freq * counts
    if params.logit_bias:
        for t, b in params.logit_bias:
            if t < width:
                x[t] += b
    return x
