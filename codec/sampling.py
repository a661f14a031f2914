"""`SamplingParams`: the sampling settings, declared once for every layer.

The CLI, the cluster client, the gateway, the wire (`generate_req` carries them flat,
`session_open` as a `sampling` map) and the engine all hold this one type, so nothing converts
between sampling types and there is one range check: `check()`. It runs where settings enter
the system: a message built or received (`codec.structs`), the gateway's parse, the engine's
`GenerationParams.validate` (which reports it as the engine's own `BadRequestError`).
Construction does not check, so the engine's own defaults cost nothing.
"""

from __future__ import annotations

from codec.declare import Record, integer, number, record

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 24
MAX_SEED = 2**63 - 1


@record
class SamplingParams(Record):
    """temperature 0 is greedy; top_k 0 and top_p 1 are "off"; seed None: a fresh one."""

    temperature: float = number(0.0, MAX_TEMPERATURE, default=0.0)
    top_p: float = number(0.0, 1.0, lo_open=True, default=1.0)
    top_k: int = integer(0, MAX_TOP_K, default=0)
    seed: int | None = integer(0, MAX_SEED, default=None)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0
