"""Log probabilities as a generation receives them, over every verifier that served it.

The verifier sends, with each `token_chunk` asked for them, every token's log probability and
its N most likely alternatives' (docs/protocol.md); the cluster client keeps them beside the
token ids, so a resumed generation has them for its whole text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ReceivedLogprobs:
    """Token ids with their log probabilities and alternatives, as received (accumulated
    over a generation, or one chunk's worth)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def add(self, ids, logprobs, top_ids, top_logprobs, top_n: int) -> None:
        n = len(ids)
        self.ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in logprobs]
        tops = np.asarray(top_ids).reshape(n, top_n) if top_n else np.zeros((n, 0), int)
        vals = np.asarray(top_logprobs).reshape(n, top_n) if top_n else np.zeros((n, 0))
        self.top_ids += [[int(t) for t in row] for row in tops]
        self.top_logprobs += [[float(x) for x in row] for row in vals]

    def head(self, n: int) -> ReceivedLogprobs:
        return ReceivedLogprobs(self.ids[:n], self.logprobs[:n], self.top_ids[:n],
                             self.top_logprobs[:n])

    def __len__(self) -> int:
        return len(self.ids)

    def cut_to(self, tok, text: str) -> ReceivedLogprobs:
        """The tokens whose bytes start inside `text` (a stop string cut the text short)."""
        room, n = len(text.encode("utf-8")), 0
        for raw in tok.token_bytes(self.ids):
            if room <= 0:
                break
            room -= len(raw)
            n += 1
        return self.head(n)
