"""Suffix indexes for the suffix drafter: where has the text's current tail occurred before?

Two indexes answer the same question, "which earlier positions follow the longest suffix of this
context, and how often", over different text:

* `LocalIndex`: one session's prompt + output, grown token by token and rolled back by
  `truncate` (a proposer drafting ahead assumes tokens, then learns the verifier disagreed).
* `GlobalIndex`: finished generations of earlier sessions (documents), weighted by how often the
  same document was written, within a byte budget: whole documents are evicted, least recently
  useful first (inserted, re-inserted or drafted from).

Both are hash chains, as in LZ77 compressors, rather than suffix trees: for each anchor length n
(the `levels`) a head table maps the hash of n tokens to the latest position those n tokens
precede, and `prev[p]` links each position to the previous one with the same hash. A lookup
walks the chain of the longest anchor the context's tail has, verifies the tokens (hashes
collide) and extends each match backwards up to `max_match` tokens. Why not a suffix tree: in
Python a tree costs hundreds of bytes per node and a node per token per depth; in the global
index a chain costs 4 bytes per token per level in an `array('i')` (read from Python at list
speed), documents are linked and the whole index rebuilt with numpy, and a lookup verifies its
walked positions in one numpy comparison. The session index is small and short-lived: plain
lists and dicts.

Token ids are non-negative; two markers sit in the global buffer: `SEP` between documents (no
match crosses it) and `START` where an output begins (a match may run through it, so a new
output's first tokens find earlier outputs that began the same way, even when prompts are not
indexed; nothing is ever drafted past a marker).

Exact repeats: a document may be filed under keyed hashes of the prompt it answered
(`prompt_digest`; a verifier's publication carries one even when the prompt itself is not
shared). `GlobalIndex.repeat` answers "this prompt was answered before and the answer so far
is its prefix: what comes next?", so the same question asked again is drafted whole, however
far into the answer it is, without matching suffixes at all.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

SEP = -1  # between documents in the global buffer
START = -2  # the first output token follows it

#: anchor lengths of the session index: every n up to 4 (so a one-token match drafts, as the
#: ngram drafter does), then sparser; a hit is extended past its anchor anyway
LOCAL_LEVELS = (1, 2, 3, 4, 6, 8, 12, 16)
#: anchor lengths of the global index: each costs 4 bytes per indexed token (plus its head)
GLOBAL_LEVELS = (2, 4, 8, 16)
#: longest match measured backwards; the draft size follows it
MAX_MATCH = 32
#: chain entries looked at per lookup (most recent first): bounds the work per draft
MAX_WALK = 32
#: fraction of the budget eviction brings the index back to, so compaction is not run per insert
LOW_WATER = 0.8
#: a rebuild relinks the buffer in chunks whose numpy temporaries stay within this fraction of
#: the budget
LINK_SHARE = 1 / 10
#: bytes of numpy temporaries per position linked (tracemalloc's peak over 819,301 positions
#: with the 4 global levels: 82)
LINK_BYTES_PER_POSITION = 82
#: bytes counted per document for its bookkeeping (the `_Doc`, list and dict entries; measured
#: with tracemalloc: tests/engine/test_suffix_index.py)
DOC_OVERHEAD = 240
#: the largest token id the int32 buffer stores
MAX_ID = 2**31 - 1
#: the key of prompt hashes outside a cluster (an in-process engine's own drafter); a node
#: uses its cluster's (nodes/node_common/suffix_share.py: `prompt_key`)
LOCAL_PROMPT_KEY = b"specbus suffix prompt v1 (in process)"
#: documents filed under one prompt hash (most recent first): answers of different lengths
#: or sampled ones
MAX_PER_PROMPT = 4

_P = 0x100000001B3  # FNV-64 prime: the polynomial hash's multiplier
_C = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads the polynomial hash over the table bits
_M = (1 << 64) - 1
_OFF = 3  # token + 3 > 0 for the markers too


def prompt_digest(key: bytes, prompt_ids: Sequence[int]) -> str:
    """The keyed hash of a prompt's token ids that publications carry: BLAKE2b-128 keyed with
    `key` (at most 64 bytes) over the ids as little-endian int64, in lowercase hex."""
    ids = np.asarray(prompt_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(ids, key=key, digest_size=16).hexdigest()


def poly_hash(window: Sequence[int]) -> int:
    """The global index's hash of a token window, as `_bucket_array` computes it in numpy."""
    h = 0
    for t in window:
        h = (h * _P + t + _OFF) & _M
    return h


@dataclass
class Match:
    """The longest suffix of a context found in an index, and where it continues."""

    length: int  # tokens matched (markers included)
    positions: list[int]  # continuation starts, most recent first
    weights: list[float]  # one per position (documents written several times weigh more)


class _ChainIndex:
    """What both indexes share: the token buffer, per-level `prev` chains and the lookup."""

    levels: tuple[int, ...]
    tokens: Sequence[int]
    prev: list

    def _first(self, ctx: Sequence[int], li: int) -> int:
        raise NotImplementedError

    def match(self, ctx: Sequence[int], max_match: int = MAX_MATCH,
              max_walk: int = MAX_WALK) -> Match:
        """The longest suffix of `ctx` (at least one anchor long) that occurs before a
        continuation: all its occurrences among the first `max_walk` entries of the longest
        anchor's chain that has any, most recent first."""
        toks, n_ctx = self.tokens, len(ctx)
        if not isinstance(ctx, list):  # list slices compare in C
            ctx = list(ctx)
        for li in range(len(self.levels) - 1, -1, -1):
            n = self.levels[li]
            if n > n_ctx:
                continue
            prev = self.prev[li]
            best, hits = 0, []
            p, walked = self._first(ctx, li), 0
            while p >= 0 and walked < max_walk:
                walked += 1
                m, lim = 0, min(max_match, n_ctx, p)
                if toks[p - lim : p] == ctx[n_ctx - lim :]:
                    m = lim  # the common case in repetitive text: one comparison in C
                while m + 8 <= lim and toks[p - m - 8 : p - m] == ctx[n_ctx - m - 8 : n_ctx - m]:
                    m += 8
                while m < lim and toks[p - m - 1] == ctx[n_ctx - m - 1]:
                    m += 1
                if m >= n:  # else a hash collision
                    if m > best:
                        best, hits = m, [p]
                    elif m == best:
                        hits.append(p)
                p = prev[p]
            if hits:
                return Match(best, hits, self._weights(hits))
        return Match(0, [], [])

    def _weights(self, positions: list[int]) -> list[float]:
        return [1.0] * len(positions)


class LocalIndex(_ChainIndex):
    """One session's prompt + committed (and assumed) tokens; extend and truncate in place.

    Position p's entries (one per level n <= p) say "the n tokens before p continue with token
    p"; they are added when token p is appended, so the tip's own suffix is never its match."""

    def __init__(self, tokens: Sequence[int] = (), levels: tuple[int, ...] = LOCAL_LEVELS):
        self.levels = levels
        self.tokens: list[int] = []
        self.prev: list[list[int]] = [[] for _ in levels]
        self.heads: list[dict[int, int]] = [{} for _ in levels]
        self.extend(tokens)

    def _first(self, ctx: Sequence[int], li: int) -> int:
        n = self.levels[li]
        return self.heads[li].get(hash(tuple(ctx[len(ctx) - n :])), -1)

    def extend(self, delta: Sequence[int]) -> None:
        toks = self.tokens
        for t in delta:
            p = len(toks)
            for li, n in enumerate(self.levels):
                if n <= p:
                    key = hash(tuple(toks[p - n : p]))
                    head = self.heads[li]
                    self.prev[li].append(head.get(key, -1))
                    head[key] = p
                else:
                    self.prev[li].append(-1)
            toks.append(int(t))

    def truncate(self, length: int) -> None:
        """Forget tokens past `length`: unwinding newest first, each removed position is the
        head of its chain, so its `prev` is the head again."""
        toks, length = self.tokens, max(length, 0)
        for p in range(len(toks) - 1, length - 1, -1):
            for li, n in enumerate(self.levels):
                if n <= p:
                    key = hash(tuple(toks[p - n : p]))
                    before = self.prev[li][p]
                    if before < 0:
                        del self.heads[li][key]
                    else:
                        self.heads[li][key] = before
        del toks[length:]
        for prev in self.prev:
            del prev[length:]


@dataclass
class _Doc:
    start: int  # first position in the buffer
    end: int  # one past its trailing SEP
    key: bytes  # content digest: a document written again adds weight, not bytes
    weight: float = 1.0
    used: int = 0  # the index clock when it was last inserted or drafted from
    out: int = -1  # offset of the first output token from `start` (-1: its start was cut)
    hashes: list[str] | None = None  # the prompt hashes it is filed under


class GlobalIndex(_ChainIndex):
    """Earlier sessions' finished text, shared by every session of one drafter, within a byte
    budget. Thread-safe (one lock): a proposer's worker and an in-process engine may share it."""

    def __init__(self, budget_bytes: int, levels: tuple[int, ...] = GLOBAL_LEVELS) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"suffix index budget must be > 0 bytes, got {budget_bytes}")
        self.levels = levels
        self.budget = budget_bytes
        self.lock = threading.Lock()
        self.docs: list[_Doc] = []  # in buffer order
        self.starts: list[int] = []
        self.by_key: dict[bytes, _Doc] = {}
        self.clock = 0
        self.evicted = 0  # documents evicted so far
        self.weight_total = 0.0
        self.prompt_key = LOCAL_PROMPT_KEY  # a node sets its cluster's
        self.by_prompt: dict[str, list[_Doc]] = {}  # prompt hash -> documents, newest first
        #: the tokenizer whose ids this index holds (`pin`); None until one is named
        self.tokenizer: str | None = None
        self._reset(array("i", [SEP]))

    def pin(self, tokenizer: str) -> bool:
        """Whether this index holds `tokenizer`'s ids: the first tokenizer named (by a
        publication heard or a session opened for a verifier) is the index's for good.
        Why: token ids mean text only under their tokenizer; an index that mixed two would
        draft one model's ids from the other's text (wasted rows, never wrong output), and a
        proposer serves verifiers of any tokenizer."""
        with self.lock:
            if self.tokenizer is None:
                self.tokenizer = tokenizer
            return self.tokenizer == tokenizer

    # -- building --------------------------------------------------------------------------

    def _reset(self, tokens: array, bits: int | None = None) -> None:
        """Adopt `tokens` as the buffer and relink every position (numpy, in chunks whose
        temporaries stay within `LINK_SHARE` of the budget). The old chains are let go
        before the new ones are made, so a rebuild never holds two indexes at once."""
        self.heads, self.prev = [], []
        self.tokens = tokens
        if bits is None:
            bits = _head_bits(len(tokens))
        self.bits = bits
        self.heads = [array("i", [-1]) * (1 << bits) for _ in self.levels]
        self.prev = [array("i", [-1]) * len(tokens) for _ in self.levels]
        chunk = max(1024, int(self.budget * LINK_SHARE / LINK_BYTES_PER_POSITION))
        for lo in range(0, len(tokens), chunk):
            self._link_range(lo, lo + chunk)

    def _link_range(self, lo: int, hi: int | None = None) -> None:
        """Link the positions from `lo` up to `hi` (the buffer's end by default), in order
        after every position before `lo`. Temporaries cost ~82 bytes per position linked,
        so a rebuild goes in chunks (`_reset`): one pass over the 1.6 M tokens of a full
        64 MB index held ~130 MB of them, twice the budget it was keeping."""
        hi = len(self.tokens) if hi is None else min(hi, len(self.tokens))
        view = np.frombuffer(self.tokens, dtype=np.int32)
        buf = view[max(lo - max(self.levels), 0):hi]
        base = hi - len(buf)
        seg = buf.astype(np.int64)
        del buf, view  # the buffer may grow later: no export may outlive this call
        seps = np.concatenate(([0], np.cumsum(seg == SEP)))
        for li, n in enumerate(self.levels):
            if len(seg) <= n:
                continue
            q = np.arange(n, len(seg))  # continuation index inside seg
            ok = (seps[q] - seps[q - n] == 0) & (seg[q] >= 0) & (q + base >= lo)
            buckets = _bucket_array(seg, n, self.bits)[ok]
            pos = (q[ok] + base).astype(np.int64)
            head = np.frombuffer(self.heads[li], dtype=np.int32)
            prev = np.frombuffer(self.prev[li], dtype=np.int32)
            _link(pos, buckets, head, prev)
            del head, prev  # release the buffers before the arrays grow again

    def prompt_digest(self, prompt_ids: Sequence[int]) -> str:
        """This index's hash of a prompt (`prompt_digest` with its key)."""
        return prompt_digest(self.prompt_key, prompt_ids)

    def add(self, tokens: Sequence[int], output_start: int, share_prompt: bool = False,
            prompt_hash: str | None = None) -> bool:
        """Index a finished generation: `tokens` = prompt + output, the output from
        `output_start`. The prompt goes in only with `share_prompt`. With `prompt_hash` (the
        prompt's `prompt_digest`) the document is filed under it for `repeat`, when its whole
        output is kept. Returns False when there was nothing to index (no output)."""
        output = [int(t) for t in tokens[output_start:]]
        if not output:
            return False
        prompt = [int(t) for t in tokens[:output_start]] if share_prompt else []
        doc = prompt + [START] + output
        if min(output + prompt) < 0 or max(output + prompt) > MAX_ID:
            # ids no tokenizer has (a hostile or broken peer): never stored, never a marker
            log.debug("suffix index: refused a document with ids outside 0..%d", MAX_ID)
            return False
        per_token = 4 * (1 + 2 * len(self.levels))  # buffer, prev, and heads sized to tokens
        cap = max(int(self.budget * LOW_WATER / 2) // per_token, 2)
        out = len(prompt) + 1  # where the output begins in `doc`
        if len(doc) + 1 > cap:  # bigger than half the budget: keep the end of it
            out -= len(doc) + 1 - cap  # < 1: the output's start is gone (no repeats)
            doc = doc[len(doc) + 1 - cap :]
        key = hashlib.blake2b(np.asarray(doc, dtype=np.int32).tobytes(), digest_size=16).digest()
        with self.lock:
            self.clock += 1
            old = self.by_key.get(key)
            if old is not None:
                old.weight += 1.0
                old.used = self.clock
                self.weight_total += 1.0
                if prompt_hash and old.out >= 1:
                    self._file(old, prompt_hash)
                return True
            room = len(doc) + 1  # the document and its SEP
            if self._bytes_after(room) > self.budget:
                self._evict(room)  # make room first: the index never holds more than budget
            start = len(self.tokens)
            self.tokens.extend(doc)
            self.tokens.append(SEP)
            for prev in self.prev:
                prev.extend(array("i", [-1]) * room)
            d = _Doc(start, len(self.tokens), key, 1.0, self.clock, out if out >= 1 else -1)
            if prompt_hash and d.out >= 1:
                self._file(d, prompt_hash)
            self.docs.append(d)
            self.starts.append(start)
            self.by_key[key] = d
            self.weight_total += 1.0
            if _grows(len(self.tokens), self.bits):
                self._reset(self.tokens)  # grow the heads: chains stay short
            else:
                self._link_range(start)
        return True

    def _bytes_after(self, room: int) -> int:
        """`nbytes` once `room` more buffer tokens (and one document) are in: with the head
        tables grown where the insert grows them, as `_projected` has them."""
        ntok = len(self.tokens) + room
        if _grows(ntok, self.bits):
            return self._projected(ntok, len(self.docs) + 1)
        return self.nbytes() + 4 * room * (1 + len(self.levels)) + DOC_OVERHEAD

    def _evict(self, room: int = 0) -> None:
        """Drop least recently useful documents until the index, rebuilt with `room` more
        tokens to come, is under LOW_WATER of the budget, then compact the buffer in place and
        relink (numpy, in chunks). Runs before an insert that would take the index over its
        budget, so neither the index nor its rebuild ever holds more than the budget."""
        target = self.budget * LOW_WATER
        ntok, ndocs = len(self.tokens), len(self.docs)
        dropped = set()
        for d in sorted(self.docs, key=lambda d: d.used):
            if self._projected(ntok + room, ndocs + 1) <= target:
                break
            ntok -= d.end - d.start
            ndocs -= 1
            dropped.add(id(d))
        live = [d for d in self.docs if id(d) not in dropped]
        self.heads, self.prev = [], []  # the chains are rebuilt below: let them go first
        buf = np.frombuffer(self.tokens, dtype=np.int32)
        pos = 1  # buf[0] is the leading SEP; documents only move left, so in place is safe
        for d in live:
            n = d.end - d.start
            if d.start != pos:
                buf[pos:pos + n] = buf[d.start:d.end]
            d.start, d.end = pos, pos + n
            pos += n
        del buf  # no export may outlive the resize
        del self.tokens[pos:]
        self.evicted += len(self.docs) - len(live)
        for d in self.docs:
            if id(d) in dropped:
                del self.by_key[d.key]
                self.weight_total -= d.weight
                self._unfile(d)
        self.docs = live
        self.starts = [d.start for d in live]
        self._reset(self.tokens, _head_bits(len(self.tokens) + room))
        log.debug("suffix index: evicted to %d documents, %d tokens, %d bytes",
                  len(self.docs), len(self.tokens), self.nbytes())

    def _file(self, d: _Doc, prompt_hash: str) -> None:
        """File `d` first under `prompt_hash` (lock held); the oldest beyond MAX_PER_PROMPT
        lose that entry."""
        docs = self.by_prompt.setdefault(prompt_hash, [])
        if d in docs:
            docs.remove(d)
        docs.insert(0, d)
        if d.hashes is None:
            d.hashes = []
        if prompt_hash not in d.hashes:
            d.hashes.append(prompt_hash)
        for old in docs[MAX_PER_PROMPT:]:
            old.hashes.remove(prompt_hash)
        del docs[MAX_PER_PROMPT:]

    def _unfile(self, d: _Doc) -> None:
        for h in d.hashes or ():
            docs = self.by_prompt.get(h, [])
            if d in docs:
                docs.remove(d)
            if not docs:
                self.by_prompt.pop(h, None)
        d.hashes = None

    def repeat(self, prompt_hash: str, output: Sequence[int],
               n: int) -> tuple[list[int], list[float]] | None:
        """The same prompt answered before: the continuation, up to n tokens, of the most
        recent document filed under `prompt_hash` whose output begins with `output` (the
        answer so far) and goes on past it, with each token's share (by weight) of the filed
        documents that agree with it so far among those whose text goes on that far; None
        when no filed document does (the answer diverged, or ended)."""
        if n <= 0 or prompt_hash not in self.by_prompt:
            return None
        try:
            so_far = array("i", output)
        except OverflowError:  # ids no int32 buffer holds: nothing indexed matches them
            return None
        m = len(so_far)
        with self.lock:
            conts: list[list[int]] = []
            weights: list[float] = []
            chosen = None
            for d in self.by_prompt.get(prompt_hash, ()):
                o = d.start + d.out
                end = d.end - 1  # the document's trailing SEP
                if o + m > end or self.tokens[o : o + m] != so_far:
                    continue
                cont = self.tokens[o + m : min(o + m + n, end)].tolist()
                if cont and chosen is None:
                    chosen = d
                conts.append(cont)
                weights.append(d.weight)
            if chosen is None:
                return None
            self.clock += 1
            chosen.used = self.clock
        first = conts[[i for i, c in enumerate(conts) if c][0]]
        agree = list(range(len(conts)))
        conf: list[float] = []
        for depth, tok in enumerate(first):
            on = [i for i in agree if len(conts[i]) > depth]
            agree = [i for i in on if conts[i][depth] == tok]
            conf.append(sum(weights[i] for i in agree) / sum(weights[i] for i in on))
        return first, conf

    def _projected(self, ntokens: int, ndocs: int) -> int:
        """`nbytes` of an index rebuilt over `ntokens` buffer tokens (`_reset`'s head size)."""
        bits = _head_bits(ntokens)
        levels = len(self.levels)
        return 4 * ntokens * (1 + levels) + 4 * levels * (1 << bits) + DOC_OVERHEAD * ndocs

    # -- reading ---------------------------------------------------------------------------

    def _first(self, ctx: Sequence[int], li: int) -> int:
        n = self.levels[li]
        h = poly_hash(ctx[len(ctx) - n :])
        return self.heads[li][((h * _C) & _M) >> (64 - self.bits)]

    def lookup(self, ctx: Sequence[int], max_match: int = MAX_MATCH,
               max_walk: int = MAX_WALK) -> Match:
        with self.lock:
            if not self.docs:
                return Match(0, [], [])
            return self.match(ctx, max_match, max_walk)

    def match(self, ctx: Sequence[int], max_match: int = MAX_MATCH,
              max_walk: int = MAX_WALK) -> Match:
        """As `_ChainIndex.match`, but the walked positions are verified and extended in one
        numpy comparison (4x faster than per-position slices on chains of 32)."""
        n_ctx = len(ctx)
        buf = np.frombuffer(self.tokens, dtype=np.int32)
        try:
            for li in range(len(self.levels) - 1, -1, -1):
                n = self.levels[li]
                if n > n_ctx:
                    continue
                prev, walk, toks = self.prev[li], [], self.tokens
                last, first = ctx[n_ctx - 1], ctx[n_ctx - n]
                p, walked = self._first(ctx, li), 0
                while p >= 0 and walked < max_walk:
                    walked += 1
                    if toks[p - 1] == last and toks[p - n] == first:  # most collisions
                        walk.append(p)
                    p = prev[p]
                if not walk:
                    continue
                lim = min(max_match, n_ctx)
                pos = np.asarray(walk, dtype=np.int64)
                back = np.asarray(ctx[n_ctx - lim :][::-1], dtype=np.int64)  # any int id
                idx = np.maximum(pos[:, None] - np.arange(1, lim + 1)[None, :], 0)
                eq = buf[idx] == back[None, :]  # position 0 is SEP: never equal
                m = np.where(eq.all(axis=1), lim, eq.argmin(axis=1))
                m[m < n] = 0  # hash collisions
                best = int(m.max())
                if best:
                    hits = pos[m == best].tolist()
                    return Match(best, hits, self._weights(hits))
            return Match(0, [], [])
        finally:
            del buf  # the buffer must be free to grow on the next insert

    def continuations(self, positions: Sequence[int], n: int) -> list[tuple[int, ...]]:
        """Up to n tokens after each position, cut at the first marker (one numpy gather)."""
        if not positions or n <= 0:
            return [() for _ in positions]
        with self.lock:
            buf = np.frombuffer(self.tokens, dtype=np.int32)
            idx = np.minimum(np.asarray(positions, dtype=np.int64)[:, None] + np.arange(n),
                             len(buf) - 1)  # the buffer ends with SEP
            rows = buf[idx]
            del buf
        marker = rows < 0
        ends = np.where(marker.any(axis=1), marker.argmax(axis=1), n).tolist()
        return [tuple(r[:e]) for r, e in zip(rows.tolist(), ends, strict=True)]

    def _doc_of(self, p: int) -> _Doc:
        return self.docs[bisect.bisect_right(self.starts, p) - 1]

    def _weights(self, positions: list[int]) -> list[float]:
        return [self._doc_of(p).weight for p in positions]

    def touch(self, positions: Sequence[int]) -> None:
        """The documents holding these positions were just drafted from: useful lately."""
        with self.lock:
            self.clock += 1
            for p in positions:
                if 0 < p < len(self.tokens) and self.docs:
                    self._doc_of(p).used = self.clock

    def nbytes(self) -> int:
        """Bytes the index holds: buffer, chains, head tables, per-document bookkeeping."""
        arrays = [self.tokens, *self.prev, *self.heads]
        return sum(a.buffer_info()[1] * a.itemsize for a in arrays) + DOC_OVERHEAD * len(
            self.docs)

    def stats(self) -> dict:
        with self.lock:
            return {"documents": len(self.docs), "tokens": len(self.tokens),
                    "bytes": self.nbytes(), "budget": self.budget, "evicted": self.evicted,
                    "prompts": len(self.by_prompt)}


def _head_bits(ntokens: int) -> int:
    """Bits of the head tables for a buffer of `ntokens`: one head per token or more."""
    return max(10, math.ceil(math.log2(max(ntokens, 2))))


def _grows(ntokens: int, bits: int) -> bool:
    """Whether a buffer of `ntokens` outgrew head tables of `bits` (chains would run long)."""
    return ntokens > 2 * (1 << bits)


def _bucket_array(seg: np.ndarray, n: int, bits: int) -> np.ndarray:
    """`poly_hash` of every n-token window of `seg` (window ending before index q, for q from
    n), reduced to `bits` bits: the same arithmetic in uint64, which wraps like `& _M`."""
    vals = (seg + _OFF).astype(np.uint64)
    length = len(seg) - n
    h = np.zeros(length, dtype=np.uint64)
    for i in range(n):
        h = h * np.uint64(_P) + vals[i : i + length]
    return ((h * np.uint64(_C)) >> np.uint64(64 - bits)).astype(np.int64)


def _link(pos: np.ndarray, buckets: np.ndarray, head: np.ndarray, prev: np.ndarray) -> None:
    """Chain ascending positions into their buckets as if pushed one by one: each position's
    `prev` is the one before it in its bucket (or the bucket's old head), the last is the head."""
    if not len(pos):
        return
    order = np.lexsort((pos, buckets))
    b, p = buckets[order], pos[order]
    first = np.ones(len(b), dtype=bool)
    first[1:] = b[1:] != b[:-1]
    last = np.ones(len(b), dtype=bool)
    last[:-1] = first[1:]
    before = np.empty(len(p), dtype=np.int32)
    before[1:] = p[:-1]
    before[first] = head[b[first]]
    prev[p] = before
    head[b[last]] = p[last]
