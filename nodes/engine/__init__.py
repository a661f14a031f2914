"""The in-process speculative-decoding engine (cheap to import: no torch/mlx here).

from nodes.engine import Engine, GenerationParams, SamplingParams
engine = Engine(load_backend("torch"), make_drafter("ngram"))
for block in engine.stream(prompt_ids, GenerationParams(max_tokens=64)): ...
"""

from nodes.engine.core import Block, Engine, Generation, GenerationParams, Stats
from nodes.engine.errors import (
    BadRequestError,
    GenerationError,
    ModelNotFoundError,
    TokenizerMismatchError,
)
from nodes.engine.sampling import SamplingParams

__all__ = [
    "BadRequestError",
    "Block",
    "Engine",
    "Generation",
    "GenerationError",
    "GenerationParams",
    "ModelNotFoundError",
    "SamplingParams",
    "Stats",
    "TokenizerMismatchError",
]
