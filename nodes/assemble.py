"""Build a node's roles from its command line: load models, measure speed, fill the card.

Heavy work (loading and exporting models, quantising) happens here, before the node joins, so
its first card already carries the tokenizer fingerprint and measured speed. An `ngram`-only
proposer loads no model at all (and never imports torch).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from nodes.engine.errors import BadRequestError
from nodes.node_common.host import RoleHost

log = logging.getLogger(__name__)

WARMUP_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
#: the batch a verifier times at start-up for its batch curve (`Engine.learn_batch_cost`;
#: larger batches extrapolate from it): about 1 s on SmolLM2 on one CPU core
LEARN_BATCH = 8
#: a verifier's prefix cache by default: about 5,800 positions of SmolLM2-135M's K/V (46 KB
#: each), i.e. dozens of chat prompts or a few long conversations
DEFAULT_PREFIX_CACHE_MB = 256


#: a proposer's drafter when none is named: the suffix drafter. It drafts what ngram drafts from
#: the session's own text (the same forwards on single requests) and, besides, from every
#: answer the cluster's verifiers published; model-free like ngram (docs/benchmarks.md,
#: "Suffix or ngram behind a proposer")
DEFAULT_PROPOSER_DRAFTER = "suffix"


@dataclass
class RoleSpec:
    roles: tuple[str, ...]
    model: str | None = None  # None: the embedded default
    backend: str = "torch"
    #: the verifier's weights (nodes/backends/weights.py): fp32 (the reference mode, identical
    #: to HF), q8 / q4 / file (the quantized forward), or auto
    weights: str = "fp32"
    #: a verifier's bounded K/V (`--kv-sink S --kv-window W`: torch_backend.bound_kv), or None
    kv_sink: int | None = None
    kv_window: int | None = None
    drafter: str = DEFAULT_PROPOSER_DRAFTER  # the proposer's drafter (or a verifier's own)
    max_draft: int = 16
    #: a proposer's candidates per drafted position (None: the drafter's default; 1: chains)
    tree_width: int | None = None
    lease_s: float = 30.0  # draft-session lease a verifier asks proposers for
    threads: int = 0  # torch intra-op threads (0: torch's default)
    #: longest context served: a verifier's prompt + max_tokens, a proposer's session
    #: (0: the model's context; 8192 for a model-less proposer (suffix, ngram))
    max_context: int = 0
    #: an already-built verifier backend (a sharded pipeline's rank 0) instead of loading one
    prebuilt: Any = None
    #: what a verifier publishes for the cluster's suffix drafters: output, prompts, off
    share: str = "output"
    #: the model's name on the card (`/v1/models`, `members`); "": derived from `model`
    served_name: str = ""
    #: generations a verifier steps together (one forward per step; 1: one at a time; the
    #: node's `--max-batch` defaults to 8)
    max_batch: int = 1
    #: a torch verifier runs its batches one sequence at a time: each sequence's logits bit
    #: for bit its solo ones (docs/engine.md, "Batching"), at the cost of the batching gain
    batch_invariant: bool = False
    #: a verifier prefills prompts longer than this in chunks of it, one per step (0: whole)
    prefill_chunk: int = 0
    #: MiB of finished sequences' K/V a verifier keeps for prompts that start the same way
    #: (`nodes/engine/prefix_cache.py`; 0: off)
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB


@dataclass
class Roles:
    """The assembled roles and what they add to the node's card."""

    verifier: Any = None
    proposer: Any = None
    card: dict[str, Any] = field(default_factory=dict)
    publisher: Any = None  # a verifier's side of the shared suffix index
    subscriber: Any = None  # a suffix proposer's side

    def attach(self, node: RoleHost) -> None:
        for role in (self.verifier, self.proposer, self.publisher, self.subscriber):
            if role is not None:
                role.attach(node)

    def start(self) -> None:
        """After the node has joined (subscriptions need its gossip channel and members)."""
        if self.subscriber is not None:
            self.subscriber.start()

    def close(self) -> None:
        for role in (self.subscriber, self.proposer, self.verifier):
            if role is not None:
                role.close()

    def telemetry(self) -> dict[str, Any]:
        """I/O thread: reads only counters and the verifier's published link snapshot (the
        links themselves belong to its compute thread)."""
        out: dict[str, Any] = {}
        if self.verifier is not None:
            v = self.verifier
            out["verifier"] = {
                "generations": v.stats.generations, "tokens": v.stats.tokens,
                "tok_s": round(v.stats.last_tok_s, 3), "active": v.active, "queued": v.queued,
                "max_batch": v.max_batch, "steps": v.stats.steps, "stepped": v.stats.stepped,
                "rows": v.stats.rows, "committed": v.stats.committed,
                "reused": v.stats.reused,
                "acceptance": round(v.stats.last_acceptance, 4),
                # cumulative since it started, every client's (issue 47)
                "drafted": v.stats.drafted, "accepted": v.stats.accepted,
                "acceptance_cumulative": round(v.stats.acceptance_cumulative, 4),
                **v.admission.snapshot(),  # rejected_busy, orphans_dropped (I/O thread)
                "proposers": dict(v.proposer_snapshot),
            }
        if self.proposer is not None:
            out["proposer"] = {"sessions_open": self.proposer.open_sessions,
                               "session_bytes": self.proposer.session_bytes,
                               "sessions_evicted": self.proposer.sessions_evicted,
                               **self.proposer.stats.as_dict()}
            # the worker's errors and the I/O thread's refused input, each counted by its own
            out["proposer"]["errors"] += self.proposer.input_errors.snapshot()["input_errors"]
            if self.subscriber is not None:
                out["proposer"]["suffix_index"] = self.subscriber.stats()
        if self.publisher is not None and "verifier" in out:
            out["verifier"]["suffix_published"] = self.publisher.published
            out["verifier"]["suffix_snapshots_refused"] = self.publisher.snapshots_refused
        return out


def assemble(spec: RoleSpec) -> Roles:
    """Load models and build the roles named in `spec` (slow: seconds to a minute)."""
    roles = Roles()
    if spec.threads < 0:
        raise BadRequestError(f"--threads must be >= 0, got {spec.threads}")
    if spec.max_batch < 1:
        raise BadRequestError(f"--max-batch must be >= 1, got {spec.max_batch}")
    if spec.prefix_cache_mb < 0:
        raise BadRequestError(f"--prefix-cache-mb must be >= 0, got {spec.prefix_cache_mb}")
    if spec.prefill_chunk < 0:
        raise BadRequestError(f"--prefill-chunk must be >= 0, got {spec.prefill_chunk}")
    if spec.max_context < 0:
        raise BadRequestError(f"--max-context must be >= 0, got {spec.max_context}")
    # an eagle head is shaped by its verifier's model (embedding, widths): a proposer serving
    # one loads that model too
    eagle = spec.drafter == "eagle" or spec.drafter.startswith("eagle:")
    loads_torch = spec.backend == "torch" and (
        "verifier" in spec.roles or spec.drafter == "int8" or spec.drafter.startswith("model:")
        or eagle)
    if spec.threads and loads_torch:
        import torch

        torch.set_num_threads(spec.threads)
    needs_model = "verifier" in spec.roles or spec.drafter == "int8" or eagle
    backend = None
    if needs_model:
        from nodes.backends.registry import load_backend

        t0 = time.perf_counter()
        backend = spec.prebuilt or load_backend(
            spec.backend, spec.model,
            **({"weights": spec.weights} if "verifier" in spec.roles and spec.weights != "fp32"
               else {}))
        log.info("loaded %s on %s in %.1fs", backend.model_name, backend.name,
                 time.perf_counter() - t0)
        if "verifier" in spec.roles:
            _bound_kv(backend, spec.kv_sink, spec.kv_window)
        from nodes.models import served_name

        roles.card.update(backend=backend.name,
                          model=spec.served_name or served_name(backend.model_name),
                          tokenizer=backend.fingerprint, vocab=backend.vocab_size)

    drafter = None
    if "proposer" in spec.roles or ("verifier" in spec.roles and spec.drafter != "none"):
        drafter = _make_drafter(spec.drafter, backend, spec.backend)

    if "verifier" in spec.roles:
        from nodes.engine.core import Engine
        from nodes.verifier.role import VerifierRole

        # the verifier's own drafter is its fallback when no proposer is around
        local = drafter if "proposer" not in spec.roles else None
        engine = Engine(backend, local, max_draft=spec.max_draft,
                        prefill_chunk=spec.prefill_chunk or None)
        roles.card["tok_s"] = round(_measure_plain(engine), 2)
        if spec.batch_invariant:
            backend.batch_invariant = True  # the base Backend runs one at a time anyway
        engine.learn_batch_cost(backend.tokenizer.encode(WARMUP_PROMPT, chat=False),
                                min(spec.max_batch, LEARN_BATCH))
        engine.prefix_cache = _prefix_cache(backend, spec)  # after the warm-ups: not theirs
        # protocol 2: drafts stream in ahead and are never waited for (but with draft='force')
        roles.verifier = VerifierRole(engine, lease_s=spec.lease_s,
                                      max_context=spec.max_context, max_batch=spec.max_batch)
        # what one connection may have queued or running here: cluster clients and gateways
        # keep at most that many in flight on this verifier and queue the rest themselves
        roles.card.setdefault("extras", {}).update(
            max_batch=spec.max_batch, per_client=roles.verifier.slots.per_peer,
            weights=getattr(backend, "weights", "fp32").split(" ", 1)[0])
        if getattr(backend, "kv_bound", None):  # --kv-sink/--kv-window: [sink, window]
            from nodes.backends.kv_bound import POSITIONS

            roles.card["extras"].update(kv_bound=list(backend.kv_bound), kv_positions=POSITIONS)
        if spec.share != "off":
            from nodes.node_common.suffix_share import Publisher

            roles.publisher = Publisher(spec.share, backend.fingerprint)
            roles.verifier.on_finished = roles.publisher.publish

    if "proposer" in spec.roles:
        from nodes.proposer.role import ProposerRole
        from nodes.verifier.role import ANY_TOKENIZER

        if drafter is None:
            raise BadRequestError("a proposer needs a drafter: ngram, suffix, int8, eagle or "
                                  "model:<ref>")
        own = getattr(drafter, "backend", None) or backend  # a model drafter's own model
        vocab = own.vocab_size if own is not None else 0
        from nodes.node_common.requests import model_context

        context = spec.max_context or (model_context(own) if own is not None else 0)
        roles.proposer = ProposerRole(drafter, vocab_size=vocab,
                                      max_context=context, tree_width=spec.tree_width)
        index = getattr(drafter, "index", None)
        if callable(getattr(index, "add", None)):  # a drafter with a global index (suffix)
            from nodes.node_common.suffix_share import Subscriber

            roles.subscriber = Subscriber(index)
        if drafter.fingerprint is None:
            roles.card.setdefault("tokenizer", ANY_TOKENIZER)
        else:
            roles.card["tokenizer"] = drafter.fingerprint
            roles.card["vocab"] = vocab
            roles.card.setdefault("backend", own.name)
            roles.card.setdefault("model", own.model_name)
        roles.card.setdefault("extras", {}).update(
            drafter=drafter.name, draft_tok_s=round(_measure_draft(drafter), 1))
        if drafter.takes_grammar:  # verifiers send a constrained generation's grammar
            roles.card["extras"]["grammar"] = True
        if drafter.hidden_layers:  # an EAGLE-3 head: verifiers send their hidden states
            roles.card["extras"].update(hidden_layers=list(drafter.hidden_layers),
                                        hidden_size=drafter.hidden_size)
        if "verifier" not in spec.roles and backend is None:
            roles.card.setdefault("backend", "none")
    return roles


def return_freed_memory() -> None:
    """Hand the heap freed while building back to the OS (glibc's `malloc_trim`; a no-op
    without glibc). Why: glibc keeps freed memory mapped, so a node stayed at its build peak: an
    int8 proposer, which drops the fp32 model and the smoothed copy once quantised, held
    1.8 GiB for a 135M model instead of 1.1 GiB (`make demo`'s monitor)."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim(0)


def _bound_kv(backend: Any, sink: int | None, window: int | None) -> None:
    """Apply `--kv-sink/--kv-window` to a verifier's backend (a clear error from a backend
    without a bounded mode; torch and MLX have one)."""
    if sink is None and window is None:
        return
    from nodes.engine.errors import BadRequestError

    if not hasattr(backend, "bound_kv"):
        raise BadRequestError(f"--kv-sink/--kv-window: the {backend.name} backend has no "
                              "bounded K/V mode (the torch backend has)")
    backend.bound_kv(sink, window)


def _prefix_cache(backend: Any, spec: RoleSpec) -> Any:
    """The verifier's prefix cache, or None: turned off, `--batch-invariant` (it would break
    that mode's bit-for-bit promise, so the engine would never use it), or a backend that
    cannot copy cache prefixes (MLX, a sharded verifier)."""
    if not spec.prefix_cache_mb or spec.batch_invariant:
        return None
    if not getattr(backend, "supports_prefix_copy", False):
        log.info("backend %s keeps no prefix cache (it cannot copy cache prefixes)",
                 backend.name)
        return None
    from nodes.engine.prefix_cache import PrefixCache

    return PrefixCache(backend, spec.prefix_cache_mb << 20)


def _make_drafter(name: str, backend, backend_name: str):
    """A drafter by name; `model:<ref>` loads its own model on this node's backend."""
    if name.startswith("model:") and len(name) > len("model:"):
        from nodes.backends.registry import load_backend
        from nodes.drafters.model import ModelDrafter

        return ModelDrafter(load_backend(backend_name, name[len("model:"):]))
    from nodes.drafters.registry import make_drafter

    return make_drafter(name, backend)


def _measure_plain(engine) -> float:
    """Plain greedy tok/s over a short fixed generation (also warms the model up)."""
    from nodes.engine.core import GenerationParams

    ids = engine.backend.tokenizer.encode(WARMUP_PROMPT, chat=False)
    plain = type(engine)(engine.backend, None)
    params = GenerationParams(max_tokens=8, eos_token_ids=frozenset())
    plain.generate(ids, params)  # first forwards are cold (allocation, kernel selection)
    return plain.generate(ids, params).tok_per_s


def _measure_draft(drafter) -> float:
    """Draft tokens per second of this drafter on a repetitive text (warms it up too): its
    drafting past a prompt already fed (`DraftState.warm`, as a session's open does), which is
    what drafting ahead costs and what the card's `draft_tok_s` tells verifiers (a slower one
    than their commits is never asked, docs/engine/cost-model.md). Why the warm: timed with the
    prompt's prefill inside, an int8 drafter read 11 tok/s where it drafts 20-35."""
    from nodes.engine.sampling import SamplingParams

    ids = list(range(1, 40)) * 3
    rate = 0.0
    for _ in range(2):  # the first draft is cold
        session = drafter.open(ids, SamplingParams())
        try:
            session.warm()
            t0 = time.perf_counter()
            out, _ = session.draft(8)
            dt = time.perf_counter() - t0
        finally:
            session.close()
        rate = len(out) / dt if dt > 0 and len(out) else 0.0
    return rate
