"""Typed errors for bad generation input, and the registry of node error codes on the wire.

Every error a user can cause by what they ask for (unknown model, mismatched drafter, empty
prompt, silly limits) is a `GenerationError`; anything else is a bug and may propagate. Each
class carries the stable `code` its `error` reply travels with; `NODE_ERROR_CODES` lists every
code a node (its roles or its bus) puts in an `error` reply besides the codec's own
(`codec.errors.ERROR_CODES`), and docs/protocol.md documents each (checked by a test).
"""

from __future__ import annotations

from codec.errors import ERROR_CODES


class GenerationError(ValueError):
    """Base of every user-caused generation error; `str(err)` is one readable line."""

    code = "generation_failed"


class ModelNotFoundError(GenerationError):
    """A model reference could not be resolved or loaded offline."""

    code = "model_not_found"


class TokenizerMismatchError(GenerationError):
    """A drafter's tokenizer differs from the verifier's, so its token ids mean other things."""

    code = "tokenizer_mismatch"


class BadRequestError(GenerationError):
    """Invalid generation parameters: empty prompt, non-positive max tokens, bad sampling knobs.

    `field` names the offending request field when there is one (e.g. `top_p`, `tokens`).
    """

    code = "bad_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TooLongError(BadRequestError):
    """The input (prompt, session context) is longer than this node accepts."""

    code = "too_long"


class OutOfSyncError(BadRequestError):
    """A verifier's delta does not continue what a draft session has (tokens were lost)."""

    code = "out_of_sync"


class UnknownSessionError(GenerationError):
    """No such draft session (expired, closed or never opened)."""

    code = "unknown_session"


class NoProposerError(GenerationError):
    """Drafting was forced with proposers that are not in the cluster (or not compatible)."""

    code = "no_proposer"


BUSY = "busy"
TOO_MANY_SESSIONS = "too_many_sessions"
RATE_LIMITED = "rate_limited"
FORBIDDEN = "forbidden"
INTERNAL = "internal"
UNSUPPORTED = "unsupported"

NODE_ERROR_CODES: dict[str, str] = {
    GenerationError.code: "the generation could not be done as asked (base; rarely alone)",
    BadRequestError.code: "a field's value is out of range or conflicts with another field; "
                          "the message names the field",
    TooLongError.code: "prompt or draft-session context longer than the node's `--max-context`",
    ModelNotFoundError.code: "a model reference could not be resolved",
    TokenizerMismatchError.code: "the drafter's tokenizer differs from the verifier's",
    OutOfSyncError.code: "a draft delta does not continue what the proposer's session has",
    UnknownSessionError.code: "no open draft session with that id (expired or never opened)",
    NoProposerError.code: "`draft: force` named proposers the verifier cannot use",
    BUSY: "the verifier's queue or the proposer's session table is full; retry later",
    TOO_MANY_SESSIONS: "this connection (or the proposer in total) has as many draft sessions "
                       "open as it may; close one or wait for a lease to end",
    RATE_LIMITED: "this connection sent more requests per second than the node admits; "
                  "everyone else is still served",
    FORBIDDEN: "the draft session belongs to another connection (sessions are bound to "
               "their opener)",
    INTERNAL: "the handler raised (a bug); the node keeps serving",
    UNSUPPORTED: "the node does not serve this message type",
}


def error_code(exc: BaseException) -> str:
    """The wire code of an exception: its registered `code`, else `internal`."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and (code in NODE_ERROR_CODES or code in ERROR_CODES):
        return code
    return INTERNAL
