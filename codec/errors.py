"""One typed error family for everything that can be wrong with a message on the wire.

Decoding arbitrary bytes raises only `CodecError` (or a subclass), so a receive loop needs a
single `except CodecError` to survive hostile input. Each subclass carries a stable `code`
that travels in `error` replies.
"""

from __future__ import annotations


class CodecError(ValueError):
    """A message could not be encoded or decoded; `code` is stable and goes on the wire."""

    code = "bad_message"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{self.code}: {detail}")
        self.detail = detail


class BadHeader(CodecError):
    code = "bad_header"


class BadVersion(CodecError):
    code = "bad_version"


class UnknownType(CodecError):
    code = "unknown_type"


class MissingField(CodecError):
    code = "missing_field"


class BadField(CodecError):
    code = "bad_field"


class FrameCount(CodecError):
    code = "frame_count"


class ByteCount(CodecError):
    code = "byte_count"


class BadShape(CodecError):
    code = "bad_shape"


class BadDtype(CodecError):
    code = "bad_dtype"


class Oversize(CodecError):
    code = "oversize"


class BadRequest(CodecError):
    """A well-formed message whose field holds a value out of range or in conflict with another
    field; `field` names it (e.g. `top_p`, `messages[2].role`)."""

    code = "bad_request"

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.reason = detail


ERROR_CODES = tuple(
    cls.code
    for cls in (
        CodecError, BadHeader, BadVersion, UnknownType, MissingField, BadField,
        FrameCount, ByteCount, BadShape, BadDtype, Oversize, BadRequest,
    )
)
