"""The in-process speculative-decoding engine (cheap to import: no torch/mlx here).

from nodes.engine import Engine, GenerationParams, SamplingParams
engine = Engine(load_backend("torch"), make_drafter("ngram"))
for block in engine.stream(prompt_ids, GenerationParams(max_tokens=64)): ...
# or step by step: seq = engine.start(prompt_ids, params); engine.step(seq) until
# seq.finish_reason is set; seq.close()
"""

from nodes.engine.core import (
    Block,
    Engine,
    GenerationParams,
    GenerationResult,
    SequenceState,
    Stats,
)
from nodes.engine.cost import CostModel
from nodes.engine.errors import (
    BadRequestError,
    GenerationError,
    ModelNotFoundError,
    TokenizerMismatchError,
)
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import DraftSource, Feedback, SourceOpener
from nodes.engine.tree import DraftTree, TokenTree

__all__ = [
    "BadRequestError",
    "Block",
    "CostModel",
    "DraftSource",
    "DraftTree",
    "Engine",
    "Feedback",
    "GenerationResult",
    "GenerationError",
    "GenerationParams",
    "ModelNotFoundError",
    "SamplingParams",
    "SequenceState",
    "SourceOpener",
    "Stats",
    "TokenTree",
    "TokenizerMismatchError",
]
