"""Log probabilities of committed tokens, from the verifier's own rows.

Every committed token was checked against (or drawn from) one row of the verifier's logits:
the row of the position before it, computed in the same forward that verified it. Its log
probability is taken from that row, so it is exact whichever drafts were proposed or accepted:
a speculative run reports the same figures as a plain one. The distribution is the model's
raw one (log-softmax of the logits, before temperature, top-p and top-k), as vLLM reports by
default; it says how likely the model found each token, not how it was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from codec.structs import MAX_TOP_LOGPROBS  # the wire's bound is the engine's

__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprobs", "token_logprobs"]


@dataclass(frozen=True)
class TokenLogprobs:
    """Per committed token: its log probability, and the `top` most likely tokens there with
    theirs (most likely first)."""

    logprobs: np.ndarray  # float32 [n]
    top_ids: np.ndarray  # int32 [n, top]
    top_logprobs: np.ndarray  # float32 [n, top]

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, n: int) -> TokenLogprobs:
        """The first `n` tokens' (a stop rule cut the block)."""
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int) -> TokenLogprobs:
    """`rows[i]` (logits, [n, vocab]) is the distribution `tokens[i]` was chosen from."""
    rows = np.asarray(rows, dtype=np.float64).reshape(len(tokens), -1)
    peak = rows.max(axis=1, keepdims=True)
    logz = peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))
    logp = rows - logz
    chosen = logp[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)]
    if top > 0:
        ids = np.argpartition(-logp, top - 1, axis=1)[:, :top] if top < logp.shape[1] else \
            np.tile(np.arange(logp.shape[1]), (len(tokens), 1))
        vals = np.take_along_axis(logp, ids, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        ids, vals = np.take_along_axis(ids, order, 1), np.take_along_axis(vals, order, 1)
    else:
        ids, vals = np.zeros((len(tokens), 0), np.int64), np.zeros((len(tokens), 0))
    return TokenLogprobs(np.minimum(chosen, 0.0).astype(np.float32), ids.astype(np.int32),
                         np.minimum(vals, 0.0).astype(np.float32))
