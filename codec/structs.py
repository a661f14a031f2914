"""Typed, validated, frozen objects for the request-stream messages: one class per type.

`codec.messages.decode` checks kinds (an int is an int); these classes check values (a `top_p`
is in (0, 1], a token tensor is 1-D with non-negative ids, a prompt and a token tensor are not
both given) and give every field its one default. Each class has `from_message(Message)` (the
one place a received message's fields are read) and `to_message()` (the one place a message of
that type is built). A bad value raises `codec.errors.BadRequest` naming the field.

Limits that need node knowledge (vocabulary size, model context) are checked by the node right
after this parse (`nodes/roles/requests.py`). Gossip types (`card`, `heartbeat`, ...) are parsed
by discovery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from codec.errors import BadRequest, UnknownType
from codec.messages import Message, make

DEFAULT_MAX_TOKENS = 128
MAX_TOKENS = 1 << 20  # absurd beyond this whatever the model; nodes apply their context too
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 24
MAX_SEED = 2**63 - 1
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 256
MAX_PROPOSERS = 64
MAX_LEASE_S = 300.0
MAX_HORIZON = 256  # tokens a proposer may draft past the last commit it knows
MAX_ALTERNATIVES = 128  # alternative tokens one draft chunk may carry beside its chain
MAX_TOKEN_ID = 2**31 - 1
MAX_COMMITTED = 2**31 - 1
CHAT_ROLES = ("system", "user", "assistant")
FORCE = "force"

EMPTY_TOKENS = np.zeros(0, dtype=np.int32)


# -- field checks (each names the field it checks) ------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if not _is_int(v):
        raise BadRequest(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= int(v) <= hi:
        raise BadRequest(name, f"must be in {lo}..{hi}, got {int(v)}")
    return int(v)


def _float(name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
        raise BadRequest(name, f"must be a number, got {type(v).__name__}")
    x = float(v)
    if not math.isfinite(x):
        raise BadRequest(name, f"must be finite, got {x}")
    if x < lo or x > hi or (lo_open and x == lo):
        left = "(" if lo_open else "["
        raise BadRequest(name, f"must be in {left}{lo:g}, {hi:g}], got {x:g}")
    return x


def _str(name: str, v: Any, *, allow_empty: bool = True) -> str:
    if not isinstance(v, str):
        raise BadRequest(name, f"must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise BadRequest(name, f"empty {name}: must hold some text")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 (so no msgpack str) can carry it
        raise BadRequest(name, "holds a lone UTF-16 surrogate, not a character") from None
    return v


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(name, f"must be true or false, got {type(v).__name__}")
    return v


def _opt(fields: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """A field's value, `default` when absent or nil (nil means "not given" on the wire)."""
    v = fields.get(name)
    return default if v is None else v


def _probabilities(name: str, v: Any, n: int) -> np.ndarray:
    """A 1-D float array of n probabilities, each finite and in [0, 1]."""
    arr = np.asarray(v)
    if arr.ndim != 1 or len(arr) != n or (n and arr.dtype.kind != "f"):
        raise BadRequest(name, f"must be {n} probabilities, got shape {list(arr.shape)} "
                         f"{arr.dtype}")
    arr = arr.astype(np.float32)
    if n and not np.all((arr >= 0) & (arr <= 1)):  # NaN fails too
        raise BadRequest(name, "every probability must be in [0, 1]")
    return arr


def tokens_1d(name: str, t: Any, *, allow_empty: bool = True) -> np.ndarray:
    """A 1-D array of token ids >= 0 (upper bound: the node's vocabulary, checked there)."""
    arr = np.asarray(t)
    if arr.ndim != 1:
        raise BadRequest(name, f"must be a 1-D token tensor, got shape {list(arr.shape)}")
    if len(arr) == 0:
        if not allow_empty:
            raise BadRequest(name, "must hold at least one token id")
        return EMPTY_TOKENS
    if arr.dtype.kind not in "iu":
        raise BadRequest(name, f"must hold integer token ids, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > MAX_TOKEN_ID:
        raise BadRequest(name, f"token id {lo if lo < 0 else hi} is not a valid id")
    return arr


def _tensor(msg: Message, i: int) -> np.ndarray | None:
    return msg.tensors[i] if len(msg.tensors) > i else None


def _expect(msg: Message, type_: str) -> None:
    if msg.type != type_:
        raise UnknownType(f"expected a {type_} message, got {msg.type!r}")


# -- shared parts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampling:
    """Sampling knobs as they travel: temperature 0 is greedy; top_k 0 and top_p 1 are "off"."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        _float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _int("top_k", self.top_k, 0, MAX_TOP_K)
        if self.seed is not None:
            _int("seed", self.seed, 0, MAX_SEED)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], prefix: str = "") -> Sampling:
        try:
            return cls(
                temperature=_opt(fields, "temperature", 0.0), top_p=_opt(fields, "top_p", 1.0),
                top_k=_opt(fields, "top_k", 0), seed=fields.get("seed"),
            )
        except BadRequest as exc:
            if not prefix:
                raise
            raise BadRequest(prefix + exc.field, exc.reason) from None

    def to_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": float(self.temperature),
                               "top_p": float(self.top_p), "top_k": int(self.top_k)}
        if self.seed is not None:
            out["seed"] = int(self.seed)
        return out


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise BadRequest("role", f"must be one of {'/'.join(CHAT_ROLES)}, got {self.role!r}")
        _str("content", self.content)

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def chat_messages(name: str, v: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(v, list | tuple):
        raise BadRequest(name, f"must be a list of {{role, content}} maps, got {type(v).__name__}")
    if not 1 <= len(v) <= MAX_MESSAGES:
        raise BadRequest(name, f"must hold 1..{MAX_MESSAGES} messages, got {len(v)}")
    out = []
    for i, m in enumerate(v):
        where = f"{name}[{i}]"
        if isinstance(m, ChatMessage):
            out.append(m)
            continue
        if not isinstance(m, Mapping):
            raise BadRequest(where, f"must be a {{role, content}} map, got {type(m).__name__}")
        try:
            out.append(ChatMessage(_str("role", m.get("role")), _str("content", m.get("content"))))
        except BadRequest as exc:
            raise BadRequest(f"{where}.{exc.field}", exc.reason) from None
    return tuple(out)


# -- generation ------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class GenerateReq:
    """What to generate from (exactly one of prompt, messages, tokens) and how."""

    TYPE: ClassVar[str] = "generate_req"

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tokens: np.ndarray | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    chat: bool = True
    speculate: bool = True
    proposers: tuple[str, ...] | None = None
    #: "force": ask exactly `proposers` every block, with the full deadline, never judged slow
    draft: str | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("prompt", "messages", "tokens") if getattr(self, n) is not None]
        if len(given) > 1:
            raise BadRequest(given[1], f"give one of prompt, messages or tokens, not {given}")
        if not given:
            raise BadRequest("prompt", "needs a prompt, messages or a token tensor")
        if self.prompt is not None:
            _str("prompt", self.prompt, allow_empty=False)
        if self.messages is not None:
            object.__setattr__(self, "messages", chat_messages("messages", self.messages))
        if self.tokens is not None:
            object.__setattr__(self, "tokens",
                               tokens_1d("tokens", self.tokens, allow_empty=False))
        if _is_int(self.max_tokens) and self.max_tokens <= 0:
            raise BadRequest("max_tokens", f"max tokens must be a positive integer, "
                             f"got {self.max_tokens}")
        _int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        if not isinstance(self.sampling, Sampling):
            raise BadRequest("sampling", "must be a Sampling")
        if not isinstance(self.stop, list | tuple) or len(self.stop) > MAX_STOPS:
            raise BadRequest("stop", f"must be a list of at most {MAX_STOPS} strings")
        for i, s in enumerate(self.stop):
            _str(f"stop[{i}]", s)
            if not s or len(s) > MAX_STOP_CHARS:
                raise BadRequest(f"stop[{i}]", f"must have 1..{MAX_STOP_CHARS} characters")
        object.__setattr__(self, "stop", tuple(self.stop))
        _bool("chat", self.chat)
        _bool("speculate", self.speculate)
        if self.proposers is not None:
            if (not isinstance(self.proposers, list | tuple)
                    or len(self.proposers) > MAX_PROPOSERS):
                raise BadRequest("proposers", f"must be a list of at most {MAX_PROPOSERS} names")
            for i, p in enumerate(self.proposers):
                _str(f"proposers[{i}]", p, allow_empty=False)
            object.__setattr__(self, "proposers", tuple(self.proposers))
        if self.draft is not None:
            if self.draft != FORCE:
                raise BadRequest("draft", f"must be {FORCE!r} or absent, got {self.draft!r}")
            if not self.speculate:
                raise BadRequest("draft", "draft='force' contradicts speculate=false")
            if not self.proposers:
                raise BadRequest("proposers", "draft='force' needs the proposers to ask")

    @property
    def force_draft(self) -> bool:
        return self.draft == FORCE

    @classmethod
    def from_message(cls, msg: Message) -> GenerateReq:
        _expect(msg, cls.TYPE)
        f = msg.fields
        if len(msg.tensors) > 1:
            raise BadRequest("tokens", f"at most one token tensor, got {len(msg.tensors)}")
        return cls(
            prompt=f.get("prompt"), messages=f.get("messages"), tokens=_tensor(msg, 0),
            max_tokens=_opt(f, "max_tokens", DEFAULT_MAX_TOKENS),
            sampling=Sampling.from_fields(f), stop=_opt(f, "stop", ()),
            chat=_opt(f, "chat", True), speculate=_opt(f, "speculate", True),
            proposers=f.get("proposers"), draft=f.get("draft"),
        )

    def to_message(self, **envelope: Any) -> Message:
        fields: dict[str, Any] = {"max_tokens": self.max_tokens, **self.sampling.to_fields(),
                                  "stop": list(self.stop), "chat": self.chat,
                                  "speculate": self.speculate}
        if self.prompt is not None:
            fields["prompt"] = self.prompt
        if self.messages is not None:
            fields["messages"] = [m.as_dict() for m in self.messages]
        if self.proposers is not None:
            fields["proposers"] = list(self.proposers)
        if self.draft is not None:
            fields["draft"] = self.draft
        tensors = [] if self.tokens is None else [self.tokens]
        return make(self.TYPE, tensors=tensors, **envelope, **fields)


@dataclass(frozen=True, eq=False)
class TokenChunk:
    TYPE: ClassVar[str] = "token_chunk"

    index: int
    tokens: np.ndarray
    text: str = ""

    @classmethod
    def from_message(cls, msg: Message) -> TokenChunk:
        _expect(msg, cls.TYPE)
        return cls(_int("index", msg["index"], 0, MAX_COMMITTED),
                   tokens_1d("tokens", msg.tensors[0]), _str("text", _opt(msg.fields, "text", "")))

    def to_message(self, **envelope: Any) -> Message:
        return make(self.TYPE, tensors=[np.asarray(self.tokens, dtype=np.int32)],
                    index=self.index, text=self.text, **envelope)


@dataclass(frozen=True)
class Done:
    TYPE: ClassVar[str] = "done"

    finish_reason: str
    text: str | None = None
    stats: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_message(cls, msg: Message) -> Done:
        _expect(msg, cls.TYPE)
        return cls(_str("finish_reason", msg["finish_reason"]), msg.get("text"),
                   dict(_opt(msg.fields, "stats", {})))

    def to_message(self, **envelope: Any) -> Message:
        fields: dict[str, Any] = {"finish_reason": self.finish_reason}
        if self.text is not None:
            fields["text"] = self.text
        if self.stats:
            fields["stats"] = dict(self.stats)
        return make(self.TYPE, **envelope, **fields)


@dataclass(frozen=True)
class ErrorReply:
    TYPE: ClassVar[str] = "error"

    code: str
    message: str

    @classmethod
    def from_message(cls, msg: Message) -> ErrorReply:
        _expect(msg, cls.TYPE)
        return cls(_str("code", msg["code"]), _str("message", msg["message"]))

    def to_message(self, **envelope: Any) -> Message:
        return make(self.TYPE, code=self.code, message=self.message, **envelope)


# -- draft sessions --------------------------------------------------------------------------------
def _session(msg: Message) -> str:
    if not msg.session:
        raise BadRequest("sid", f"{msg.type} needs a session id (header 'sid')")
    return msg.session


@dataclass(frozen=True, eq=False)
class SessionOpen:
    TYPE: ClassVar[str] = "session_open"

    session: str
    tokens: np.ndarray
    lease_s: float
    sampling: Sampling = Sampling()
    tokenizer: str | None = None
    drafter: str | None = None
    horizon: int | None = None  # draft at most this many tokens past the last known commit

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tokens_1d("tokens", self.tokens, allow_empty=False))
        _float("lease_s", self.lease_s, 0.0, MAX_LEASE_S, lo_open=True)
        if self.horizon is not None:
            _int("horizon", self.horizon, 0, MAX_HORIZON)

    @classmethod
    def from_message(cls, msg: Message) -> SessionOpen:
        _expect(msg, cls.TYPE)
        sid = _session(msg)
        tokens = _tensor(msg, 0)
        if tokens is None:
            raise BadRequest("tokens", "session_open needs the prompt tokens")
        return cls(sid, tokens, msg["lease_s"],
                   Sampling.from_fields(_opt(msg.fields, "sampling", {}), prefix="sampling."),
                   msg.get("tokenizer"), msg.get("drafter"), msg.get("horizon"))

    def to_message(self, **envelope: Any) -> Message:
        fields: dict[str, Any] = {"lease_s": float(self.lease_s),
                                  "sampling": self.sampling.to_fields()}
        if self.tokenizer is not None:
            fields["tokenizer"] = self.tokenizer
        if self.drafter is not None:
            fields["drafter"] = self.drafter
        if self.horizon is not None:
            fields["horizon"] = self.horizon
        return make(self.TYPE, session=self.session,
                    tensors=[np.ascontiguousarray(self.tokens, dtype=np.int32)],
                    **envelope, **fields)


@dataclass(frozen=True, eq=False)
class SessionExtend:
    TYPE: ClassVar[str] = "session_extend"

    session: str
    tokens: np.ndarray
    committed: int
    horizon: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tokens_1d("tokens", self.tokens))
        _int("committed", self.committed, len(self.tokens), MAX_COMMITTED)
        if self.horizon is not None:
            _int("horizon", self.horizon, 0, MAX_HORIZON)

    @classmethod
    def from_message(cls, msg: Message) -> SessionExtend:
        _expect(msg, cls.TYPE)
        return cls(_session(msg), _tensor(msg, 0), msg["committed"], msg.get("horizon"))

    def to_message(self, **envelope: Any) -> Message:
        fields: dict[str, Any] = {"committed": self.committed}
        if self.horizon is not None:
            fields["horizon"] = self.horizon
        return make(self.TYPE, session=self.session,
                    tensors=[np.ascontiguousarray(self.tokens, dtype=np.int32)],
                    **envelope, **fields)


@dataclass(frozen=True, eq=False)
class DraftChunk:
    """Protocol 2: a streamed draft, tagged with what it extends.

    `tokens` continue the committed prefix of length `base` (the last commit the proposer
    knows): first the tokens it assumed (its own earlier drafts, not yet confirmed), then new
    ones. The verifier checks the assumed part against what it committed since `base`.
    """

    TYPE: ClassVar[str] = "draft_chunk"

    session: str
    base: int
    tokens: np.ndarray
    chunk: int = 0  # chunks streamed in this session so far, this one included
    #: alternatives (a model drafter's runners-up, the n-gram index's other continuations):
    #: alt_tokens[j] hangs under alt_parents[j]: -1 the base, i < n chain token i, n + j' an
    #: earlier alternative j' < j. Empty: the chunk is a chain.
    alt_tokens: np.ndarray = field(default_factory=lambda: EMPTY_TOKENS)
    alt_parents: np.ndarray = field(default_factory=lambda: EMPTY_TOKENS)
    #: the drafter's probability of each chain token / alternative given its parent; both or
    #: neither (drafters without probabilities, like n-grams, send neither)
    conf: np.ndarray | None = None
    alt_conf: np.ndarray | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tokens_1d("tokens", self.tokens))
        _int("base", self.base, 0, MAX_COMMITTED)
        _int("chunk", self.chunk, 0, 2**62)
        n = len(self.tokens)
        if n > MAX_HORIZON:
            raise BadRequest("tokens", f"a draft chunk carries at most {MAX_HORIZON} tokens, "
                             f"got {n}")
        alts = tokens_1d("alt_tokens", self.alt_tokens)
        object.__setattr__(self, "alt_tokens", alts)
        m = len(alts)
        if m > MAX_ALTERNATIVES:
            raise BadRequest("alt_tokens", f"a draft chunk carries at most {MAX_ALTERNATIVES} "
                             f"alternatives, got {m}")
        parents = np.asarray(self.alt_parents)
        if parents.ndim != 1 or len(parents) != m or (m and parents.dtype.kind not in "iu"):
            raise BadRequest("alt_parents", f"must be {m} integer parent indices (one per "
                             f"alternative), got shape {list(parents.shape)}")
        if m and (np.any(parents < -1) or np.any(parents >= n + np.arange(m))):
            raise BadRequest("alt_parents", "each alternative hangs under the base (-1), a "
                             "chain token or an earlier alternative")
        object.__setattr__(self, "alt_parents", parents.astype(np.int32))
        if (self.conf is None) != (self.alt_conf is None):
            raise BadRequest("conf", "conf and alt_conf come together or not at all")
        if self.conf is not None:
            object.__setattr__(self, "conf", _probabilities("conf", self.conf, n))
            object.__setattr__(self, "alt_conf", _probabilities("alt_conf", self.alt_conf, m))

    @property
    def is_tree(self) -> bool:
        return len(self.alt_tokens) > 0

    @classmethod
    def from_message(cls, msg: Message) -> DraftChunk:
        _expect(msg, cls.TYPE)
        t = msg.tensors
        if len(t) not in (1, 3, 5):
            raise BadRequest("tensors", "a draft_chunk carries tokens, then optionally "
                             f"alt_tokens and alt_parents, then conf and alt_conf; got {len(t)}")
        return cls(msg.session, msg["base"], t[0], _opt(msg.fields, "chunk", 0),
                   *(t[1:3] if len(t) >= 3 else ()),
                   *(t[3:5] if len(t) == 5 else ()))

    def to_message(self, **envelope: Any) -> Message:
        tensors = [np.ascontiguousarray(self.tokens, dtype=np.int32)]
        if self.is_tree or self.conf is not None:
            tensors += [np.ascontiguousarray(self.alt_tokens, dtype=np.int32),
                        np.ascontiguousarray(self.alt_parents, dtype=np.int32)]
        if self.conf is not None:
            tensors += [np.ascontiguousarray(self.conf, dtype=np.float32),
                        np.ascontiguousarray(self.alt_conf, dtype=np.float32)]
        return make(self.TYPE, session=self.session, base=self.base, chunk=self.chunk,
                    tensors=tensors, **envelope)


@dataclass(frozen=True)
class SessionClose:
    TYPE: ClassVar[str] = "session_close"

    session: str

    @classmethod
    def from_message(cls, msg: Message) -> SessionClose:
        _expect(msg, cls.TYPE)
        return cls(_session(msg))

    def to_message(self, **envelope: Any) -> Message:
        return make(self.TYPE, session=self.session, **envelope)


# -- the shared suffix index -------------------------------------------------------------------
MAX_PUB_TOKENS = 8192  # tokens one publication carries (a longer generation sends its end)
MAX_SNAPSHOT_TOKENS = 1 << 18  # tokens one snapshot reply carries (1 MiB of int32)
MAX_SNAPSHOT_DOCS = 4096


@dataclass(frozen=True, eq=False)
class SuffixPub:
    """A finished generation, published for the cluster's suffix drafters."""

    TYPE: ClassVar[str] = "suffix_pub"

    cluster: str
    tokenizer: str
    tokens: np.ndarray  # [prompt ...] output; the output starts at output_start
    output_start: int = 0

    def __post_init__(self) -> None:
        _str("cluster", self.cluster, allow_empty=False)
        _str("tokenizer", self.tokenizer, allow_empty=False)
        object.__setattr__(self, "tokens", tokens_1d("tokens", self.tokens, allow_empty=False))
        if len(self.tokens) > MAX_PUB_TOKENS:
            raise BadRequest("tokens", f"at most {MAX_PUB_TOKENS} tokens, got {len(self.tokens)}")
        _int("output_start", self.output_start, 0, len(self.tokens) - 1)

    @classmethod
    def from_message(cls, msg: Message) -> SuffixPub:
        _expect(msg, cls.TYPE)
        f = msg.fields
        return cls(f["cluster"], f["tokenizer"], _tensor(msg, 0), f["output_start"])

    def to_message(self, **envelope: Any) -> Message:
        return make(self.TYPE, cluster=self.cluster, tokenizer=self.tokenizer,
                    output_start=self.output_start,
                    tensors=[np.asarray(self.tokens, dtype=np.int32)], **envelope)


@dataclass(frozen=True, eq=False)
class SuffixSnapshot:
    """Recent publications of one verifier: (tokens, output_start) documents."""

    TYPE: ClassVar[str] = "suffix_snapshot"

    tokenizer: str
    docs: tuple[tuple[np.ndarray, int], ...]

    def __post_init__(self) -> None:
        _str("tokenizer", self.tokenizer, allow_empty=False)
        if len(self.docs) > MAX_SNAPSHOT_DOCS:
            raise BadRequest("lengths", f"at most {MAX_SNAPSHOT_DOCS} documents")
        total = 0
        for i, (tokens, start) in enumerate(self.docs):
            tokens_1d(f"docs[{i}]", tokens, allow_empty=False)
            _int(f"starts[{i}]", start, 0, len(tokens) - 1)
            total += len(tokens)
        if total > MAX_SNAPSHOT_TOKENS:
            raise BadRequest("tokens", f"at most {MAX_SNAPSHOT_TOKENS} tokens, got {total}")

    @classmethod
    def from_message(cls, msg: Message) -> SuffixSnapshot:
        _expect(msg, cls.TYPE)
        tokens = tokens_1d("tokens", _tensor(msg, 0))
        lengths, starts = np.asarray(_tensor(msg, 1)), np.asarray(_tensor(msg, 2))
        if lengths.shape != starts.shape or len(lengths) > MAX_SNAPSHOT_DOCS:
            raise BadRequest("lengths", "lengths and starts must be two lists of one size")
        if len(lengths) and (int(lengths.min()) < 1 or int(lengths.sum()) != len(tokens)):
            raise BadRequest("lengths", "the lengths must be positive and add up to the tokens")
        ends = np.cumsum(lengths)
        docs = tuple((tokens[end - n:end], int(st))
                     for n, end, st in zip(lengths.tolist(), ends.tolist(), starts.tolist(),
                                           strict=True))
        return cls(msg.fields["tokenizer"], docs)

    def to_message(self, **envelope: Any) -> Message:
        tokens = (np.concatenate([np.asarray(t, dtype=np.int32) for t, _ in self.docs])
                  if self.docs else EMPTY_TOKENS)
        return make(self.TYPE, tokenizer=self.tokenizer, tensors=[
            tokens, np.asarray([len(t) for t, _ in self.docs], dtype=np.int32),
            np.asarray([st for _, st in self.docs], dtype=np.int32)], **envelope)


STRUCTS: dict[str, type] = {c.TYPE: c for c in (
    GenerateReq, TokenChunk, Done, ErrorReply, SessionOpen, SessionExtend, DraftChunk,
    SessionClose, SuffixPub, SuffixSnapshot)}


def parse(msg: Message) -> Any:
    """The typed object of a request-stream message (raises BadRequest / UnknownType)."""
    cls = STRUCTS.get(msg.type)
    if cls is None:
        raise UnknownType(f"no typed struct for {msg.type!r}")
    return cls.from_message(msg)
