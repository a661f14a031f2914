"""The cluster's shared suffix index: verifiers publish what they generate, suffix proposers
index what verifiers of their tokenizer publish.

Why: a suffix drafter drafts from earlier outputs (nodes/drafters/suffix.py), but one that sees
only its own sessions starts cold on every machine, and the answer given by one verifier
yesterday is not there when another verifier gets the same question. So:

- `Publisher` (a verifier): each finished generation's token ids go out on the gossip topic
  `specbus-suffix/<cluster>/` as a `suffix_pub`: the output only, the prompt before it with
  `--share-prompts`, nothing with `--no-share`. Rate-limited (a token bucket: 20 a second,
  bursts of 40) and size-capped (the last 8,192 tokens). It keeps the last `RING_TOKENS`
  tokens it published and answers `suffix_snapshot_req` with them, so a proposer that joins
  late starts warm.
- `Subscriber` (a proposer whose drafter has a global index): indexes every publication of its
  tokenizer (the index's: the first fingerprint named to it, by a publication or by a
  proposer session's verifier, `GlobalIndex.pin`; the ids of another tokenizer mean other text),
  asks the first verifiers it sees for a snapshot, and drops and counts what is malformed,
  oversized, of another tokenizer, over a sender's rate or beyond its indexing queue. The
  index's own byte budget bounds its memory whatever arrives (sender ids can be forged, so
  per-sender rates alone bound nothing).

Every publication also carries `prompt_hash`, a keyed hash of the prompt's token ids (with or
without `--share-prompts`; not when a long output was cut), and snapshots carry each document's:
a suffix proposer files the answer under it and drafts it whole when the same prompt is asked
again (`GlobalIndex.repeat`). The key (`prompt_key`) comes from the cluster secret when the
cluster has one, else from the cluster name: then anyone who reads the publication can test
guesses of the prompt (docs/security.md).

Publications travel like all gossip: with a cluster secret, under CURVE and the gossip MAC, so
only members read them (docs/security.md).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from bus.security import hkdf_sha256
from bus.streams import BusError, Call, RemoteError, Request
from codec.errors import CodecError
from codec.messages import Message
from codec.structs import (
    MAX_PUB_TOKENS,
    MAX_SNAPSHOT_TOKENS,
    SuffixPub,
    SuffixSnapshot,
    SuffixSnapshotReq,
)
from discovery.counters import Counters
from nodes.drafters.suffix_index import prompt_digest
from nodes.engine.errors import BUSY
from nodes.node_common.admission import TokenBucket
from nodes.node_common.host import RoleHost

log = logging.getLogger(__name__)

SHARE_MODES = ("output", "prompts", "off")
PUB_RATE, PUB_BURST = 20.0, 40  # publications per second a verifier sends (and a proposer takes)
RING_TOKENS = MAX_SNAPSHOT_TOKENS  # what a verifier keeps for late joiners
SNAPSHOT_FROM = 2  # verifiers a proposer asks for a snapshot when it starts
#: snapshots a verifier serves per second (bursts of SNAPSHOT_BURST); past that it answers
#: busy: a snapshot is up to 1 MiB built on the I/O thread, and a proposer needs one when it
#: starts, so a member asking in a loop must not turn a verifier into a 1 GB/s sender
SNAPSHOT_RATE, SNAPSHOT_BURST = 1.0, 4
#: a proposer asks a verifier that answered busy again after this many seconds, at most
#: SNAPSHOT_TRIES times in all
SNAPSHOT_RETRY_S, SNAPSHOT_TRIES = 2.0, 3
MAX_SENDERS = 256  # senders whose rate is tracked
SUBSCRIBER_COUNTERS = ("malformed", "foreign", "rate_limited", "queue_full", "snapshots")
QUEUE_DOCS = 256  # publications (or snapshots) waiting to be indexed


_PROMPT_LABEL = b"specbus suffix prompt hash v1"


def share_topic(cluster: str) -> str:
    return f"specbus-suffix/{cluster}/"


def prompt_key(node) -> bytes:
    """The key of the cluster's prompt hashes: derived from the cluster secret (through the
    gossip MAC key, which only members hold) when the cluster is secured, else from the cluster
    name, which every reader of a publication knows (the hash then hides a prompt only as well
    as the prompt resists guessing: docs/security.md)."""
    security = getattr(node, "security", None)
    if security is not None:
        return hkdf_sha256(security.gossip_key, _PROMPT_LABEL)
    return hkdf_sha256(node.config.cluster.encode("utf-8"), _PROMPT_LABEL + b" (no secret)")


class Publisher:
    """A verifier's side: publish each finished generation; serve snapshots of recent ones."""

    def __init__(self, mode: str, tokenizer: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in SHARE_MODES:
            raise ValueError(f"share mode must be one of {SHARE_MODES}, got {mode!r}")
        self.mode = mode
        self.tokenizer = tokenizer
        self._node = None
        self._lock = threading.Lock()  # the ring: appended by the compute thread, read on I/O
        self._ring: collections.deque[tuple[np.ndarray, int, str | None]] = collections.deque()
        self._ring_tokens = 0
        self._clock = clock
        self._bucket = TokenBucket(PUB_RATE, PUB_BURST, clock())
        self._snapshots = TokenBucket(SNAPSHOT_RATE, SNAPSHOT_BURST, clock())  # I/O thread
        self.published = 0  # compute thread
        self.skipped = 0  # over the rate (compute thread)
        self.snapshots_refused = 0  # over SNAPSHOT_RATE (I/O thread)
        self._key: bytes | None = None

    def attach(self, node: RoleHost) -> None:
        self._node = node
        self._key = prompt_key(node)
        node.register_request("suffix_snapshot_req", self._serve_snapshot)

    def publish(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Compute thread, after a generation: send it out (if sharing and within the rate)."""
        node = self._node
        if self.mode == "off" or not output_ids or node is None or node.gossip is None:
            return
        if not self._bucket.take(self._clock()):
            self.skipped += 1
            return
        prompt = prompt_ids if self.mode == "prompts" else []
        tokens = np.asarray([*prompt, *output_ids], dtype=np.int32)
        start = len(prompt)
        whole = True  # the whole output goes out: a repeat of the prompt can be drafted whole
        if len(tokens) > MAX_PUB_TOKENS:  # keep the end: the output, and what leads into it
            cut = len(tokens) - MAX_PUB_TOKENS
            whole = cut <= start
            tokens, start = tokens[cut:], max(start - cut, 0)
        digest = prompt_digest(self._key, prompt_ids) if whole and prompt_ids else None
        cluster = node.config.cluster
        msg = SuffixPub(cluster, self.tokenizer, tokens, start, digest).to_message(
            sender=node.node_id)
        node.gossip.publish(share_topic(cluster), msg)
        self.published += 1
        with self._lock:
            self._ring.append((tokens, start, digest))
            self._ring_tokens += len(tokens)
            while self._ring_tokens > RING_TOKENS:
                old, _, _ = self._ring.popleft()
                self._ring_tokens -= len(old)

    def _serve_snapshot(self, req: Request) -> None:
        """I/O thread: the recent publications, newest kept when they do not all fit; busy
        past `SNAPSHOT_RATE`."""
        if not self._snapshots.take(self._clock()):
            self.snapshots_refused += 1
            req.fail(BUSY, f"suffix snapshots are limited to {SNAPSHOT_RATE:g} a second; "
                           f"ask again in {SNAPSHOT_RETRY_S:g} s")
            return
        with self._lock:
            docs = list(self._ring)[-4096:]
        req.reply(SuffixSnapshot.of(self.tokenizer, tuple((t, st) for t, st, _ in docs),
                                    tuple(h for _, _, h in docs)).to_message())


class Subscriber:
    """A proposer's side: feed a drafter's global index from the cluster's verifiers.

    The I/O thread checks and queues; indexing (about 40 ms for 8,192 tokens here) happens on
    this subscriber's own thread, so a burst of publications never holds heartbeats or draft
    traffic. The queue is bounded: what does not fit is dropped and counted.
    """

    def __init__(self, index) -> None:
        #: has add(tokens, output_start, share_prompt, prompt_hash), pin(tokenizer),
        #: tokenizer, its own lock, prompt_key
        self.index = index
        self._node = None
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self._asked: set[str] = set()
        self._tries: collections.Counter[str] = collections.Counter()  # snapshot asks per verifier
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_DOCS)
        self._thread = threading.Thread(target=self._run, name="suffix-indexer", daemon=True)
        self.counters: Counters | None = None  # I/O thread
        self.indexed = Counters(("indexed", "indexed_tokens"),
                                is_owner=lambda: threading.current_thread() is self._thread)

    def attach(self, node: RoleHost) -> None:
        self._node = node
        self.index.prompt_key = prompt_key(node)  # the verifiers' key: their hashes match ours
        self.counters = Counters(SUBSCRIBER_COUNTERS, is_owner=node.loop.in_loop)
        node.register_gossip("suffix_pub", self._on_pub)
        self._thread.start()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            docs = self._queue.get()
            if docs is None:
                return
            try:
                for tokens, start, digest in docs:
                    try:
                        if self.index.add(tokens.tolist(), start, share_prompt=start > 0,
                                          prompt_hash=digest):
                            self.indexed.inc("indexed")
                            self.indexed.inc("indexed_tokens", len(tokens) - start)
                    except Exception:  # noqa: BLE001 - one bad document must not stop it
                        log.exception("indexing a publication failed")
            finally:
                self._queue.task_done()  # "queued" counts an item until it is indexed

    def start(self) -> None:
        """After the node joined: hear publications, and ask verifiers for what came before."""
        node = self._node
        node.gossip.subscribe(share_topic(node.config.cluster))
        node.membership.subscribe(self._on_member_event)
        node.loop.call_soon(self._ask_snapshots)

    def stats(self) -> dict[str, int]:
        out = self.counters.snapshot() if self.counters is not None else {}
        out.update(self.indexed.snapshot())
        # put and not yet indexed: an item the indexer has taken but not finished still counts
        # (qsize alone reads 0 while the last document is being added)
        out["queued"] = self._queue.unfinished_tasks
        out["index_bytes"] = int(self.index.nbytes())
        return out

    # -- I/O thread ----------------------------------------------------------------------------
    def _on_pub(self, topic: str, msg: Message) -> None:
        try:
            pub = SuffixPub.from_message(msg)
        except (CodecError, KeyError) as exc:
            self.counters.inc("malformed")
            log.debug("dropped a malformed suffix publication from %r: %s", msg.sender, exc)
            return
        if not self._allow(msg.sender):
            self.counters.inc("rate_limited")
            return
        self._take(pub.tokenizer, [(pub.tokens, pub.output_start, pub.prompt_hash)])

    def _allow(self, sender: str) -> bool:
        bucket = self._buckets.get(sender)
        now = time.monotonic()
        if bucket is None:
            bucket = self._buckets[sender] = TokenBucket(PUB_RATE, PUB_BURST, now)
            if len(self._buckets) > MAX_SENDERS:
                self._buckets.popitem(last=False)
        return bucket.take(now)

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer whose publications are indexed (`GlobalIndex.pin`: the first one
        heard, or the first a proposer session of this drafter was opened for)."""
        return self.index.tokenizer

    def _take(self, tokenizer: str, docs) -> None:
        first = self.index.tokenizer is None
        if not self.index.pin(tokenizer):
            self.counters.inc("foreign", len(docs))
            return
        if first:
            log.info("suffix index: indexing the publications of tokenizer %s", tokenizer)
        try:  # one queue item per publication or snapshot
            self._queue.put_nowait([(np.array(t, dtype=np.int32), int(st), h or None)
                                    for t, st, h in docs])
        except queue.Full:
            self.counters.inc("queue_full")

    def _ask_again(self, verifier: str) -> None:
        """I/O thread: forget that `verifier` was asked, and ask (it, or another)."""
        self._asked.discard(verifier)
        self._ask_snapshots()

    def _on_member_event(self, ev) -> None:
        """Events thread: a verifier joined: maybe ask it for a snapshot (on the I/O thread)."""
        if ev.kind == "join" and "verifier" in ev.member.card.roles:
            self._node.loop.call_soon(self._ask_snapshots)

    def _ask_snapshots(self) -> None:
        """Ask up to `SNAPSHOT_FROM` verifiers, once each (again after a busy answer, up to
        `SNAPSHOT_TRIES` in all), for their recent publications."""
        node = self._node
        for m in node.membership.workers():
            if len(self._asked) >= SNAPSHOT_FROM:
                return
            if "verifier" not in m.card.roles or m.node_id in self._asked:
                continue
            if self.tokenizer is not None and m.card.tokenizer != self.tokenizer:
                continue
            self._asked.add(m.node_id)
            self._tries[m.node_id] += 1
            node.client.request(m.card.endpoints["stream"],
                                SuffixSnapshotReq(node.config.cluster).to_message(),
                                timeout=10.0,
                                on_reply=lambda call, reply, v=m.node_id:
                                self._on_snapshot(call, reply, v))

    def _on_snapshot(self, call: Call, reply: Message | BusError, verifier: str = "") -> None:
        if isinstance(reply, RemoteError) and reply.code == BUSY \
                and self._tries[verifier] < SNAPSHOT_TRIES:
            # over the verifier's snapshot rate (others starting too): ask it again later
            self._node.loop.call_later(SNAPSHOT_RETRY_S, lambda: self._ask_again(verifier))
            return
        if isinstance(reply, BusError) or reply.type != "suffix_snapshot":
            log.debug("no suffix snapshot from %s: %s", call.endpoint, reply)
            return
        try:
            snap = SuffixSnapshot.from_message(reply)
        except CodecError as exc:
            self.counters.inc("malformed")
            log.debug("dropped a malformed suffix snapshot from %s: %s", call.endpoint, exc)
            return
        self.counters.inc("snapshots")
        hashes = snap.prompt_hashes or ("",) * len(snap.lengths)
        self._take(snap.tokenizer, [(t, st, h) for (t, st), h in
                                    zip(snap.docs, hashes, strict=True)])
