"""Log probabilities in the OpenAI shapes: chat `logprobs.content` and completions `logprobs`.

The verifier sends, per token, its own log probability and its N most likely alternatives'
(`token_chunk`, docs/protocol.md); this renders them with the gateway's tokenizer of the model
(token text and exact bytes: a byte-level token holding part of a character has no text of its
own, its bytes say what it is).
"""

from __future__ import annotations

from typing import Any

from codec.structs import MAX_TOP_LOGPROBS
from nodes.cluster_client.received_logprobs import ReceivedLogprobs

__all__ = ["MAX_CHAT_TOP", "MAX_COMPLETION_TOP", "ReceivedLogprobs", "chat_logprobs",
           "completion_logprobs"]

#: OpenAI's caps: chat `top_logprobs` 0..20 (the wire's own cap, declared there), completions
#: `logprobs` 0..5
MAX_CHAT_TOP = MAX_TOP_LOGPROBS
MAX_COMPLETION_TOP = 5


def _entry(tok, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tok.token_bytes([token_id])[0]
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
            "bytes": list(raw)}


def chat_logprobs(tok, lp: ReceivedLogprobs, top: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for i, token_id in enumerate(lp.ids):
        entry = _entry(tok, token_id, lp.logprobs[i])
        entry["top_logprobs"] = [_entry(tok, t, v) for t, v in
                                 zip(lp.top_ids[i][:top], lp.top_logprobs[i][:top],
                                     strict=True)]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(tok, lp: ReceivedLogprobs, top: int, offset: int = 0) -> dict[str, Any]:
    """`choices[i].logprobs` of a completion: tokens, their log probabilities, the top
    alternatives as {token: logprob}, and where each token starts in the text (from `offset`,
    the characters already sent)."""
    texts = [b.decode("utf-8", errors="replace") for b in tok.token_bytes(lp.ids)]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    tops = []
    for i in range(len(lp.ids)):
        row: dict[str, float] = {}
        for t, v in zip(lp.top_ids[i][:top], lp.top_logprobs[i][:top], strict=True):
            row.setdefault(tok.token_bytes([t])[0].decode("utf-8", errors="replace"), v)
        tops.append(row)
    return {"tokens": texts, "token_logprobs": list(lp.logprobs),
            "top_logprobs": tops if top else None, "text_offset": offsets}
