"""Kind-level schemas: which fields and tensor frames a message type carries, and of what kind.

A schema lists required and optional fields with their kinds, and rules for the tensor frames;
`codec.messages` checks every message against its type's schema when encoding and decoding.
Unknown fields are kept and ignored (forward compatibility); a known field of the wrong kind is
an error. Kinds are deliberately few: what msgpack carries natively.

The schema of a type with a typed struct is derived from that struct's declaration
(`codec.structs`, `codec.declare`); only the types without one (the gossip channel's, which
discovery parses, and `blob`) are written out here, in `UNTYPED`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from codec.errors import BadDtype, BadField, BadShape, FrameCount, MissingField

PROTOCOL_VERSION = 2

# field kind -> predicate
INT = "int"
FLOAT = "float"
STR = "str"
BOOL = "bool"
MAP = "map"
LIST = "list"
STRS = "list[str]"
INTS = "list[int]"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**64


KIND_CHECKS = {
    INT: _is_int,
    FLOAT: lambda v: (isinstance(v, float) or _is_int(v)),
    STR: lambda v: isinstance(v, str),
    BOOL: lambda v: isinstance(v, bool),
    MAP: lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    LIST: lambda v: isinstance(v, list),
    STRS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    INTS: lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
}

TOKEN_DTYPES = ("int32", "int64")
ANY_DTYPE = ("int32", "int64", "float16", "bfloat16", "float32", "uint8", "bool")
ANY_NDIM = -1


@dataclass(frozen=True)
class TensorRule:
    """What one tensor frame position may hold: allowed dtypes and number of dims."""

    name: str
    dtypes: tuple[str, ...]
    ndim: int


@dataclass(frozen=True)
class Schema:
    type: str
    doc: str
    required: dict[str, str] = field(default_factory=dict)
    optional: dict[str, str] = field(default_factory=dict)
    tensors: tuple[TensorRule, ...] = ()
    min_tensors: int = 0

    def check_fields(self, fields: dict[str, Any]) -> None:
        for name, kind in self.required.items():
            if name not in fields:
                raise MissingField(f"{self.type} needs field {name!r}")
            if not KIND_CHECKS[kind](fields[name]):
                raise BadField(f"{self.type}.{name} must be {kind}, got {_describe(fields[name])}")
        for name, kind in self.optional.items():
            if name in fields and fields[name] is not None and not KIND_CHECKS[kind](fields[name]):
                raise BadField(f"{self.type}.{name} must be {kind}, got {_describe(fields[name])}")

    def check_tensors(self, specs: list[dict]) -> None:
        n = len(specs)
        if not self.min_tensors <= n <= len(self.tensors):
            want = (
                f"{self.min_tensors}"
                if self.min_tensors == len(self.tensors)
                else f"{self.min_tensors}..{len(self.tensors)}"
            )
            raise FrameCount(f"{self.type} carries {want} tensors, got {n}")
        for rule, spec in zip(self.tensors, specs, strict=False):
            if spec["dtype"] not in rule.dtypes:
                raise BadDtype(
                    f"{self.type} tensor {rule.name!r} must be {'/'.join(rule.dtypes)}, "
                    f"got {spec['dtype']}"
                )
            if rule.ndim != ANY_NDIM and len(spec["shape"]) != rule.ndim:
                raise BadShape(
                    f"{self.type} tensor {rule.name!r} must have {rule.ndim} dims, "
                    f"got shape {spec['shape']}"
                )


def _describe(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


UNTYPED: dict[str, Schema] = {
    s.type: s
    for s in [
        # -- gossip channel (PUB/SUB) ---------------------------------------------------
        Schema(
            "card",
            "A node's capability card, owned and versioned by that node.",
            required={"cluster": STR, "incarnation": INT, "version": INT,
                      "roles": STRS, "endpoints": MAP},
            optional={"name": STR, "backend": STR, "model": STR, "tokenizer": STR,
                      "vocab": INT, "tok_s": FLOAT, "load": FLOAT, "free_mem": INT,
                      "observer": BOOL, "extras": MAP},
        ),
        Schema(
            "heartbeat",
            "I am alive at this incarnation; my card is at this version.",
            required={"cluster": STR, "incarnation": INT, "version": INT},
            optional={"peers": LIST, "suspects": STRS},
        ),
        Schema(
            "leave",
            "Graceful shutdown: drop me now.",
            required={"cluster": STR, "incarnation": INT},
        ),
        Schema(
            "stats",
            "Telemetry, about once a second (never per token).",
            required={"cluster": STR, "incarnation": INT, "stats": MAP},
        ),
        # -- membership requests (DEALER/ROUTER), parsed by discovery -------------------------
        Schema("snapshot_req", "Ask a peer for every card it knows (late joiner); carries the "
               "asker's own card so the introduction is mutual.",
               required={"cluster": STR}, optional={"card": MAP}),
        Schema("snapshot", "Reply to snapshot_req: known cards with their states.",
               required={"cards": LIST}),
        Schema(
            "blob",
            "Opaque tensors of any dtype and rank (benchmarks, diagnostics).",
            optional={"note": STR},
            tensors=tuple(TensorRule(f"t{i}", ANY_DTYPE, ANY_NDIM) for i in range(4)),
        ),
    ]
}
