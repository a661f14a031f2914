"""An EAGLE-3 head served by a proposer node: the verifier's hidden states come over the wire.

In process, the engine hands the head the verifier's hidden states of every committed position
(`EagleSource.feedback`). A proposer gets the same rows with each pushed commit
(`session_extend.hidden`, docs/protocol.md "Hidden states") and passes them to this session's
`features`. Drafting ahead works as for every proposer: the session is told the tokens it
assumed (its own drafts past the last commit); it drafts from the last position whose features
it has, feeding the head its own outputs past it (as EAGLE does within a draft), and offers the
part past what it assumed, when that still agrees, with each position's runners-up as one-token
branches (the proposer's `--tree-width`). Drafts are the head's argmax (point masses): lossless
whatever the verifier samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nodes.drafters.base import EMPTY_DRAFT, DraftState
from nodes.engine.errors import BadRequestError
from nodes.engine.sources import DraftSource, Feedback
from nodes.engine.tree import EMPTY_TREE, DraftTree


class EagleState(DraftState):
    """One remote generation's head state (an `EagleSource` fed from the wire)."""

    def __init__(self, source: DraftSource, hidden_size: int, prompt: Sequence[int]) -> None:
        """`source`: an `EagleSource` opened greedy with a chain width (remote drafts are
        point masses, the head's mode)."""
        self.source = source
        self.shape = (len(source.hidden_layers), hidden_size)
        self.tokens = [int(t) for t in prompt]  # committed + assumed, as the proposer said

    def features(self, rows: np.ndarray) -> None:
        """The verifier's hidden states of the next positions it cached ([n, layers x H])."""
        layers, size = self.shape
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != layers * size:
            raise BadRequestError(f"hidden states of width {rows.shape[-1]} do not fit this "
                                  f"head ({layers} layers x {size})", "hidden")
        t = torch.from_numpy(rows.astype(np.float32)).view(len(rows), layers, size)
        self.source.feedback(Feedback((), 0, 0, 0, hidden=t))

    def extend(self, delta: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in delta)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def draft(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        tree = self.draft_ahead(k)
        return (tree.chain_tokens.astype(np.int32) if len(tree) else EMPTY_DRAFT), None

    def draft_ahead(self, k: int, width: int = 1) -> DraftTree:
        """The head's chain past what the proposer assumed and, `width` > 1, each drafted
        position's runners-up as one-token branches (as the model drafter offers them)."""
        known = self.source.known  # positions whose verifier features arrived
        committed, assumed = self.tokens[: known + 1], self.tokens[known + 1 :]
        if k <= 0 or len(committed) != known + 1:
            return EMPTY_TREE
        drafted = self.source.propose_chain(committed, len(assumed) + k, width)
        if drafted is None:
            return EMPTY_TREE
        skip = len(assumed)
        if drafted.chain_tokens[:skip].tolist() != assumed:
            return EMPTY_TREE  # the verifier's features changed its mind
        # past what was assumed, and no alternative to a token assumed already
        return drafted.advanced(skip).cut(k)

    def close(self) -> None:
        self.source.close()
