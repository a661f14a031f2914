"""Grammar constraints: what a generation may say, compiled by llguidance for our tokenizer.

A `Constraint` is what a request asks for (a JSON schema, any JSON object, a regex or a Lark
grammar), small and plain enough to travel in `generate_req` (`to_wire`, bounded by
`MAX_CONSTRAINT_BYTES`). A verifier compiles it once per tokenizer (`Grammars`: llguidance's
tokenizer built from our Hugging Face tokenizer files, a bounded LRU of compiled matchers, a
compile deadline) and gives each sequence its own `GrammarMatcher`, which follows the committed
tokens (consume, roll back what a stop rule cut) and answers the step's three questions:

- which tokens may come next (`allowed`: a bool row over the vocabulary, the mask the verifier
  applies to its own logits before it picks: `mask_logits`);
- how much of a draft path is grammatical (`valid_prefix`: drafts are pruned before they cost a
  forward);
- which tokens the grammar forces from here (`forced`: a free draft, `GrammarSource`).

Why llguidance (over xgrammar and outlines-core): it computes masks lazily on a token trie with
an Earley parser (no ahead-of-time per-state mask tables, so a schema compiles in about a
millisecond and a 10k-property one in about a second instead of a precompile per schema), it
has `validate_tokens` (how much of a draft is valid, without moving the state), `rollback`
(speculation commits and discards several tokens a step) and forced tokens tokenized the way
the model would (`compute_ff_tokens`: the grammar drafter), all on one matcher object, and it
reads Lark, regex and JSON schema through one compiler with resource limits (fuel, grammar
size) that turn a hostile schema into an error, not a hung verifier. outlines-core builds a
full index per schema (seconds to minutes on large ones) and has no rollback; xgrammar has
rollback and jump-forward strings but compiles per-schema caches ahead of time and exposes
forced text, not forced tokens.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from codec.structs import GRAMMAR_KINDS, MAX_GRAMMAR_BYTES
from nodes.engine.cost import keep_newest
from nodes.engine.errors import BadRequestError
from nodes.engine.sources import DraftSource
from nodes.engine.tree import DraftTree, TokenTree

#: the kinds of constraint a request may carry, and the largest constraint text accepted (the
#: wire's bounds, `codec.structs`): a schema this size compiles well under the deadline; one of
#: 10,000 properties (about 300 KB) is refused before compiling
KINDS = GRAMMAR_KINDS
MAX_CONSTRAINT_BYTES = MAX_GRAMMAR_BYTES
#: a grammar that takes longer than this to compile is refused (400), and not cached
COMPILE_TIMEOUT_S = 2.0
#: compiled grammars a verifier keeps (least recently used out first)
CACHE_SIZE = 64
#: llguidance's resource limits: a grammar past them fails to compile (a 400 naming the limit)
_LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
               step_max_items=50_000, max_lexer_states=100_000)
#: JSON output is compact (no free whitespace): a small model cannot pad it forever, and more of
#: it is forced (drafted free)
_JSON_OPTIONS = {"whitespace_flexible": False}
#: ways of tokenizing a forced run's tail `GrammarMatcher.forced_paths` drafts (a tree)
FORCED_WAYS = 3
#: a greedy row's favourites checked one by one before the full mask (`mask_logits`)
ARGMAX_TRIES = 4
#: (last token, forced bytes) keys remembered per grammar (`GrammarMatcher.forced_memo`)
FORCED_MEMO_KEPT = 4096
#: forced tails whose first token a verifier remembers across sequences (`Grammars.habits`),
#: the least recently learnt dropped first
HABITS_KEPT = 4096


@dataclass(frozen=True)
class Constraint:
    """What a generation must match: `kind` (one of `KINDS`) and its `text` (the JSON schema
    as JSON text, the regex, the Lark grammar; "" for json_object)."""

    kind: str
    text: str = ""

    def check(self) -> None:
        if self.kind not in KINDS:
            raise BadRequestError(f"constraint kind must be one of {', '.join(KINDS)}, "
                                  f"got {self.kind!r}", "grammar")
        if not isinstance(self.text, str):
            raise BadRequestError("constraint text must be a string", "grammar")
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise BadRequestError(f"{self.kind} is {size} bytes, more than the "
                                  f"{MAX_CONSTRAINT_BYTES} accepted", "grammar")
        if self.kind != "json_object" and not self.text.strip():
            raise BadRequestError(f"empty {self.kind}", "grammar")

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        """From a schema object (dict/bool) or its JSON text."""
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls("json_schema", text)

    def to_wire(self) -> dict[str, str]:
        return {"kind": self.kind, "text": self.text}

    @classmethod
    def from_wire(cls, value: Any) -> Constraint:
        if not isinstance(value, dict) or set(value) - {"kind", "text"}:
            raise BadRequestError("grammar must be a map {kind, text}", "grammar")
        out = cls(str(value.get("kind", "")), value.get("text", ""))
        out.check()
        return out


def _grammar_text(c: Constraint) -> str:
    """The llguidance grammar (its JSON form) for a constraint; a malformed schema raises."""
    import llguidance as llg

    if c.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      overrides=_JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.text)
        except ValueError as exc:
            raise BadRequestError(f"json_schema is not valid JSON: {exc}", "grammar") from None
        if not isinstance(schema, (dict, bool)):
            raise BadRequestError("json_schema must be an object (or a boolean)", "grammar")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise BadRequestError(f"json_schema does not compile: {exc}", "grammar") from None
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.text)
    return llg.LLMatcher.grammar_from_lark(c.text)


def validate(c: Constraint) -> None:
    """Check `c` without a tokenizer (a client, before it sends or loads a model): its size,
    its JSON, and that llguidance compiles it under the verifier's limits; `BadRequestError`
    naming why. (A grammar that accepts nothing is found only against a tokenizer.)"""
    import llguidance as llg

    c.check()
    grammar = _grammar_text(c)
    error = llg.LLMatcher.validate_grammar(grammar, limits=llg.LLParserLimits(**_LIMITS))
    if error:
        raise BadRequestError(f"{c.kind} does not compile: {_first_line(error)}", "grammar")


class Grammars:
    """A verifier's grammar compiler: llguidance's tokenizer for `tokenizer` (our
    `nodes.backends.tokenizer.Tokenizer`; built once, about half a second) and a bounded LRU of
    compiled matchers keyed by constraint, each sequence getting a copy (`matcher`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, cache_size: int = CACHE_SIZE,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._ll: Any = None
        self._pieces: TokenPieces | None = None
        #: how this verifier's model has tokenized a forced run's tail (`GrammarMatcher.habits`),
        #: the prior of every new sequence's
        self.habits: dict[bytes, int] = {}
        #: per constraint, its states' fast-forward tokens by last token and forced bytes
        #: (`GrammarMatcher.forced_memo`), bounded like the compiled grammars
        self._forced_memos: OrderedDict[Constraint, dict] = OrderedDict()
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._running: dict[Constraint, Future] = {}  # compiles under way
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._masks: ThreadPoolExecutor | None = None  # `fill_ahead`'s thread, made at need
        self._executor: Any = None
        #: (compiles, cache hits, seconds compiling): for the record
        self.compiles = 0
        self.hits = 0
        self.compile_s = 0.0

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(
                    self.tokenizer.hf, n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_token_ids)[0])
            return self._ll

    @property
    def pieces(self) -> TokenPieces:
        """The vocabulary's byte strings, for tokenizing forced text every way (`TokenPieces`)."""
        ll = self.ll_tokenizer
        with self._lock:
            if self._pieces is None:
                self._pieces = TokenPieces(ll, self.vocab_size)
            return self._pieces

    def compile(self, c: Constraint) -> Any:
        """The compiled matcher of `c` (cached); `BadRequestError` naming why when it does not
        compile or takes longer than `timeout_s`."""
        _ = self.ll_tokenizer  # built once (~0.5 s), before and outside the deadline
        try:
            return self.prepare(c).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._too_slow(c) from None

    def prepare(self, c: Constraint) -> Future:
        """Start compiling `c` on the grammar thread and return at once: a future of the
        compiled matcher (done already when cached; one compile however many ask while it
        runs), failing with a `BadRequestError` naming why it does not compile or that it took
        longer than `timeout_s`. A verifier calls it as a request arrives, so the compute
        thread starts the request only when its grammar is ready and never waits on a compile
        with a batch running (nodes/verifier/role.py); limits `check` refuses at once."""
        c.check()
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                self.hits += 1
                done: Future = Future()
                done.set_result(hit)
                return done
            running = self._running.get(c)
            if running is None:
                running = self._running[c] = self._pool.submit(self._compile_now, c)
            return running

    def _compile_now(self, c: Constraint) -> Any:
        """The grammar thread: compile `c`, cache it when it compiled in time."""
        try:
            ll = self.ll_tokenizer
            t0 = time.perf_counter()
            matcher = _build(ll, c)
            seconds = time.perf_counter() - t0
            if seconds > self.timeout_s:
                raise self._too_slow(c)
            with self._lock:
                self.compile_s += seconds
                self.compiles += 1
                self._cache[c] = matcher
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return matcher
        finally:
            with self._lock:
                self._running.pop(c, None)

    def _too_slow(self, c: Constraint) -> BadRequestError:
        return BadRequestError(f"{c.kind} took longer than {self.timeout_s:g} s to compile",
                               "grammar")

    def fill_ahead(self, matchers: Sequence[GrammarMatcher]) -> Future:
        """Fill the next-token masks of `matchers` (their present states) on the mask thread,
        all in one llguidance call (`fill_batch`), and return at once: a
        future of the packed masks, one row each in order. The caller hands the matchers over
        until the future is done (it reads nor moves none of them meanwhile: the verifier's
        forward) and takes them back by waiting on it; the rows are a snapshot, its own."""
        with self._lock:
            if self._masks is None:
                import llguidance as llg

                self._executor = llg.LLExecutor(1)  # the verifier's one core: no fan-out
                self._masks = ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="grammar-masks")
        return self._masks.submit(fill_batch, list(matchers), self._executor)

    def matcher(self, c: Constraint) -> GrammarMatcher:
        """A fresh per-sequence matcher for `c`, at the start of the generation."""
        ll = self.compile(c).deep_copy()
        memo = None
        if "no_forcing" not in c.text:  # (a grammar that forces no bytes: nothing to recall)
            with self._lock:
                memo = self._forced_memos.pop(c, None)
                memo = {} if memo is None else memo
                self._forced_memos[c] = memo
                while len(self._forced_memos) > self.cache_size:
                    self._forced_memos.popitem(last=False)
        return GrammarMatcher(ll, self.vocab_size, frozenset(self.tokenizer.eos_token_ids),
                              self.pieces, self.habits, memo)


def _build(ll: Any, c: Constraint) -> Any:
    import llguidance as llg

    grammar = _grammar_text(c)
    matcher = llg.LLMatcher(ll, grammar, log_level=0,
                            limits=llg.LLParserLimits(**_LIMITS, verbose_errors=False))
    if matcher.is_error():
        raise BadRequestError(f"{c.kind} does not compile: {_first_line(matcher.get_error())}",
                              "grammar")
    if matcher.is_stopped() and not matcher.is_accepting():
        raise BadRequestError(f"{c.kind} accepts nothing", "grammar")
    return matcher


def _first_line(text: str) -> str:
    """llguidance's error, its first line (and its `error: ...` line, where the reason is)."""
    lines = text.strip().splitlines()
    if not lines:
        return "unknown error"
    why = next((x.strip() for x in lines[1:] if x.strip().startswith("error:")), "")
    line = f"{lines[0].rstrip(':')} ({why})" if why else lines[0]
    return line[:300]


class GrammarMatcher:
    """One sequence's grammar state: it has consumed exactly the sequence's generated tokens
    between steps (`sync` after each commit). Within a step, acceptance walks it forward along
    the path it accepts (`advance`), and settle rolls back what a stop rule cut."""

    def __init__(self, ll: Any, vocab_size: int, eos: frozenset[int],
                 pieces: TokenPieces | None = None,
                 shared_habits: dict[bytes, int] | None = None,
                 forced_memo: dict[tuple[int, bytes], list[int]] | None = None) -> None:
        self.ll = ll
        self.pieces = pieces
        #: a forced tail's bytes -> the first token the model wrote it with, in this sequence
        #: (a model keeps its own style: `":` then `"`, or `":"`), and across the verifier's
        #: sequences (the prior): the tail `forced_paths` drafts first
        self.habits: dict[bytes, int] = {}
        self.shared_habits = shared_habits if shared_habits is not None else {}
        self._tail: tuple[int, bytes] | None = None
        self.vocab = vocab_size
        self.eos = eos
        #: tokens consumed since the start of the generation
        self.consumed = 0
        self._bits = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
        #: changes with every move of `ll` (advance, rollback, resume): what `_forced_bytes`
        #: and `_forced_tokens` computed (`_ff`) is for the state it was computed in
        self._state = 0
        self._ff: tuple[int, bytes, list[int] | None] | None = None
        #: the tokens `ll` has consumed (the last one is part of how llguidance tokenizes
        #: forced text), and the last resumed token before them
        self._tokens: list[int] = []
        self._resumed_last = -1
        #: (last token, forced bytes) -> the fast-forward tokens llguidance gave a state with
        #: them, shared by the sequences of one grammar (`allows`, `forced_paths`); None: not
        #: kept
        self.forced_memo = forced_memo
        #: seconds spent in masks, validation and forced tokens (for the record)
        self.seconds = 0.0
        self.masks = 0

    # ---- state ---------------------------------------------------------------------------------
    def advance(self, token: int) -> None:
        """Consume one token the verifier picked (from the masked distribution: valid)."""
        if self.ll.is_stopped():
            self.consumed += 1  # EOS after the end: nothing more to match
            return
        if self._tail is not None and self._tail[0] == self.consumed:
            self._learn(self._tail[1], int(token))
        self._state += 1
        if not self.ll.consume_token(int(token)):
            raise RuntimeError(f"grammar refused token {token}: {self.ll.get_error()}")
        self._tokens.append(int(token))
        self.consumed += 1

    def _learn(self, tail: bytes, token: int) -> None:
        """The model wrote a forced tail starting with `token`: draft that way next time."""
        piece = self.pieces.bytes[token] if self.pieces is not None else b""
        if piece and (tail.startswith(piece) or piece.startswith(tail)):
            self.habits[tail] = token
            # (the verifier's, for its whole life: bounded)
            keep_newest(self.shared_habits, tail, token, HABITS_KEPT)

    def sync(self, generated: int) -> None:
        """Roll back to `generated` tokens consumed (a stop rule cut the block)."""
        extra = self.consumed - generated
        if extra > 0:
            self._state += 1
            self.ll.rollback(extra)
            del self._tokens[max(0, len(self._tokens) - extra):]
            self.consumed = generated

    def replay(self, tokens: Sequence[int]) -> None:
        """Consume `tokens` already generated (a resumed generation)."""
        for t in tokens:
            self.advance(t)

    def resume(self, tokens: Sequence[int]) -> None:
        """Start after `tokens`, generated under this grammar before the generation resumed
        (a failover: they end the new prompt). They are the state the sequence starts from, not
        part of its generated tokens (`consumed` stays 0: `sync` never rolls them back); a
        `BadRequestError` naming `resumed` when the grammar refuses them."""
        tokens = [int(t) for t in tokens]
        ok = int(self.ll.validate_tokens(tokens)) if tokens else 0
        self._state += 1
        if ok == len(tokens) and self.ll.consume_tokens(tokens):
            if tokens:
                self._resumed_last = tokens[-1]
            return
        at = min(ok, len(tokens) - 1)
        raise BadRequestError(f"resumed: token {at} of the {len(tokens)} resumed "
                              f"(id {tokens[at]}) does not match the grammar", "resumed")

    def _forced_bytes(self) -> bytes:
        """The bytes the grammar forces from the present state (~2 µs), once per state."""
        if self._ff is None or self._ff[0] != self._state:
            self._ff = (self._state, bytes(self.ll.compute_ff_bytes()), None)
        return self._ff[1]

    def _forced_tokens(self) -> list[int]:
        """The present state's fast-forward tokens, once per state: a greedy row asks about
        its favourites one by one (`allows`) and the grammar drafter (`forced_paths`) about
        the committed state again, and they cost llguidance a tokenizer run (~30-55 µs on
        SmolLM2). No forced bytes, no forced tokens."""
        text = self._forced_bytes()
        if self._ff[2] is None:
            self._ff = (self._state, text, list(self.ll.compute_ff_tokens()) if text else [])
            if text and self.forced_memo is not None:
                keep_newest(self.forced_memo, (self._last(), text), self._ff[2],
                            FORCED_MEMO_KEPT)
        return self._ff[2]

    def _recalled(self, text: bytes) -> list[int] | None:
        """The fast-forward tokens of an earlier state with the present state's last token
        and forced bytes `text` (None: none met). llguidance tokenizes the forced bytes after
        the last token's, the same tokens for the same two, then drops the trailing tokens
        that could merge with what follows, which depends on the state: the present state's
        are a prefix of the same tokens, where not computed yet."""
        if self.forced_memo is None or not text:
            return None
        if self._ff is not None and self._ff[0] == self._state and self._ff[2] is not None:
            return self._ff[2]
        return self.forced_memo.get((self._last(), text))

    def _last(self) -> int:
        return self._tokens[-1] if self._tokens else self._resumed_last

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (but EOS)."""
        return bool(self.ll.is_stopped())

    # ---- questions -------------------------------------------------------------------------------
    def allowed(self, bits: np.ndarray | None = None) -> np.ndarray:
        """Bool row over the vocabulary: the tokens the grammar allows next (EOS where the
        grammar is complete; every EOS id of the sequence counts as EOS). `bits`: llguidance's
        packed mask of the present state, filled already (`Grammars.fill_ahead`)."""
        t0 = time.perf_counter()
        if bits is None:
            self.ll.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            bits = self._bits
        row = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8),
                            bitorder="little")[: self.vocab]
        row = row.astype(bool)
        if self.eos and (self.ll.is_accepting() or self.ll.is_stopped()):
            row[list(self.eos)] = True
        elif not row.any():  # nothing grammatical: end the generation rather than loop
            row[list(self.eos)] = True
        self.masks += 1
        self.seconds += time.perf_counter() - t0
        return row

    def mask_logits(self, row: np.ndarray, *, argmax_only: bool = False,
                    bits: np.ndarray | None = None) -> np.ndarray:
        """`row` (one position's logits) with the tokens the grammar forbids at -inf, in place
        where it can be written (`mask_and_pick` without its pick)."""
        return self.mask_and_pick(row, argmax_only=argmax_only, bits=bits)[0]

    def mask_and_pick(self, row: np.ndarray, *, argmax_only: bool = False,
                      bits: np.ndarray | None = None) -> tuple[np.ndarray, int | None]:
        """`row` (one position's logits) with the tokens the grammar forbids at -inf, in place
        where it can be written, and, for `argmax_only`, the masked row's argmax where the
        favourites' check found it (else None: the caller takes it from the row). The pick
        saves reading the row a second time (~15 µs on SmolLM2's 49,152 logits, out of cache).

        `argmax_only` (greedy, no log probabilities asked): what is picked from the row is its
        argmax and nothing else is read, so when the grammar allows the row's argmax the row
        is returned as it is: the masked row's argmax is the same token (the first of the
        largest values, allowed). One token checked instead of a mask over the vocabulary;
        where it is forbidden, the next largest (that one at -inf), up to `ARGMAX_TRIES` (the
        state's first question costs llguidance ~40 µs, the next ones ~1: the model's second
        or third favourite is usually what the grammar takes); the full mask only past
        them. `bits`: the present state's packed mask, filled already (`allowed`).

        `seconds` counts the grammar's part: the checks and the tries past the first argmax,
        not that argmax, which is the pick itself (an unconstrained row pays it too; read from
        a row just out of the forward, 80-150 µs on SmolLM2's 49,152 logits), as the full
        mask's path leaves out the caller's argmax of the masked row."""
        if argmax_only and bits is None:
            top = int(np.argmax(row))
            t0 = time.perf_counter()
            for attempt in range(ARGMAX_TRIES):
                if attempt:
                    top = int(np.argmax(row))
                if top < self.vocab and self.allows(top):
                    self.seconds += time.perf_counter() - t0
                    return row, top
                if not row.flags.writeable:
                    row = row.copy()
                row[top] = -np.inf  # (forbidden: the masked row has it at -inf too)
            self.seconds += time.perf_counter() - t0
        allowed = self.allowed(bits)
        vocab = min(len(row), self.vocab)
        if not row.flags.writeable:
            row = row.copy()
        row[:vocab][~allowed[:vocab]] = -np.inf
        row[vocab:] = -np.inf
        return row, None

    def allows(self, token: int) -> bool:
        """Whether the grammar's mask allows `token` next: the same answer as
        `allowed()[token]`, for a few microseconds instead of a mask over the vocabulary.

        llguidance's mask is not every token that keeps the text grammatical: where the
        grammar forces text and that text has fast-forward tokens (its canonical tokenization,
        `forced`), the mask holds only the first of them (after `{"` with `"name"` forced, `name`
        but not `n` or `na`); elsewhere it is what `validate_tokens` accepts. EOS ids where the
        grammar may end; a state that allows nothing at all, where EOS is let through, is left
        to `allowed`. tests/engine/test_grammar.py checks this against the mask, token by
        token."""
        if self.ll.is_stopped():
            return token in self.eos
        if token in self.eos:
            return bool(self.ll.is_accepting())
        if self.ll.validate_tokens([token]) != 1:
            return False
        text = self._forced_bytes()
        if not text:
            return True
        # the fast-forward tokens, where not empty, begin as a state's with the same last
        # token and forced bytes did (`_recalled`), and where they are empty every valid token
        # is allowed: `token` equal to that state's first is allowed either way, without the
        # tokenizer's run
        known = self._recalled(text)
        if known and known[0] == token:
            return True
        ff = self._forced_tokens()
        return not ff or ff[0] == token

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here (state unchanged); an EOS id
        counts where the grammar may end."""
        if not tokens:
            return 0
        t0 = time.perf_counter()
        toks = [int(t) for t in tokens]
        n = self.ll.validate_tokens(toks)
        if n < len(toks) and toks[n] in self.eos:
            # EOS ids other than llguidance's own: valid where the grammar may end
            probe = self.ll.deep_copy()
            if probe.consume_tokens(toks[:n]) and (probe.is_accepting() or probe.is_stopped()):
                n += 1
        self.seconds += time.perf_counter() - t0
        return n

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces from here (at most `limit`), tokenized the way the
        model tokenizes the forced text (llguidance's fast-forward tokens). They stop short of
        the forced text's end where its last token could merge with what follows (`"age":`
        gives `"`, `age`: the `":` could be `":"`); `forced_paths` drafts the rest too."""
        if limit <= 0 or self.ll.is_stopped():
            return []
        t0 = time.perf_counter()
        out = self._forced_tokens()[:limit]
        self.seconds += time.perf_counter() - t0
        return out

    def forced_paths(self, limit: int, ways: int = FORCED_WAYS) -> list[list[int]]:
        """The whole forced run as draft paths (at most `limit` tokens each, likeliest
        first): the fast-forward tokens, then the forced bytes they leave (the run's tail,
        which may merge with the free text after it) tokenized each way the vocabulary
        allows, fewest tokens first, at most `ways` of them, each checked against the grammar;
        the way the model wrote the same tail last first (`habits`). The verifier takes
        whichever the model prefers: `"age":"` drafts both `":"` and `":` `"`, a key's last
        piece and the value's opening quote in one step with the key."""
        if limit <= 0 or self.ll.is_stopped():
            return []
        t0 = time.perf_counter()
        text = self._forced_bytes()
        # (a draft: an earlier state's tokens for the same bytes, which may keep a trailing
        # token the present state's would drop, serve; the verifier judges every one)
        known = self._recalled(text)
        head = list(known if known is not None else self._forced_tokens())
        paths = [head] if head else []
        if self.pieces is not None and len(head) < limit:
            done = self.pieces.text(head)
            if text.startswith(done) and len(text) > len(done):
                tail = text[len(done):]
                habit = self.habits.get(tail, self.shared_habits.get(tail))
                tails = sorted(self.pieces.splits(tail, ways), key=lambda t: t[0] != habit)
                ok = [head + t for t in tails
                      if self.ll.validate_tokens(head + t) == len(head) + len(t)]
                paths = ok or paths
                self._tail = (self.consumed + len(head), tail)
        self.seconds += time.perf_counter() - t0
        return [p[:limit] for p in paths]


def fill_batch(matchers: Sequence[GrammarMatcher], executor: Any) -> np.ndarray:
    """The packed next-token masks of `matchers` (one row each, llguidance's bitmask: bit t of
    a row set where token t is allowed), filled in one call on `executor` (`LLExecutor`, Rust
    threads): the bits `GrammarMatcher.allowed` fills one by one."""
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    words = (matchers[0].vocab + 31) // 32 if matchers else 1
    bits = np.full((len(matchers), words), -1, dtype=np.int32)
    if matchers:
        lln.fill_next_token_bitmask_par(executor, [(m.ll, i) for i, m in enumerate(matchers)],
                                        bits)
    share = (time.perf_counter() - t0) / max(1, len(matchers))
    for m in matchers:  # (for the record; the caller reads no matcher until this is done)
        m.seconds += share
    return bits


#: the longest token (in bytes) a forced tail is split into; splits enumerated at most
_LONGEST_PIECE = 16
_MAX_SPLITS = 64


class TokenPieces:
    """The vocabulary as byte strings (llguidance's view of our tokenizer): each ordinary
    token's bytes, and the tokens by their bytes, to split forced text into tokens."""

    def __init__(self, ll_tokenizer: Any, vocab_size: int) -> None:
        self.bytes: list[bytes] = []
        self.by_bytes: dict[bytes, int] = {}
        n = min(vocab_size, ll_tokenizer.vocab_size)
        for t in range(n):
            b = b"" if ll_tokenizer.is_special_token(t) else ll_tokenizer.decode_bytes([t])
            self.bytes.append(b)
            if b and len(b) <= _LONGEST_PIECE:
                self.by_bytes.setdefault(b, t)
        self.bytes += [b""] * (vocab_size - n)

    def text(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.bytes[t] for t in tokens)

    def splits(self, text: bytes, ways: int) -> list[list[int]]:
        """Up to `ways` ways to write `text` as tokens, fewest tokens first (ties: longest
        first token first)."""
        if not text:
            return []
        n = len(text)
        # fewest tokens from each position to the end (dynamic programming, right to left)
        best = [0] + [n + 1] * n  # best[k]: fewest tokens for text[n-k:]
        for k in range(1, n + 1):
            at = n - k
            for j in range(min(k, _LONGEST_PIECE), 0, -1):
                if text[at:at + j] in self.by_bytes and best[k - j] + 1 < best[k]:
                    best[k] = best[k - j] + 1
        if best[n] > n:
            return []
        found: list[list[int]] = []

        def walk(at: int, path: list[int], slack: int) -> None:
            if len(found) >= _MAX_SPLITS:
                return
            if at == n:
                found.append(list(path))
                return
            for j in range(min(n - at, _LONGEST_PIECE), 0, -1):
                tok = self.by_bytes.get(text[at:at + j])
                if tok is None:
                    continue
                extra = best[n - at - j] + 1 - best[n - at]  # tokens this piece costs over best
                if extra <= slack:
                    path.append(tok)
                    walk(at + j, path, slack - extra)
                    path.pop()

        walk(0, [], 2)  # the fewest-token splits, and those of one or two tokens more
        found.sort(key=len)  # (stable: longest first pieces first among equals)
        return found[:ways]


def prune_tree(tree: TokenTree, matcher: GrammarMatcher) -> TokenTree:
    """`tree` without the draft nodes the grammar forbids (and their descendants): each
    root-to-leaf path validated once from the sequence's state."""
    if not tree.drafted:
        return tree
    ok = [False] * len(tree)
    ok[0] = True
    leaves = [i for i in range(1, len(tree)) if not tree.children[i]]
    for leaf in leaves:
        path = []
        node = leaf
        while node:
            path.append(node)
            node = tree.parents[node]
        path.reverse()
        n = matcher.valid_prefix([tree.tokens[i] for i in path])
        for i in path[:n]:
            ok[i] = True
    if all(ok):
        return tree
    return tree.subtree([i for i in range(1, len(tree)) if ok[i]])


class GrammarSource(DraftSource):
    """The grammar as a drafter: the tokens it forces from the committed state (a JSON key, a
    closing brace, the rest of an enum value), one chain. The cost model judges it as any
    other source: forced text can be tokenized other ways, which the model may prefer."""

    name = "grammar"

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher

    def propose(self, committed: Sequence[int], budget: int) -> DraftTree:
        return DraftTree.from_paths([(p, None) for p in self.matcher.forced_paths(budget) if p])
