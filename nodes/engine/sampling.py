"""Token selection: logits processing (temperature, top-k, top-p) and draft acceptance.

Greedy acceptance is exact argmax matching. Sampling uses speculative rejection sampling
(Leviathan et al. 2023 / Chen et al. 2023): accept draft d with probability min(1, p(d)/q(d)),
on rejection sample from norm(max(0, p - q)); a deterministic drafter is a point mass q. The
committed tokens are then distributed exactly as if the verifier sampled alone.

The settings are `codec.sampling.SamplingParams`, the type the wire, the CLI and the gateway
hold too (re-exported here, where the drafters import it); `check_sampling` is its one range
check, reported as the engine's own error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from codec.errors import BadRequest
from codec.sampling import SamplingParams
from nodes.engine.errors import BadRequestError

if TYPE_CHECKING:
    from nodes.engine.tree import TokenTree

__all__ = ["SamplingParams", "accept_greedy", "accept_sampling", "accept_tree_greedy",
           "accept_tree_sampling", "check_sampling", "probs_from_logits", "sample"]


def check_sampling(params: SamplingParams) -> None:
    """`SamplingParams.check`, raising `BadRequestError` naming the field."""
    try:
        params.check()
    except BadRequest as exc:
        raise BadRequestError(f"{exc.field}: {exc.reason}", exc.field) from None


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rows of sampling probabilities (float64), processed like HF: temperature, top-k, top-p."""
    x = np.asarray(logits, dtype=np.float64)
    x = np.atleast_2d(x) / max(params.temperature, 1e-8)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
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


def accept_sampling(
    logits: np.ndarray,
    drafts: np.ndarray,
    draft_probs: np.ndarray | None,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """(number of drafts accepted, next token) by rejection sampling against the drafter's q."""
    p_rows = probs_from_logits(logits, params)
    for i, d in enumerate(drafts):
        d = int(d)
        p = p_rows[i]
        if draft_probs is None:
            q_d = 1.0
        else:
            q_row = np.asarray(draft_probs[i], dtype=np.float64)
            q_d = float(q_row[d])
        if q_d > 0 and rng.random() < min(1.0, p[d] / q_d):
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q_row / max(q_row.sum(), 1e-30), 0.0)
        if residual.sum() <= 0:
            residual = p
        return i, sample(residual / residual.sum(), rng)
    return len(drafts), sample(p_rows[len(drafts)], rng)


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


def accept_tree_sampling(
    logits: np.ndarray,
    tree: TokenTree,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """(accepted path nodes, next token) by recursive rejection over siblings (SpecInfer).

    At a node with target p, each proposal (x, q) in turn is accepted with min(1, p(x)/q(x));
    on rejection p becomes norm(max(0, p - q)) (a point mass q removes x) and the next proposal
    is tried against that residual. When all fail, the next token is drawn from the residual.
    Each proposal was drawn independently of the earlier ones' fate, so by the single-draft
    argument applied step by step the output is distributed exactly as p. A chain (one trial
    per node) is exactly `accept_sampling`, random draws included.
    """
    rows = probs_from_logits(logits, params)
    node, path = 0, []
    while True:
        p = rows[node]
        for child, q_row in tree.trials[node]:
            x = tree.tokens[child]
            q_x = 1.0 if q_row is None else float(q_row[x])
            if q_x > 0 and rng.random() < min(1.0, p[x] / q_x):
                path.append(child)
                node = child
                break
            if q_row is None:
                residual = p.copy()
                residual[x] = 0.0
            else:
                q = np.asarray(q_row, dtype=np.float64)
                residual = np.maximum(p - q / max(q.sum(), 1e-30), 0.0)
            if residual.sum() > 0:  # else p == q up to rounding: keep p
                p = residual / residual.sum()
        else:
            return path, sample(p, rng)
