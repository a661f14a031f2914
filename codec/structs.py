"""The typed wire messages: each one declared once, here, as a frozen dataclass.

Every field says how it travels and which values it may hold (`codec.declare`); from that one
declaration come the kind-level schema `codec.messages` encodes and decodes with, the value
checks run on construction (a `top_p` is in (0, 1], a token tensor is 1-D with non-negative ids),
`from_message(Message)` (the one place a received message's fields are read) and `to_message()`
(the one place a message of the type is built). Rules between fields (a prompt and a token
tensor are not both given) are each class's `_cross_check`. A bad value raises
`codec.errors.BadRequest` naming the field.

Limits that need node knowledge (vocabulary size, model context) are checked by the node right
after this parse (`nodes/node_common/requests.py`). The gossip types (`card`, `heartbeat`, ...) and
`blob` have only a kind-level schema (`codec.schema.UNTYPED`): discovery parses its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from codec import checks
from codec import declare as wire
from codec.chat import ChatMessage, as_dicts, chat_messages
from codec.checks import EMPTY_TOKENS
from codec.envelope import Message
from codec.errors import BadRequest, UnknownType
from codec.sampling import SamplingParams
from codec.schema import INT, LIST, MAP, STR

DEFAULT_MAX_TOKENS = 128
MAX_TOKENS = 1 << 20  # absurd beyond this whatever the model; nodes apply their context too
#: the generation length served, whatever the context (bounds one request's work): the verifier
#: refuses more (`nodes.node_common.requests`), the gateway's `max_tokens` range ends here
MAX_TOKENS_LIMIT = 4096
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_PROPOSERS = 64
MAX_LEASE_S = 300.0
MAX_HORIZON = 256  # tokens a proposer may draft past the last commit it knows
MAX_ALTERNATIVES = 128  # alternative tokens one draft chunk may carry beside its chain
MAX_CLASS_CHARS = 16  # a draft class label (`DraftChunk.classes`): "m5", "repeat", "gm9"
MAX_COMMITTED = 2**31 - 1
MAX_HIDDEN_WIDTH = 1 << 16  # values per hidden-state row (3 layers x a 16k-wide model fit)
MAX_TOP_LOGPROBS = 20  # alternatives per token with their log probabilities (OpenAI's cap)
#: what a `generate_req.grammar` may be, and its largest text (UTF-8 bytes)
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_PUB_TOKENS = 8192  # tokens one publication carries (a longer generation sends its end)
MAX_SNAPSHOT_TOKENS = 1 << 18  # tokens one snapshot reply carries (1 MiB of int32)
MAX_SNAPSHOT_DOCS = 4096
PROMPT_HASH_CHARS = 32  # a publication's keyed prompt hash: 16 bytes, lowercase hex
FORCE = "force"


# -- generation ------------------------------------------------------------------------------------
def _max_tokens(name: str, v: Any) -> int:
    if checks.is_int(v) and v <= 0:  # the one users meet: said in their words
        raise BadRequest(name, f"max tokens must be a positive integer, got {v}")
    return checks.int_in(name, v, 1, MAX_TOKENS)


def _grammar(name: str, v: Any) -> dict[str, str]:
    """`{kind, text}`: kind one of `GRAMMAR_KINDS`, text at most `MAX_GRAMMAR_BYTES`."""
    if not isinstance(v, Mapping) or set(v) - {"kind", "text"}:
        raise BadRequest(name, "must be a map {kind, text}")
    kind, text = v.get("kind"), v.get("text", "")
    if kind not in GRAMMAR_KINDS:
        raise BadRequest(f"{name}.kind", f"must be one of {', '.join(GRAMMAR_KINDS)}")
    if not isinstance(text, str):
        raise BadRequest(f"{name}.text", "must be a string")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise BadRequest(f"{name}.text", f"longer than {MAX_GRAMMAR_BYTES} bytes")
    return {"kind": kind, "text": text}


@wire.message("generate_req", eq=False, kw_only=True)
class GenerateReq(wire.Struct):
    """Generate from a text prompt (or chat messages, or token ids): exactly one of them."""

    max_tokens: int = wire.custom(INT, _max_tokens, int, default=DEFAULT_MAX_TOKENS)
    sampling: SamplingParams = wire.nested(SamplingParams, flat=True)
    stop: tuple[str, ...] = wire.strings(MAX_STOPS, chars=(1, MAX_STOP_CHARS), default=())
    chat: bool = wire.flag(default=True)
    speculate: bool = wire.flag(default=True)
    prompt: str | None = wire.text(default=None, blank=False)
    messages: tuple[ChatMessage, ...] | None = wire.custom(LIST, chat_messages, as_dicts,
                                                           default=None)
    tokens: np.ndarray | None = wire.token_ids(blank=False, as_given=True, default=None)
    proposers: tuple[str, ...] | None = wire.strings(MAX_PROPOSERS, blank=False, default=None)
    #: "force": ask exactly `proposers` every block, with the full deadline, never judged slow
    draft: str | None = wire.text(default=None, choices=(FORCE,))
    #: the verifier's log probability of each token, and of its `logprobs` most likely
    #: alternatives (0: the token's own only); None: none
    logprobs: int | None = wire.integer(0, MAX_TOP_LOGPROBS, default=None)
    #: None: free text; else `{kind, text}` every generated token must keep matching (a JSON
    #: schema's text, a regex, a Lark grammar; "json_object": any JSON object)
    grammar: Mapping[str, str] | None = wire.custom(MAP, _grammar, dict, default=None)
    #: a resumed generation (a failover): the last `resumed` ids of `tokens` were generated
    #: already, under this request's grammar and penalties; the verifier's grammar matcher and
    #: presence / frequency counts start after them. None (absent): nothing resumed
    resumed: int | None = wire.integer(0, MAX_TOKENS, default=None)

    def _cross_check(self) -> None:
        given = [n for n in ("prompt", "messages", "tokens") if getattr(self, n) is not None]
        if len(given) > 1:
            raise BadRequest(given[1], f"give one of prompt, messages or tokens, not {given}")
        if not given:
            raise BadRequest("prompt", "needs a prompt, messages or a token tensor")
        if self.resumed:
            if self.tokens is None:
                raise BadRequest("resumed", "a resumed generation sends its prompt as tokens")
            if self.resumed >= len(self.tokens):
                raise BadRequest("resumed", f"{self.resumed} generated tokens leave no prompt of "
                                 f"the {len(self.tokens)} tokens sent")
        if self.draft is not None:
            if not self.speculate:
                raise BadRequest("draft", "draft='force' contradicts speculate=false")
            if not self.proposers:
                raise BadRequest("proposers", "draft='force' needs the proposers to ask")

    @property
    def force_draft(self) -> bool:
        return self.draft == FORCE


def _no_floats() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


@wire.message("token_chunk", eq=False)
class TokenChunk(wire.Struct):
    """Tokens committed by the verifier, streamed as they come; `index` counts the chunks."""

    index: int = wire.integer(0, MAX_COMMITTED)
    tokens: np.ndarray = wire.token_ids()
    text: str = wire.text(default="")
    #: with `logprobs` asked: the verifier's log probability of each token, and row-major
    #: [tokens x top_n] its top_n most likely tokens at that position with theirs
    top_n: int | None = wire.integer(0, MAX_TOP_LOGPROBS, default=None)
    logprobs: np.ndarray = wire.log_probabilities(default_factory=_no_floats)
    top_ids: np.ndarray = wire.indices(0, default_factory=lambda: EMPTY_TOKENS)
    top_logprobs: np.ndarray = wire.log_probabilities(default_factory=_no_floats)

    def _cross_check(self) -> None:
        n = len(self.tokens)
        if len(self.logprobs) not in (0, n):
            raise BadRequest("logprobs", f"one per token: {n}, got {len(self.logprobs)}")
        want = n * (self.top_n or 0) if len(self.logprobs) else 0
        for name in ("top_ids", "top_logprobs"):
            if len(getattr(self, name)) != want:
                raise BadRequest(name, f"must hold tokens x top_n = {want} values, got "
                                 f"{len(getattr(self, name))}")


@wire.message("done")
class Done(wire.Struct):
    """Generation (or draft session) finished; final figures."""

    finish_reason: str = wire.text()
    text: str | None = wire.text(default=None)
    stats: Mapping[str, Any] = wire.mapping(omit_empty=True)


@wire.message("error")
class ErrorReply(wire.Struct):
    """A typed error reply; `code` is one of the codec error codes or a node error code."""

    code: str = wire.text()
    message: str = wire.text()


# -- draft sessions --------------------------------------------------------------------------------
@wire.message("session_open", eq=False)
class SessionOpen(wire.Struct):
    """Open a draft session on a proposer with the prompt tokens; the proposer answers with a
    stream of draft_chunk replies (more=true) until the session ends. `horizon`: draft at most
    this many tokens past the last commit known."""

    session: str = wire.session()
    tokens: np.ndarray = wire.token_ids(blank=False)
    lease_s: float = wire.number(0.0, MAX_LEASE_S, lo_open=True)
    sampling: SamplingParams = wire.nested(SamplingParams)
    tokenizer: str | None = wire.text(default=None)
    drafter: str | None = wire.text(default=None)
    horizon: int | None = wire.integer(0, MAX_HORIZON, default=None)
    #: the generation's grammar (`generate_req.grammar`'s form and bounds), sent only to a
    #: proposer whose card says it takes one (`extras.grammar`): it then drafts only what the
    #: grammar allows after the prompt. Absent otherwise, so other sessions keep their bytes.
    grammar: Mapping[str, str] | None = wire.custom(MAP, _grammar, dict, default=None)


def _no_features() -> np.ndarray:
    return np.zeros(0, dtype=np.float16)


@wire.message("session_extend", eq=False)
class SessionExtend(wire.Struct):
    """Tokens committed since the last message; `committed` is the total after them. Pushed by
    the verifier after every step; `horizon` updates how far to draft ahead."""

    session: str = wire.session()
    tokens: np.ndarray = wire.token_ids()
    committed: int = wire.integer(0, MAX_COMMITTED)
    horizon: int | None = wire.integer(0, MAX_HORIZON, default=None)
    #: for a proposer that reads the verifier's hidden states (an EAGLE-3 head): the rows of
    #: the positions the verifier cached since the last push (the prompt's with the first),
    #: each `hidden_width` values (layers x hidden size), row-major, fp16
    hidden_width: int | None = wire.integer(1, MAX_HIDDEN_WIDTH, default=None)
    hidden: np.ndarray = wire.features(default_factory=_no_features)

    def _cross_check(self) -> None:
        checks.int_in("committed", self.committed, len(self.tokens), MAX_COMMITTED)
        if len(self.hidden) and (not self.hidden_width or len(self.hidden) % self.hidden_width):
            raise BadRequest("hidden", f"must hold whole rows of hidden_width "
                             f"{self.hidden_width} values, got {len(self.hidden)}")

    @property
    def hidden_rows(self) -> np.ndarray:
        """The hidden states as [rows, hidden_width] (no rows: [0, 0])."""
        if not len(self.hidden):
            return np.zeros((0, 0), dtype=np.float16)
        return self.hidden.reshape(-1, self.hidden_width)


def _empty_tokens() -> np.ndarray:
    return EMPTY_TOKENS


@wire.message("draft_chunk", eq=False, counts=(1, 3, 5))
class DraftChunk(wire.Struct):
    """Streamed reply to session_open: the proposer's draft past committed length `base`.

    `tokens` continue the committed prefix of length `base` (the last commit the proposer
    knows): first the tokens it assumed (its own earlier drafts, not yet confirmed), then new
    ones; the verifier uses what extends its committed prefix. Optional alternatives make it a
    tree; conf and alt_conf are the drafter's probability of each token, classes the kind of
    draft each chain token came from.
    """

    session: str = wire.session(required=False)
    base: int = wire.integer(0, MAX_COMMITTED)
    tokens: np.ndarray = wire.token_ids(most=MAX_HORIZON)
    chunk: int = wire.integer(0, 2**62, default=0)  # chunks streamed so far, this one included
    #: alternatives (a model drafter's runners-up, the n-gram index's other continuations):
    #: alt_tokens[j] hangs under alt_parents[j]: -1 the base, i < n chain token i, n + j' an
    #: earlier alternative j' < j. Empty: the chunk is a chain.
    alt_tokens: np.ndarray = wire.token_ids(most=MAX_ALTERNATIVES, default_factory=_empty_tokens)
    alt_parents: np.ndarray = wire.indices(-1, default_factory=_empty_tokens)
    #: the drafter's probability of each chain token / alternative given its parent; both or
    #: neither (drafters without probabilities, like n-grams, send neither)
    conf: np.ndarray | None = wire.probabilities(default=None)
    alt_conf: np.ndarray | None = wire.probabilities(default=None)
    #: per chain token, the drafter's class of the draft it came from (its
    #: `DraftState.draft_class` when it drafted it, e.g. the length of the match a lookup
    #: continued; "" for none): the verifier keeps a remote source's acceptance per class as
    #: it does its own sources'. Empty: the drafter names no classes.
    classes: tuple[str, ...] = wire.strings(MAX_HORIZON, chars=(0, MAX_CLASS_CHARS),
                                            default=(), omit_empty=True)

    def _cross_check(self) -> None:
        n, m = len(self.tokens), len(self.alt_tokens)
        if self.classes and len(self.classes) != n:
            raise BadRequest("classes", f"must be {n} labels (one per chain token) or none, "
                                        f"got {len(self.classes)}")
        parents = self.alt_parents
        if len(parents) != m:
            raise BadRequest("alt_parents", f"must be {m} integer parent indices (one per "
                             f"alternative), got shape {list(parents.shape)}")
        if m and np.any(parents >= n + np.arange(m)):
            raise BadRequest("alt_parents", "each alternative hangs under the base (-1), a "
                             "chain token or an earlier alternative")
        if (self.conf is None) != (self.alt_conf is None):
            raise BadRequest("conf", "conf and alt_conf come together or not at all")
        if self.conf is not None:
            for name, want in (("conf", n), ("alt_conf", m)):
                got = len(getattr(self, name))
                if got != want:
                    raise BadRequest(name, f"must be {want} probabilities, got {got}")

    @property
    def is_tree(self) -> bool:
        return len(self.alt_tokens) > 0


@wire.message("session_close")
class SessionClose(wire.Struct):
    """Close a draft session now (otherwise its lease expires)."""

    session: str = wire.session()


# -- the shared suffix index (gossip topic specbus-suffix/<cluster>/, and a request) -------------
def _prompt_hash(name: str, v: Any) -> str:
    """A keyed prompt hash: PROMPT_HASH_CHARS lowercase hex digits ("" where a snapshot's
    document has none is checked by the snapshot)."""
    v = checks.text(name, v)
    if len(v) != PROMPT_HASH_CHARS or v.strip("0123456789abcdef"):
        raise BadRequest(name, f"must be {PROMPT_HASH_CHARS} lowercase hex digits, got "
                               f"{checks.shown(repr(v))}")
    return v


@wire.message("suffix_pub", eq=False)
class SuffixPub(wire.Struct):
    """A verifier's finished generation for the cluster's suffix drafters: its token ids, the
    prompt first only when the verifier shares prompts (`output_start` is where the output
    begins; 0 when only the output is sent). `tokenizer` is the verifier's fingerprint: ids
    mean something only for the same tokenizer. `prompt_hash`: a keyed hash of the prompt's
    token ids (sent with or without the prompt, when the whole output is in `tokens`), so a
    suffix drafter drafts the whole answer for the same prompt asked again."""

    cluster: str = wire.text(blank=False)
    tokenizer: str = wire.text(blank=False)
    tokens: np.ndarray = wire.token_ids(blank=False, most=MAX_PUB_TOKENS)
    output_start: int = wire.integer(0, MAX_PUB_TOKENS, default=0, required=True)
    prompt_hash: str | None = wire.custom(STR, _prompt_hash, str, default=None)

    def _cross_check(self) -> None:
        checks.int_in("output_start", self.output_start, 0, len(self.tokens) - 1)


@wire.message("suffix_snapshot_req")
class SuffixSnapshotReq(wire.Struct):
    """Ask a verifier for what it published lately (a suffix proposer that joined late starts
    warm)."""

    cluster: str = wire.text()


@wire.message("suffix_snapshot", eq=False)
class SuffixSnapshot(wire.Struct):
    """Reply to suffix_snapshot_req: recent publications, their tokens concatenated, with each
    one's length and output start (`docs` reads them back one by one), and each one's
    `prompt_hash` ("" for none) when any has one."""

    tokenizer: str = wire.text(blank=False)
    tokens: np.ndarray = wire.token_ids(most=MAX_SNAPSHOT_TOKENS)
    lengths: np.ndarray = wire.indices(1)
    starts: np.ndarray = wire.indices(0)
    prompt_hashes: tuple[str, ...] | None = wire.strings(
        MAX_SNAPSHOT_DOCS, chars=(0, PROMPT_HASH_CHARS), default=None)

    def _cross_check(self) -> None:
        lengths, starts = self.lengths, self.starts
        if lengths.shape != starts.shape or len(lengths) > MAX_SNAPSHOT_DOCS:
            raise BadRequest("lengths", f"lengths and starts must be two lists of one size, at "
                             f"most {MAX_SNAPSHOT_DOCS}")
        hashes = self.prompt_hashes
        if hashes is not None:
            if len(hashes) != len(lengths):
                raise BadRequest("prompt_hashes", "must have one entry per document")
            for i, h in enumerate(hashes):
                if h:
                    _prompt_hash(f"prompt_hashes[{i}]", h)
        if int(lengths.sum()) != len(self.tokens):
            raise BadRequest("lengths", "the lengths must add up to the tokens")
        late = np.nonzero(starts >= lengths)[0]
        if len(late):
            i = int(late[0])
            raise BadRequest(f"starts[{i}]", f"must be in 0..{int(lengths[i]) - 1}, "
                             f"got {int(starts[i])}")

    @classmethod
    def of(cls, tokenizer: str, docs: tuple[tuple[Any, int], ...],
           hashes: tuple[str | None, ...] | None = None) -> SuffixSnapshot:
        """The snapshot of (tokens, output_start) documents, with their prompt hashes (None
        or "" for a document without one)."""
        arrays = [np.asarray(t) for t, _ in docs]
        tokens = (np.concatenate([a.astype(np.int32, copy=False) for a in arrays]) if docs
                  else EMPTY_TOKENS)
        given = tuple(h or "" for h in hashes) if hashes is not None else ()
        return cls(tokenizer, tokens, np.asarray([len(a) for a in arrays], dtype=np.int32),
                   np.asarray([st for _, st in docs], dtype=np.int32),
                   given if any(given) else None)

    @property
    def docs(self) -> tuple[tuple[np.ndarray, int], ...]:
        """The (tokens, output_start) documents, in order."""
        ends = np.cumsum(self.lengths)
        return tuple((self.tokens[end - n:end], int(st)) for n, end, st in
                     zip(self.lengths.tolist(), ends.tolist(), self.starts.tolist(),
                         strict=True))


# -- the bus's own requests ------------------------------------------------------------------------
@wire.message("ping")
class Ping(wire.Struct):
    """Round-trip probe."""

    payload: str | None = wire.text(default=None)


@wire.message("pong")
class Pong(wire.Struct):
    """Reply to ping."""

    payload: str | None = wire.text(default=None)


@wire.message("cancel")
class Cancel(wire.Struct):
    """Cancel the in-flight request whose id is in the header `rid`."""


STRUCTS: dict[str, type[wire.Struct]] = {c.TYPE: c for c in (
    GenerateReq, TokenChunk, Done, ErrorReply, SessionOpen, SessionExtend, DraftChunk,
    SessionClose, SuffixPub, SuffixSnapshotReq, SuffixSnapshot, Ping, Pong, Cancel)}


def parse(msg: Message) -> Any:
    """The typed object of a request-stream message (raises BadRequest / UnknownType)."""
    cls = STRUCTS.get(msg.type)
    if cls is None:
        raise UnknownType(f"no typed struct for {msg.type!r}")
    return cls.from_message(msg)
