"""A cluster client's own tokenizers: prompt token ids it knows, so a failover can resume
exactly (used by the gateway and the CLI's cluster client).

A verifier that dies mid-generation takes the prompt's token ids with it; to resume on another
verifier from "prompt + tokens streamed so far" the client must know those ids itself. It loads
the tokenizer (only the tokenizer, never the weights) of each model its verifiers serve, when the
model resolves locally (nodes/models.py, offline) and its fingerprint equals the one on the
verifiers' cards; then it sends token ids instead of text. Without one it sends the text (or chat
messages) as is, and a failed verifier ends the generation with an error instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)


class TokenizerCache:
    """Model name -> local tokenizer (or None when it cannot be had); thread-safe, loads once."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._loaded: dict[tuple[str, str], object | None] = {}

    def get(self, model: str, fingerprint: str):
        """The tokenizer of `model` if it matches `fingerprint`, else None (slow the first
        time: call it from a worker thread)."""
        if not self.enabled or not model or not fingerprint:
            return None
        key = (model, fingerprint)
        with self._lock:
            if key in self._loaded:
                return self._loaded[key]
            tok = self._load(model, fingerprint)
            self._loaded[key] = tok
            return tok

    @staticmethod
    def _load(model: str, fingerprint: str):
        from nodes import models
        from nodes.backends.tokenizer import Tokenizer

        models.set_offline()
        try:
            tok = Tokenizer(models.resolve(model, paths=False).path)  # a peer's name, not a path
        except Exception as exc:  # noqa: BLE001 - any failure means "no local tokenizer"
            log.warning("client: no local tokenizer for %s (%s: %s); requests go as text and "
                        "cannot fail over", model, type(exc).__name__, exc)
            return None
        if tok.fingerprint != fingerprint:
            log.warning("client: local tokenizer of %s has fingerprint %s, verifiers say %s; "
                        "not used", model, tok.fingerprint, fingerprint)
            return None
        log.info("tokenizing %s locally (fingerprint %s)", model, fingerprint)
        return tok


def encode_prompt(tok, text: str) -> list[int]:
    """A completion prompt as the verifier would encode it (`chat: false`)."""
    return [int(i) for i in tok.encode(text, chat=False)]


def encode_messages(tok, messages: Sequence[dict[str, str]]) -> list[int]:
    """Chat turns through the model's chat template, ready for the assistant's answer, exactly
    as the verifier renders them (content stays text: `Tokenizer.encode_messages`)."""
    return [int(i) for i in tok.encode_messages([dict(m) for m in messages])]
