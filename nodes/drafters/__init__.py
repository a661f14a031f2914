"""Drafters propose tokens for the verifier to check: n-gram prompt lookup, a small model, int8.

`make_drafter(spec, verifier)` builds one from a CLI-style spec: `ngram`, `int8`, `model:<ref>`.
"""

from nodes.drafters.base import Drafter, DraftState
from nodes.drafters.registry import make_drafter

__all__ = ["Drafter", "DraftState", "make_drafter"]
