"""Typed errors for bad generation input, so callers (CLI, nodes) can answer cleanly.

Every error a user can cause by what they ask for (unknown model, mismatched drafter, empty
prompt, silly limits) is a `GenerationError`; anything else is a bug and may propagate.
"""

from __future__ import annotations


class GenerationError(ValueError):
    """Base of every user-caused generation error; `str(err)` is one readable line."""


class ModelNotFoundError(GenerationError):
    """A model reference could not be resolved or loaded offline."""


class TokenizerMismatchError(GenerationError):
    """A drafter's tokenizer differs from the verifier's, so its token ids mean other things."""


class BadRequestError(GenerationError):
    """Invalid generation parameters: empty prompt, non-positive max tokens, bad sampling knobs."""
