"""What a generation is between steps: its parameters, its state, what a step hands back.

Why a module of its own: the engine's parts (`scheduler`, `planner`, `settle`, and `core`, which
runs them) all read and write one `SequenceState`; holding it here lets each part import it
without importing the engine that assembles them (no cycle). Re-exported by `nodes.engine.core`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from nodes.engine.cost import CostModel
from nodes.engine.errors import BadRequestError
from nodes.engine.grammar import Constraint, GrammarMatcher
from nodes.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from nodes.engine.sampling import SamplingParams, check_sampling
from nodes.engine.sources import DraftSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    #: None: the tokenizer's EOS; an empty set: never stop on EOS
    eos_token_ids: frozenset[int] | None = None
    #: None: no log probabilities; N >= 0: each committed token's and its N most likely
    #: alternatives' (`Block.logprobs`)
    logprobs: int | None = None
    #: None: free text; else what every committed token must keep matching (a JSON schema, a
    #: regex, a Lark grammar: `nodes.engine.grammar`), applied to the verifier's own logits
    constraint: Constraint | None = None
    #: a resumed generation: the prompt's last `resumed` tokens were generated already (under
    #: `constraint` and the penalties), so the grammar and the generated-token counts start
    #: after them (`Engine.start`)
    resumed: int = 0

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise BadRequestError(f"max tokens must be a positive integer, got {self.max_tokens}")
        check_sampling(self.sampling)
        if any(not s for s in self.stop):
            raise BadRequestError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequestError(f"logprobs must be 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.constraint is not None:
            self.constraint.check()
        if not isinstance(self.resumed, int) or self.resumed < 0:
            raise BadRequestError(f"resumed must be a non-negative integer, got {self.resumed}",
                                  "resumed")

    def seeded(self) -> GenerationParams:
        """These params with a seed drawn when they sample without one: the sequence's noise
        key, which the sources opened for it see too (a drafter drawing with the verifier's
        noise agrees with it: `sampling.position_noise`)."""
        sp = self.sampling.seeded()  # drawn there, the one place a seed is drawn
        return self if sp is self.sampling else replace(self, sampling=sp)


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
    logprobs: TokenLogprobs | None = None  # of `token_ids`, when the params ask for them
    #: positions this step fed the verifier for the sequence (prompt chunk, or tree nodes)
    fed: int = 0


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
    tree_blocks: int = 0  # speculative blocks whose draft was a branching tree
    waits: int = 0  # steps that waited for a source's announced drafts (the cost model's call)
    waited_s: float = 0.0
    k_hist: dict[int, int] = field(default_factory=dict)
    #: prompt positions taken from the prefix cache instead of prefilled (`PrefixCache`)
    reused: int = 0
    #: [i]: speculative blocks whose draft token at depth i (0: the first) was accepted; vLLM's
    #: `spec_decode_num_accepted_tokens_per_pos` (sum == `accepted`)
    accepted_per_pos: list[int] = field(default_factory=list)

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
            "tree_blocks": self.tree_blocks,
            "waits": self.waits,
            "waited_s": self.waited_s,
            "reused": self.reused,
            "accepted_per_pos": list(self.accepted_per_pos),
        }


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    elapsed_s: float
    stats: Stats

    @property
    def tok_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0



@dataclass
class Slot:
    source: DraftSource
    name: str
    owned: bool  # opened by the engine (closed with the sequence); else the caller's
    asked: bool = False  # proposed this step (gets feedback on its offer)
    offered: int = 0
    tag: int = -1  # this step's source index in the tree's owner sets
    budget: int = 0  # draft tokens asked of it this step
    #: the depth its deepest draft kept after the grammar cut a token it refused (None: not
    #: cut this step): a known miss for its record (`DraftPlanner.observe`)
    refused_at: int | None = None
    columns: list[int] | None = None  # its hidden layers' places in the captured tensor
    #: the cost model's name for this step's drafts: `name`, or `name#class` when the source
    #: says what kind of draft it makes next (`DraftSource.draft_class`)
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or self.name


@dataclass
class SequenceState:
    """Everything one generation needs between steps (see the module docstring)."""

    prompt: list[int]
    params: GenerationParams
    eos: frozenset[int]
    #: the sampling noise's key: the request's seed, else one drawn for this sequence
    noise_seed: int
    cache: Any
    cost: CostModel
    stats: Stats
    slots: list[Slot]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: verifier layers captured for sources that read hidden states (None: no capture)
    hidden_layers: tuple[int, ...] | None = None
    #: prompt positions already in the cache while a chunked prefill runs (or reused)
    prefilled: int = 0
    #: prompt positions copied from the prefix cache at the start (the rest are prefilled)
    reused: int = 0
    #: the planned tree's node values and probe flags (greedy, adaptive plans; else None),
    #: what a batch trims its least valuable draft nodes by
    plan_values: list[float] | None = None
    plan_forced: list[bool] | None = None
    #: the grammar state of a constrained generation (`params.constraint`), following the
    #: committed tokens; None: unconstrained
    grammar: GrammarMatcher | None = None
    #: the logit controls' view of the committed tokens (`sampling.History`), kept up to date
    #: by `settle.history` when `params.sampling.adjusts_logits`; else None
    history: Any = None
    #: generated tokens `history` has counted
    history_len: int = 0

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def started(self) -> bool:
        return bool(self.generated)

    def close(self) -> None:
        """Release the sources the engine opened; safe to call twice."""
        slots, self.slots = self.slots, []
        for slot in slots:
            if slot.owned:
                close_quietly(slot.source)


def drop_source(seq: SequenceState, slot: Slot, what: str, exc: Exception) -> None:
    """A source that raised is left out for the rest of the generation (same output)."""
    log.warning("draft source %s %s, going on without it: %r", slot.name, what, exc)
    seq.stats.drafter_errors += 1
    seq.slots.remove(slot)
    if slot.owned:
        close_quietly(slot.source)


def close_quietly(source: DraftSource) -> None:
    try:
        source.close()
    except Exception as exc:  # noqa: BLE001 - already failing or finished; best effort
        log.debug("closing a draft source: %r", exc)
