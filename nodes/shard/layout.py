"""Which layers each stage of a pipeline holds, and the typed errors of a bad configuration."""

from __future__ import annotations

from dataclasses import dataclass

from nodes.engine.errors import GenerationError


class ShardConfigError(GenerationError):
    """A shard group that cannot form: too many shards, mismatched models, a slot taken twice."""

    code = "bad_request"


class ShardBrokenError(GenerationError):
    """A stage of the pipeline died or stopped answering; the generation cannot go on."""

    code = "generation_failed"


@dataclass(frozen=True)
class StageSlice:
    """Stage `rank` of `world` holds decoder layers [start, end); the first also the
    embeddings, the last also the final norm and LM head."""

    rank: int
    world: int
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


def split_layers(num_layers: int, world: int, rank: int) -> StageSlice:
    """Contiguous, near-equal slices; earlier stages get the remainder layers."""
    if world < 1:
        raise ShardConfigError(f"--shards must be >= 1, got {world}")
    if world > num_layers:
        raise ShardConfigError(
            f"--shards {world} is more than the model's {num_layers} layers: each stage needs "
            "at least one")
    if not 0 <= rank < world:
        raise ShardConfigError(f"rank {rank} outside 0..{world - 1}")
    base, extra = divmod(num_layers, world)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    return StageSlice(rank, world, start, end)
