"""Asking for a generation: the wire's own `GenerateReq`, built with the clients' defaults.

`GenerateRequest(prompt, max_tokens=..., ...)` is only a builder: it returns a
`codec.structs.GenerateReq`, checked there (a bad value raises its `BadRequest`, a ValueError
naming the field, before anything is sent), so no request type repeats the wire's fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from codec.sampling import SamplingParams
from codec.structs import DEFAULT_MAX_TOKENS, FORCE, GenerateReq


def GenerateRequest(  # noqa: N802 - reads as the request it builds, at many call sites
    prompt: str | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: SamplingParams | None = None, stop: Sequence[str] = (), chat: bool = True,
    speculate: bool = True, proposers: Sequence[str] | None = None, force_draft: bool = False,
    messages: Sequence[Mapping[str, str]] | None = None, tokens: Sequence[int] | None = None,
    grammar: Mapping[str, str] | None = None, resumed: int | None = None,
) -> GenerateReq:
    """A text `prompt`, or chat `messages`, or `tokens`. `force_draft` (with `proposers`)
    pins speculation: the verifier asks exactly those proposers every block with its full
    deadline, whatever it thinks of their speed (tests, demos). `grammar`: `{kind, text}`
    every generated token keeps matching (`nodes.engine.grammar.Constraint.to_wire`).
    `resumed` (with `tokens`): its last `resumed` ids were generated already (a resume: the
    cluster client's failover sets it itself)."""
    return GenerateReq(
        prompt=prompt, messages=None if messages is None else tuple(messages),
        tokens=None if tokens is None else np.asarray(tokens, dtype=np.int32),
        max_tokens=max_tokens, sampling=sampling or SamplingParams(), stop=tuple(stop),
        chat=chat, speculate=speculate,
        proposers=None if proposers is None else tuple(proposers),
        draft=FORCE if force_draft else None,
        grammar=None if grammar is None else dict(grammar), resumed=resumed,
    )
