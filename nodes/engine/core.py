"""The speculative-decoding loop: one verifier forward per block, exact acceptance, KV rollback.

Invariant between blocks: the verifier cache holds every committed token except the last one
(the *pending* token, whose logits are not computed yet). A block feeds `[pending, d1..dk]`,
reads k+1 logits rows, accepts the longest correct draft prefix, takes the correction (or bonus)
token from the first non-accepted row, and crops the cache back so the invariant holds again.
No second forward is ever needed. k = 0 (or an empty draft) is a plain decode step, which is
how a slow, absent or unhelpful drafter degrades to decoding alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from nodes.engine.adaptive import DraftLengthController
from nodes.engine.errors import BadRequestError
from nodes.engine.sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampling,
    probs_from_logits,
    sample,
)

if TYPE_CHECKING:
    from nodes.backends.base import Backend
    from nodes.drafters.base import Drafter, DraftSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    #: None: the tokenizer's EOS; an empty set: never stop on EOS
    eos_token_ids: frozenset[int] | None = None

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise BadRequestError(f"max tokens must be a positive integer, got {self.max_tokens}")
        self.sampling.validate()
        if any(not s for s in self.stop):
            raise BadRequestError("stop strings must be non-empty")


@dataclass
class Block:
    """What one engine step committed; the stream's last block has `finish_reason` set."""

    token_ids: list[int]
    drafted: int  # draft tokens verified in this block (0: plain step / prefill)
    accepted: int
    committed_len: int  # prompt + generated after this block
    cache_len: int  # verifier cache positions after this block (== committed_len - 1)
    finish_reason: str | None = None  # "eos" | "length" | "stop"
    text: str | None = None  # full generated text so far, truncated at a stop string


@dataclass
class Stats:
    blocks: int = 0
    spec_blocks: int = 0
    plain_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_s: float = 0.0
    draft_s: float = 0.0
    drafter_errors: int = 0
    k_hist: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """Fraction of verified draft tokens that were accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Mean accepted draft tokens per speculative block."""
        return self.accepted / self.spec_blocks if self.spec_blocks else 0.0

    def as_dict(self) -> dict:
        return {
            "blocks": self.blocks,
            "spec_blocks": self.spec_blocks,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.acceptance,
            "mean_accepted_len": self.mean_accepted_len,
            "verify_s": self.verify_s,
            "draft_s": self.draft_s,
            "drafter_errors": self.drafter_errors,
        }


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    elapsed_s: float
    stats: Stats

    @property
    def tok_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Engine:
    """Verifier backend + optional drafter. One generation at a time per engine instance.

    `fixed_k` disables adaptation (tests); otherwise the engine's `DraftLengthController` picks
    each block's draft length; the costs it learnt carry over to the next generation on this
    engine, acceptance starts afresh with each prompt.
    """

    def __init__(
        self,
        backend: Backend,
        drafter: Drafter | None = None,
        *,
        max_draft: int = 16,
        fixed_k: int | None = None,
    ) -> None:
        if drafter is not None:
            drafter.check_compatible(backend.fingerprint)
        if max_draft < 1:
            raise BadRequestError(f"max draft length must be >= 1, got {max_draft}")
        self.backend = backend
        self.drafter = drafter
        self.max_draft = max_draft
        self.fixed_k = fixed_k
        self.controller = DraftLengthController(max_k=max_draft)

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: GenerationParams) -> Generation:
        """Run a whole generation and collect it."""
        from nodes.engine.local import generate_text

        return generate_text(self, list(prompt_ids), params)

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        *,
        stats: Stats | None = None,
        draft_session: DraftSession | None = None,
    ) -> Iterator[Block]:
        """Yield committed tokens block by block, so callers can stream them as they land.

        `draft_session` lets a caller plug in its own session (e.g. a remote proposer with a
        deadline) instead of opening one on `self.drafter`.
        """
        prompt = self._check_prompt(prompt_ids)
        params.validate()
        stats = stats if stats is not None else Stats()
        eos = (
            self.backend.tokenizer.eos_token_ids
            if params.eos_token_ids is None
            else frozenset(params.eos_token_ids)
        )
        sp = params.sampling
        rng = np.random.default_rng(sp.seed)
        backend = self.backend
        cache = backend.new_cache()
        generated: list[int] = []

        session = draft_session
        if session is None and self.drafter is not None:
            session = self.drafter.open(prompt, sp)
        told = len(prompt)  # tokens the drafter knows about
        if self.fixed_k is None:
            self.controller.start_generation()

        try:
            t0 = time.perf_counter()
            row = backend.prefill(cache, prompt)
            stats.verify_s += time.perf_counter() - t0
            first = int(np.argmax(row)) if sp.greedy else sample(probs_from_logits(row, sp)[0], rng)
            new = [first]
            drafted = accepted = 0
            while True:
                new, finish, text = self._finish(generated, new, params, eos)
                generated.extend(new)
                stats.blocks += 1
                committed = len(prompt) + len(generated)
                # roll back rejected (or cut-off) drafts: keep all committed but the pending one
                backend.crop(cache, committed - 1)
                yield Block(
                    token_ids=new,
                    drafted=drafted,
                    accepted=accepted,
                    committed_len=committed,
                    cache_len=backend.cache_length(cache),
                    finish_reason=finish,
                    text=text,
                )
                if finish is not None:
                    return
                pending = generated[-1]
                remaining = params.max_tokens - len(generated)
                delta = generated[told - len(prompt) :]
                try:
                    drafts, probs = self._ask(session, delta, remaining, stats)
                except Exception as exc:  # noqa: BLE001 - a broken drafter must not end generation
                    log.warning("drafter failed, decoding alone from here on: %r", exc)
                    stats.drafter_errors += 1
                    if draft_session is None and session is not None:
                        _close_quietly(session)
                    session = draft_session = None
                    drafts, probs = np.zeros(0, dtype=np.int64), None
                told = len(prompt) + len(generated)
                drafted = len(drafts)

                t0 = time.perf_counter()
                logits = backend.forward(cache, [pending, *drafts.tolist()])
                dt = time.perf_counter() - t0
                stats.verify_s += dt
                if self.fixed_k is None:
                    self.controller.record_verify(drafted + 1, dt)
                if sp.greedy:
                    accepted, nxt = accept_greedy(logits, drafts)
                else:
                    accepted, nxt = accept_sampling(logits, drafts, probs, sp, rng)
                new = [*drafts[:accepted].tolist(), nxt]
                if drafted:
                    stats.spec_blocks += 1
                    stats.drafted += drafted
                    stats.accepted += accepted
                    if self.fixed_k is None:
                        self.controller.record_acceptance(drafted, accepted)
                else:
                    stats.plain_steps += 1
        finally:
            if session is not None and draft_session is None:
                session.close()

    # ---- helpers ----------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise BadRequestError("empty prompt: need at least one token")
        bad = [t for t in prompt if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise BadRequestError(f"prompt token id {bad[0]} outside vocabulary")
        return prompt

    def _ask(
        self,
        session: DraftSession | None,
        delta: list[int],
        remaining: int,
        stats: Stats,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Tell the drafter what was committed and ask for drafts; never more than fit."""
        empty = np.zeros(0, dtype=np.int64)
        if session is None:
            return empty, None
        k = self.fixed_k if self.fixed_k is not None else self.controller.choose_k()
        k = min(k, self.max_draft, remaining - 1)
        t0 = time.perf_counter()
        session.extend(delta)
        if k <= 0:
            return empty, None
        ids, probs = session.draft(k)
        dt = time.perf_counter() - t0
        stats.draft_s += dt
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)[:k]
        # a hostile or buggy drafter must not break the verifier: cut at the first bad id
        bad = np.nonzero((ids < 0) | (ids >= self.backend.vocab_size))[0]
        if bad.size:
            ids = ids[: bad[0]]
        if probs is not None:
            probs = np.asarray(probs)
            if (
                probs.ndim != 2
                or probs.shape[0] < len(ids)
                or probs.shape[1] < self.backend.vocab_size
            ):
                probs = None  # unusable: treat drafts as deterministic
            else:
                probs = probs[: len(ids), : self.backend.vocab_size]
        if self.fixed_k is None:
            self.controller.record_draft(len(ids), dt)
        stats.k_hist[len(ids)] = stats.k_hist.get(len(ids), 0) + 1
        return ids, probs

    def _finish(
        self,
        generated: list[int],
        new: list[int],
        params: GenerationParams,
        eos: frozenset[int],
    ) -> tuple[list[int], str | None, str | None]:
        """Cut a block's new tokens at EOS, max tokens or a stop string; say why it ended."""
        finish = None
        for i, t in enumerate(new):
            if t in eos:
                new, finish = new[: i + 1], "eos"
                break
        room = params.max_tokens - len(generated)
        if len(new) > room:
            new, finish = new[:room], "length"
        elif len(new) == room and finish is None:
            finish = "length"
        if not params.stop:
            return new, finish, None
        decode = self.backend.tokenizer.decode
        for i in range(len(new)):
            text = decode(generated + new[: i + 1])
            cut = min((p for p in (text.find(s) for s in params.stop) if p >= 0), default=-1)
            if cut >= 0:
                return new[: i + 1], "stop", text[:cut]
        return new, finish, decode(generated + new) if finish else None


def _close_quietly(session: DraftSession) -> None:
    try:
        session.close()
    except Exception as exc:  # noqa: BLE001 - already failing; closing is best effort
        log.debug("closing a failed draft session: %r", exc)
