"""Turn streamed token text into what the client may see: stop strings cut, nothing taken back.

The verifier cuts its output at a stop string, but a stop string can straddle two blocks, and
after a failover the new verifier only sees its own part of the text. So the cluster client
(core.py) has the final say: it holds back any tail that could still grow into a stop string
(or that ends in half of a multi-byte character), cuts at the earliest stop string over the
whole text, and never emits a character it would have to retract.
"""

from __future__ import annotations


class TextAssembler:
    """Feed it the full text so far (`update`); read the next piece the client may see."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # full text so far, cut at a stop string once one is found
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found (the generation is over)

    def update(self, text: str) -> str:
        """Set the full text so far; returns the new piece that is safe to emit."""
        if self.stopped:
            return ""
        cut = self._find_stop(text)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text))
        self.text = text
        safe = len(text) - self._held_back(text)
        return self._take(safe)

    def finish(self, final_text: str | None = None) -> str:
        """The generation ended: emit whatever is left (`final_text` overrides the text)."""
        if final_text is not None and not self.stopped:
            cut = self._find_stop(final_text)
            self.text = final_text if cut is None else final_text[:cut]
            self.stopped = cut is not None
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted:upto]
        self.emitted = upto
        return piece

    def _find_stop(self, text: str) -> int | None:
        hits = [p for p in (text.find(s, max(0, self.emitted - len(s) + 1)) for s in self.stop)
                if p >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Characters at the end of `text` that must wait: a partial stop string or a
        replacement character (half of a multi-byte character decoded alone)."""
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        if text.endswith("\ufffd"):
            hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
        return hold
