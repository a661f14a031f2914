"""Kept for old imports: the draft-length controller now lives in `nodes.engine.cost`."""

from nodes.engine.cost import CostModel, DraftLengthController

__all__ = ["CostModel", "DraftLengthController"]
