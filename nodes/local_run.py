"""Verifier and drafter in one process: the reusable core of `specbus generate --local`.

Kept apart from the CLI so the benchmarks can reuse the same loading, prompt encoding and
result shape; kept out of nodes/engine because it loads backends and drafters, which the
engine itself never imports.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodes.backends.kv_bound import POSITIONS
from nodes.engine.core import Engine, GenerationResult
from nodes.engine.errors import BadRequestError


@dataclass(frozen=True)
class LocalConfig:
    model: str | None = None  # alias, folder or cached HF repo id; None: embedded default
    backend: str = "torch"
    drafter: str | None = "ngram"  # none | ngram | int8 | model:<ref>
    max_draft: int = 16
    weights: str = "fp32"  # the verifier's weights (nodes/backends/weights.py)
    kv_sink: int | None = None  # bounded K/V (--kv-sink/--kv-window), both or neither
    kv_window: int | None = None


def load_engine(cfg: LocalConfig) -> Engine:
    """Load the verifier backend and the drafter (heavy: imports torch or mlx)."""
    from nodes.backends.registry import load_backend
    from nodes.drafters.registry import make_drafter

    backend = load_backend(cfg.backend, cfg.model,
                           **({"weights": cfg.weights} if cfg.weights != "fp32" else {}))
    if cfg.kv_sink is not None or cfg.kv_window is not None:
        from nodes.assemble import _bound_kv

        _bound_kv(backend, cfg.kv_sink, cfg.kv_window)
    drafter = make_drafter(cfg.drafter, backend)
    return Engine(backend, drafter, max_draft=cfg.max_draft)


def encode_prompt(engine: Engine, prompt: str, chat: bool = True, system: str | None = None):
    """Prompt text -> token ids, through the chat template when asked and available."""
    if not prompt or not prompt.strip():
        raise BadRequestError("empty prompt")
    return engine.backend.tokenizer.encode(prompt, chat=chat, system=system)


def result_dict(engine: Engine, gen: GenerationResult) -> dict:
    """The JSON shape of `specbus generate --json`."""
    s = gen.stats
    return {
        "text": gen.text,
        "token_ids": gen.token_ids,
        "tokens": engine.backend.tokenizer.token_strings(gen.token_ids),
        "finish_reason": gen.finish_reason,
        "prompt_tokens": len(gen.prompt_ids),
        "elapsed_s": round(gen.elapsed_s, 4),
        "tok_per_s": round(gen.tok_per_s, 3),
        "acceptance": round(s.acceptance, 4),
        "mean_accepted_len": round(s.mean_accepted_len, 4),
        "drafted": s.drafted,
        "accepted": s.accepted,
        "blocks": s.blocks,
        "spec_blocks": s.spec_blocks,
        "plain_steps": s.plain_steps,
        "model": engine.backend.model_name,
        "backend": engine.backend.name,
        "drafter": engine.drafter.name if engine.drafter is not None else "none",
        #: the verifier's K/V buffers at the end (bytes; None where the backend says not)
        "kv_bytes": getattr(engine.backend, "last_kv_bytes", None),
        "kv_bound": list(getattr(engine.backend, "kv_bound", None) or []) or None,
        #: where the bound puts its sinks (`kv_bound.POSITIONS`); None without a bound
        "kv_positions": POSITIONS if getattr(engine.backend, "kv_bound", None) else None,
    }
