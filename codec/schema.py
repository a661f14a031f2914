"""Message schemas: which fields and tensor frames each message type carries.

A schema lists required and optional fields with their kinds, and rules for the tensor frames.
Unknown fields are kept and ignored (forward compatibility); a known field of the wrong kind is
an error. Kinds are deliberately few: what msgpack carries natively.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from codec.errors import BadDtype, BadField, BadShape, FrameCount, MissingField

PROTOCOL_VERSION = 2

# field kind -> predicate
_INT = "int"
_FLOAT = "float"
_STR = "str"
_BOOL = "bool"
_MAP = "map"
_LIST = "list"
_STRS = "list[str]"
_INTS = "list[int]"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**64


KIND_CHECKS = {
    _INT: _is_int,
    _FLOAT: lambda v: (isinstance(v, float) or _is_int(v)),
    _STR: lambda v: isinstance(v, str),
    _BOOL: lambda v: isinstance(v, bool),
    _MAP: lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    _LIST: lambda v: isinstance(v, list),
    _STRS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    _INTS: lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
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


_TOKENS = TensorRule("tokens", TOKEN_DTYPES, 1)
_CONF = ("float32", "float16")  # draft probabilities of single tokens (no bfloat16 bits)
_SAMPLING = {"temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT, "seed": _INT}

SCHEMAS: dict[str, Schema] = {
    s.type: s
    for s in [
        # -- gossip channel (PUB/SUB) ---------------------------------------------------
        Schema(
            "card",
            "A node's capability card, owned and versioned by that node.",
            required={"cluster": _STR, "incarnation": _INT, "version": _INT,
                      "roles": _STRS, "endpoints": _MAP},
            optional={"name": _STR, "backend": _STR, "model": _STR, "tokenizer": _STR,
                      "vocab": _INT, "tok_s": _FLOAT, "load": _FLOAT, "free_mem": _INT,
                      "observer": _BOOL, "extras": _MAP},
        ),
        Schema(
            "heartbeat",
            "I am alive at this incarnation; my card is at this version.",
            required={"cluster": _STR, "incarnation": _INT, "version": _INT},
            optional={"peers": _LIST, "suspects": _STRS},
        ),
        Schema(
            "leave",
            "Graceful shutdown: drop me now.",
            required={"cluster": _STR, "incarnation": _INT},
        ),
        Schema(
            "stats",
            "Telemetry, about once a second (never per token).",
            required={"cluster": _STR, "incarnation": _INT, "stats": _MAP},
        ),
        # -- request streams (DEALER/ROUTER) ----------------------------------------------
        Schema("snapshot_req", "Ask a peer for every card it knows (late joiner); carries the "
               "asker's own card so the introduction is mutual.",
               required={"cluster": _STR}, optional={"card": _MAP}),
        Schema("snapshot", "Reply to snapshot_req: known cards with their states.",
               required={"cards": _LIST}),
        Schema("ping", "Round-trip probe.", optional={"payload": _STR}),
        Schema("pong", "Reply to ping.", optional={"payload": _STR}),
        Schema("cancel", "Cancel the in-flight request whose id is in the header `rid`."),
        Schema(
            "session_open",
            "Open a draft session on a proposer with the prompt tokens; the proposer answers "
            "with a stream of draft_chunk replies (more=true) until the session ends.",
            required={"lease_s": _FLOAT},
            optional={"tokenizer": _STR, "sampling": _MAP, "drafter": _STR, "horizon": _INT},
            tensors=(_TOKENS,),
            min_tensors=1,
        ),
        Schema(
            "session_extend",
            "Tokens committed since the last message; `committed` is the total after them. "
            "Pushed by the verifier after every step; `horizon` updates how far to draft ahead.",
            required={"committed": _INT},
            optional={"horizon": _INT},
            tensors=(_TOKENS,),
            min_tensors=1,
        ),
        Schema(
            "draft_chunk",
            "Streamed reply to session_open: the proposer's draft past committed length `base`, "
            "its assumed (earlier drafted) tokens first; the verifier uses what extends its "
            "committed prefix. Optional alternatives make it a tree: alt_tokens hang under "
            "alt_parents (-1: the base, i < n: chain token i, n + j: alternative j); conf and "
            "alt_conf are the drafter's probability of each token.",
            required={"base": _INT},
            optional={"chunk": _INT},
            tensors=(_TOKENS, TensorRule("alt_tokens", TOKEN_DTYPES, 1),
                     TensorRule("alt_parents", ("int32", "int64"), 1),
                     TensorRule("conf", _CONF, 1), TensorRule("alt_conf", _CONF, 1)),
            min_tensors=1,
        ),
        Schema("session_close", "Close a draft session now (otherwise its lease expires)."),
        Schema(
            "generate_req",
            "Generate from a text prompt (or chat messages, or token ids).",
            optional={"prompt": _STR, "messages": _LIST, "max_tokens": _INT, "stop": _STRS,
                      "chat": _BOOL, "speculate": _BOOL, "proposers": _STRS, "draft": _STR,
                      **_SAMPLING},
            tensors=(_TOKENS,),
        ),
        Schema(
            "token_chunk",
            "Tokens committed by the verifier, streamed as they come.",
            required={"index": _INT},
            optional={"text": _STR},
            tensors=(_TOKENS,),
            min_tensors=1,
        ),
        Schema(
            "done",
            "Generation finished; final figures.",
            required={"finish_reason": _STR},
            optional={"text": _STR, "stats": _MAP},
        ),
        Schema(
            "blob",
            "Opaque tensors of any dtype and rank (benchmarks, diagnostics).",
            optional={"note": _STR},
            tensors=tuple(TensorRule(f"t{i}", ANY_DTYPE, ANY_NDIM) for i in range(4)),
        ),
        # -- shared suffix index (gossip topic specbus-suffix/<cluster>/, and a request) ----
        Schema(
            "suffix_pub",
            "A verifier's finished generation for the cluster's suffix drafters: its token ids, "
            "the prompt first only when the verifier shares prompts (`output_start` is where "
            "the output begins; 0 when only the output is sent). `tokenizer` is the "
            "verifier's fingerprint: ids mean something only for the same tokenizer.",
            required={"cluster": _STR, "tokenizer": _STR, "output_start": _INT},
            tensors=(_TOKENS,),
            min_tensors=1,
        ),
        Schema("suffix_snapshot_req", "Ask a verifier for what it published lately (a suffix "
               "proposer that joined late starts warm).", required={"cluster": _STR}),
        Schema(
            "suffix_snapshot",
            "Reply to suffix_snapshot_req: recent publications, their tokens concatenated, "
            "with each one's length and output start.",
            required={"tokenizer": _STR},
            tensors=(_TOKENS, TensorRule("lengths", TOKEN_DTYPES, 1),
                     TensorRule("starts", TOKEN_DTYPES, 1)),
            min_tensors=3,
        ),
        Schema(
            "error",
            "A typed error reply; `code` is one of the codec error codes or a node error code.",
            required={"code": _STR, "message": _STR},
        ),
    ]
}
