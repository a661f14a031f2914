"""Node-level checks right after the typed parse, and the one wire <-> engine conversion.

`codec.structs` checks what any receiver can check (ranges, kinds, conflicts). What needs this
node's knowledge, the vocabulary size and the context it accepts, is checked here, on the I/O
thread before a request is queued, so an over-long or out-of-vocabulary input costs nothing.
A request's `GenerationParams` are made here; its sampling settings are the wire's own
`SamplingParams`, passed on as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from codec.errors import CodecError
from codec.messages import Message
from codec.structs import MAX_TOKENS_LIMIT, GenerateReq
from nodes.engine.core import GenerationParams
from nodes.engine.errors import BadRequestError, TooLongError, error_code
from nodes.engine.grammar import Constraint

#: context of a tokenizer-agnostic proposer (ngram) when none is configured
DEFAULT_MAX_CONTEXT = 8192


def generation_params(req: GenerateReq) -> GenerationParams:
    constraint = None if req.grammar is None else Constraint.from_wire(dict(req.grammar))
    return GenerationParams(max_tokens=req.max_tokens, sampling=req.sampling, stop=req.stop,
                            logprobs=req.logprobs, constraint=constraint,
                            resumed=req.resumed or 0)


def check_ids(field: str, ids: np.ndarray, vocab_size: int) -> None:
    """Token ids within the vocabulary (ids >= 0 is the codec's check)."""
    if vocab_size > 0 and len(ids) and int(ids.max()) >= vocab_size:
        raise BadRequestError(
            f"{field}: token id {int(ids.max())} outside the vocabulary ({vocab_size})", field)


def check_context(field: str, n: int, max_context: int, what: str = "tokens") -> None:
    if max_context > 0 and n > max_context:
        raise TooLongError(f"{field}: {n} {what}, this node accepts at most {max_context}",
                           field)


def admit_generate(msg: Message, vocab_size: int, max_context: int) -> GenerateReq:
    """Parse a `generate_req` and check it against this verifier (cheap; I/O thread).

    A token prompt is checked in full here; a text prompt or messages only once rendered
    (`check_prompt_ids`), still before any model work.
    """
    req = GenerateReq.from_message(msg)
    if req.max_tokens > MAX_TOKENS_LIMIT:
        raise BadRequestError(
            f"max_tokens: {req.max_tokens} over the limit {MAX_TOKENS_LIMIT}", "max_tokens")
    if max_context > 0 and req.max_tokens >= max_context:
        raise TooLongError(f"max_tokens: {req.max_tokens} does not fit the context "
                           f"({max_context})", "max_tokens")
    if req.tokens is not None:
        check_prompt_ids("tokens", req.tokens, req, vocab_size, max_context)
    for tok, _ in req.sampling.logit_bias or ():
        if vocab_size > 0 and tok >= vocab_size:
            raise BadRequestError(f"logit_bias: token id {tok} outside the vocabulary "
                                  f"({vocab_size})", "logit_bias")
    return req


def check_prompt_ids(field: str, ids: Any, req: GenerateReq, vocab_size: int,
                     max_context: int) -> None:
    """The prompt plus what is asked of it fits the context; ids are in the vocabulary."""
    n = len(ids)
    check_context(field, n + req.max_tokens, max_context,
                  f"tokens (prompt {n} + max_tokens {req.max_tokens})")
    check_ids(field, np.asarray(ids), vocab_size)


def wire_error(exc: BaseException) -> tuple[str, str]:
    """(code, message) of an input error for an `error` reply."""
    return error_code(exc), str(exc)[:300]


def model_context(backend: Any) -> int:
    """Positions the backend's model was trained for (its config), else the default."""
    for holder in (getattr(backend, "model", None), backend):
        cfg = getattr(holder, "config", None)
        n = getattr(cfg, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return DEFAULT_MAX_CONTEXT


#: what a role answers with a typed error instead of a traceback
INPUT_ERRORS = (CodecError, BadRequestError)
