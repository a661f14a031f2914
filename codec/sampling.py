"""`SamplingParams`: the sampling settings, declared once for every layer.

The CLI, the cluster client, the gateway, the wire (`generate_req` carries them flat,
`session_open` as a `sampling` map) and the engine all hold this one type, so nothing converts
between sampling types and there is one range check: `check()`. It is called where settings
enter the system: a message built or received (`codec.structs`), the gateway's parse, the
engine's `GenerationParams.validate` (which reports it as the engine's own `BadRequestError`);
it runs once per record (`Record.check`: frozen, a record that passed is not checked again),
so an HTTP request's settings are range-checked once in the gateway and once where the wire
enters the verifier (issue 44; `tests/codec/test_params_path.py`). Construction does not
check, so the engine's own defaults cost nothing. A seed is drawn in one place: `seeded()`.

The logit controls after `seed` (`min_p`, the penalties, `logit_bias`) default to None ("off")
and are left off the wire when off, so every message without them keeps its bytes. What they
do is `nodes/engine/sampling.py`'s (`adjust_logits`, `probs_from_logits`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import MISSING as _MISSING
from dataclasses import replace
from typing import Any

from codec.declare import Record, Wire, _field, integer, number, record
from codec.errors import BadRequest
from codec.schema import MAP

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 24
MAX_SEED = 2**63 - 1
#: HF's repetition_penalty takes any value > 0; a bound keeps logits finite
MAX_REPETITION_PENALTY = 10.0
#: OpenAI's range for presence_penalty and frequency_penalty
MAX_PENALTY = 2.0
#: OpenAI's range for one logit_bias value
MAX_LOGIT_BIAS = 100.0
#: most tokens one request may bias (OpenAI's documented limit is 300)
MAX_LOGIT_BIAS_TOKENS = 300
#: token ids a bias may name on the wire (a verifier checks them against its vocabulary)
MAX_TOKEN_ID = 2**31 - 1


def _bias_check(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` in memory: ((token id, bias), ...) sorted by id, ids distinct."""
    if not isinstance(v, tuple | list):
        raise BadRequest(name, f"must be a map of token id to bias, got {type(v).__name__}")
    if len(v) > MAX_LOGIT_BIAS_TOKENS:
        raise BadRequest(name, f"biases at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(v)}")
    seen = set()
    for pair in v:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise BadRequest(name, "must be (token id, bias) pairs")
        tok, bias = pair
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok <= MAX_TOKEN_ID:
            raise BadRequest(name, f"token ids must be integers in 0..{MAX_TOKEN_ID}, "
                             f"got {str(tok)[:40]}")
        if tok in seen:
            raise BadRequest(name, f"token id {tok} given twice")
        seen.add(tok)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not (
                math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise BadRequest(name, f"bias of token {tok} must be in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {str(bias)[:40]}")
    return tuple(v)


def logit_bias_pairs(v: Mapping[Any, Any]) -> tuple[tuple[int, float], ...]:
    """A `{token id (decimal string or int): bias}` map (OpenAI's JSON, the wire's form) as
    `SamplingParams.logit_bias` holds it; BadRequest naming `logit_bias` on a bad key or value
    (the ranges are `check()`'s)."""
    out = []
    for k, b in v.items():
        if isinstance(k, str):
            if not k.isascii() or not k.isdigit() or len(k) > 10:
                raise BadRequest("logit_bias", f"keys must be token ids, got {k[:40]!r}")
            k = int(k)
        if isinstance(b, bool) or not isinstance(b, int | float):
            raise BadRequest("logit_bias", f"bias of token {k} must be a number")
        out.append((k, float(b)))
    return tuple(sorted(out, key=lambda p: p[0] if isinstance(p[0], int) else -1))


def _bias_decode(v: Any) -> Any:
    return logit_bias_pairs(v) if isinstance(v, Mapping) else v


def _bias_encode(v: Any) -> dict[str, float]:
    return {str(int(t)): float(b) for t, b in v}


def _logit_bias() -> Any:
    return _field(Wire("header", _bias_check, MAP, encode=_bias_encode, decode=_bias_decode),
                  None, _MISSING)


@record
class SamplingParams(Record):
    """temperature 0 is greedy; top_k 0 and top_p 1 are "off"; seed None: a fresh one; each
    logit control None (or its neutral value: min_p 0, penalties 0 / 1, no bias) is off."""

    temperature: float = number(0.0, MAX_TEMPERATURE, default=0.0)
    top_p: float = number(0.0, 1.0, lo_open=True, default=1.0)
    top_k: int = integer(0, MAX_TOP_K, default=0)
    seed: int | None = integer(0, MAX_SEED, default=None)
    #: drop tokens less likely than min_p times the most likely one (after temperature)
    min_p: float | None = number(0.0, 1.0, default=None)
    #: HF's: a seen token's logit (prompt or generated) divided by it if > 0, else multiplied
    repetition_penalty: float | None = number(0.0, MAX_REPETITION_PENALTY, lo_open=True,
                                              default=None)
    #: OpenAI's: minus this from the logit of every token generated so far
    presence_penalty: float | None = number(-MAX_PENALTY, MAX_PENALTY, default=None)
    #: OpenAI's: minus this times its count from the logit of every generated token
    frequency_penalty: float | None = number(-MAX_PENALTY, MAX_PENALTY, default=None)
    #: ((token id, bias), ...) added to those logits before anything else; a map on the wire
    logit_bias: tuple[tuple[int, float], ...] | None = _logit_bias()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def seeded(self) -> SamplingParams:
        """These settings with a seed drawn when they sample without one: the one place a
        seed is drawn (the engine's noise key, `GenerationParams.seeded`; the gateway's base
        seed of n choices). A drawn seed is in range, so settings already checked stay so."""
        if self.greedy or self.seed is not None:
            return self
        out = replace(self, seed=secrets.randbelow(MAX_SEED + 1))
        if self.__dict__.get("_checked"):
            object.__setattr__(out, "_checked", True)
        return out

    @property
    def adjusts_logits(self) -> bool:
        """Whether a position's logits depend on the history (penalties) or are biased: the
        verifier then applies `adjust_logits` at every position it checks."""
        return bool(self.logit_bias) or (self.repetition_penalty or 1.0) != 1.0 or bool(
            self.presence_penalty) or bool(self.frequency_penalty)
