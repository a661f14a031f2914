"""Drafters by name: `make_drafter(spec, verifier)` builds one from a CLI spec.

Kept apart from nodes/drafters/base.py, which every drafter imports: the registry imports the
drafters (lazily, so `import nodes.drafters` stays free of torch), never the other way round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodes.engine.errors import BadRequestError

if TYPE_CHECKING:
    from nodes.backends.base import Backend
    from nodes.drafters.base import Drafter


def make_drafter(spec: str | None, verifier: Backend | None = None) -> Drafter | None:
    """Build a drafter from `none`, `ngram`, `suffix[:opts]`, `int8` or `model:<ref>`."""
    if spec is None or spec == "none":
        return None
    if spec == "ngram":
        from nodes.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if spec == "suffix" or spec.startswith("suffix:"):
        from nodes.drafters.suffix import SuffixDrafter

        return SuffixDrafter.from_spec(spec)
    if spec == "eagle" or spec.startswith("eagle:"):
        from nodes.drafters.eagle.source import EagleDrafter

        return EagleDrafter.load(spec[len("eagle:") :] or None, verifier)
    if spec == "int8":
        from nodes.drafters.int8 import Int8Drafter

        if verifier is None:
            raise BadRequestError("the int8 drafter needs the verifier model to quantize")
        return Int8Drafter.from_verifier(verifier)
    if spec.startswith("model:") and len(spec) > len("model:"):
        from nodes.backends.registry import load_backend
        from nodes.drafters.model import ModelDrafter

        backend_name = verifier.name if verifier is not None else "torch"
        return ModelDrafter(load_backend(backend_name, spec[len("model:") :]))
    raise BadRequestError(
        f"unknown drafter {spec!r}; use none, ngram, suffix[:opts], int8 or model:<ref>")
