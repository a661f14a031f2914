"""Settling a step: what the verifier proved becomes committed tokens.

Once a sequence's tree is accepted (`Engine._accept`: the path and the token after it) or its
prompt is in, settling commits the tokens: the cache compacted to the accepted path and cropped
to what is committed, stop rules applied (EOS, max tokens, stop strings), log probabilities and
stats, and every draft source told what was committed and what of its offer was right
(`Feedback`; a source that fails on it is dropped). Kept apart from planning and scheduling
because it is the one place a step changes what a sequence has said: a new rule about what may
be committed (a grammar constraint, say) enters here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from nodes.engine.logprobs import token_logprobs
from nodes.engine.sampling import History, adjust_logits, choose, position_noise
from nodes.engine.sources import Feedback
from nodes.engine.state import Block, GenerationParams, SequenceState, drop_source
from nodes.engine.tree import TokenTree

if TYPE_CHECKING:
    from nodes.backends.base import Backend


def noise(seq: SequenceState, position: int, vocab_size: int) -> np.ndarray:
    """The sampling noise of `position` in `seq` (a function of its seed and the position
    alone: the text never depends on drafts, batching or the verifier that served it)."""
    return position_noise(seq.noise_seed, position, vocab_size)


def history(seq: SequenceState) -> History:
    """The sequence's committed history for the logit controls (`sampling.History`), brought
    up to date with what was committed since it was last read."""
    if seq.history is None:  # a resumed generation's own tokens count as generated
        cut = len(seq.prompt) - seq.params.resumed
        seq.history, seq.history_len = History(seq.prompt[:cut], seq.prompt[cut:]), 0
    for t in seq.generated[seq.history_len:]:
        seq.history.add(t)
    seq.history_len = len(seq.generated)
    return seq.history


#: fill the root rows' full masks of a step's constrained sequences in one batched call while
#: the forward runs (`Engine.step_batch`, `Grammars.fill_ahead`) instead of each row its own
#: fill after it. Off: on this CPU verifier it measured no gain pinned to one core and a slower
#: forward on two (docs/engine/constraints.md, "Where the time goes in a constrained batch");
#: kept, tested, for a verifier whose forward leaves the CPU idle, where it is unmeasured
BATCH_MASKS = False


def needs_full_mask(seq: SequenceState) -> bool:
    """Whether the step will fill `seq`'s full grammar mask at its root row (the committed
    state, known before the forward): a constrained row that samples or reports log
    probabilities; a greedy row without them checks its favourites first (`mask_logits`)."""
    return (seq.grammar is not None
            and not (seq.params.sampling.greedy and seq.params.logprobs is None))


def row_rules(seq: SequenceState, root_bits: np.ndarray | None = None
              ) -> tuple[Any, Any] | None:
    """(mask, advance) for a walk from the committed state: `mask(row)` is the row under the
    logit controls (`adjust_logits`, with the history along the walk so far) and the grammar,
    with the greedy token where the grammar's check already found it (else None),
    `advance(token)` moves both on by the token chosen. None when neither applies.
    `root_bits`: the grammar's packed mask of the committed state, filled ahead
    (`Grammars.fill_ahead`): the walk's first row (the root) takes it instead of a fill."""
    sp = seq.params.sampling
    adjusts, grammar = sp.adjusts_logits, seq.grammar
    if not adjusts and grammar is None:
        return None
    walk = history(seq).copy() if adjusts else None
    # greedy without log probabilities reads only the row's argmax: the grammar checks that
    # one token and masks the whole row only when it is forbidden (`mask_logits`)
    argmax_only = sp.greedy and seq.params.logprobs is None
    ahead = [root_bits] if root_bits is not None and grammar is not None else []

    def mask(row: np.ndarray) -> tuple[np.ndarray, int | None]:
        if walk is not None:
            row = adjust_logits(row, sp, walk)
        if grammar is not None:
            bits = ahead.pop() if ahead else None  # the root's, then each row its own
            return grammar.mask_and_pick(row, argmax_only=argmax_only, bits=bits)
        return row, None

    def advance(token: int) -> None:
        if walk is not None:
            walk.add(token)
        if grammar is not None:
            grammar.advance(token)

    return mask, advance


class Settler:
    """Commits what a step proved for one sequence (module docstring); returns its `Block`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def nothing(self, seq: SequenceState, fed: int) -> Block:
        """A step that committed nothing for `seq` (a prefill chunk, or its turn to wait)."""
        return Block(token_ids=[], drafted=0, accepted=0, committed_len=len(seq.prompt),
                     cache_len=self.backend.cache_length(seq.cache), fed=fed)

    def prefilled(self, seq: SequenceState, fed: int, row: np.ndarray, dt: float) -> Block:
        """After `fed` prompt rows went in (`row`: the logits after the last; the scheduler
        has counted them): a block with no tokens while chunks remain, else the first token,
        committed."""
        prompt = seq.prompt
        seq.stats.verify_s += dt
        if seq.prefilled and seq.prefilled < len(prompt):
            return self.nothing(seq, fed)
        sp = seq.params.sampling
        rules = row_rules(seq)
        first = None
        if rules is not None:  # the first token too comes from the adjusted, masked row
            row, first = rules[0](np.array(row, copy=True))
        if first is None:
            first = choose(row, sp, lambda: noise(seq, len(prompt), self.backend.vocab_size))
        if rules is not None:
            rules[1](first)
        return replace(self._commit(seq, [first], drafted=0, accepted=0, base=0,
                                    hidden=self._take_hidden(seq, None), rows=row), fed=fed)

    def verified(self, seq: SequenceState, tree: TokenTree, path: list[int], nxt: int,
                 base: int, logits: np.ndarray, dt: float) -> Block:
        """Commit the accepted `path` of `tree` and `nxt` after it: compact the cache (fed
        from position `base`) to the path, count the block, commit. `logits`: the tree's rows,
        `dt`: the forward's time."""
        backend, stats = self.backend, seq.stats
        stats.verify_s += dt
        hidden = self._take_hidden(seq, [0, *path])
        if not tree.is_chain():
            backend.compact(seq.cache, base, [0, *path])
            stats.tree_blocks += 1
        new = [*(tree.tokens[i] for i in path), nxt]
        if tree.drafted:
            stats.spec_blocks += 1
            stats.drafted += tree.drafted
            stats.accepted += len(path)
            per_pos = stats.accepted_per_pos
            per_pos.extend([0] * (len(path) - len(per_pos)))
            for depth in range(len(path)):
                per_pos[depth] += 1
        else:
            stats.plain_steps += 1
        return replace(self._commit(seq, new, drafted=tree.drafted, accepted=len(path),
                                    tree=tree, path=path, base=base, hidden=hidden,
                                    rows=None if seq.params.logprobs is None
                                    else logits[[0, *path]]), fed=len(tree))

    def _take_hidden(self, seq: SequenceState, rows: list[int] | None) -> Any:
        """The captured hidden states of the fed rows `rows` (None: all), in path order."""
        if seq.hidden_layers is None:
            return None
        hidden = self.backend.take_hidden(seq.cache)
        if hidden is None or rows is None:
            return hidden
        return hidden[rows]

    def _commit(
        self,
        seq: SequenceState,
        new: list[int],
        *,
        drafted: int,
        accepted: int,
        tree: TokenTree | None = None,
        path: list[int] | None = None,
        base: int = 0,
        hidden: Any = None,
        rows: Any = None,
    ) -> Block:
        """`rows[i]`: the verifier's logits `new[i]` was chosen from (read for log
        probabilities only: a path's rows are copied out of the tree's only where asked,
        ~0.2 MB a row)."""
        new = self._grammar_end(seq, new)
        new, finish, text = self._finish(seq.generated, new, seq.params, seq.eos)
        top = seq.params.logprobs
        logprobs = None if top is None or not new else token_logprobs(
            np.atleast_2d(rows)[: len(new)], new, min(top, self.backend.vocab_size))
        seq.generated.extend(new)
        if seq.grammar is not None:  # acceptance walked it past a stop rule's cut: back
            seq.grammar.sync(len(seq.generated))
        seq.finish_reason = finish
        seq.stats.blocks += 1
        committed = len(seq.prompt) + len(seq.generated)
        if hidden is not None:  # the rows of what stays cached (a stop rule may cut the path)
            hidden = hidden[: max(0, committed - 1 - base)]
        # roll back rejected (or cut-off) drafts: keep all committed but the pending one
        self.backend.crop(seq.cache, committed - 1)
        for slot in list(seq.slots):
            asked = slot.asked and tree is not None and path is not None
            fb = Feedback(
                committed=tuple(new),
                committed_len=committed,
                offered=slot.offered if asked else 0,
                accepted=tree.accepted_by(slot.tag, path) if asked else 0,
                hidden=None if hidden is None or slot.columns is None
                else hidden[:, slot.columns],
            )
            try:
                slot.source.feedback(fb)
            except Exception as exc:  # noqa: BLE001 - same policy as propose
                drop_source(seq, slot, "failed on feedback", exc)
        return Block(
            token_ids=new,
            drafted=drafted,
            accepted=accepted,
            committed_len=committed,
            cache_len=self.backend.cache_length(seq.cache),
            finish_reason=finish,
            text=text,
            logprobs=logprobs,
        )

    @staticmethod
    def _grammar_end(seq: SequenceState, new: list[int]) -> list[int]:
        """`new` and, where it completes the grammar (which then allows nothing but EOS) and
        the sequence has one EOS id, that EOS: the next token whatever the logits say, greedy
        or sampled (a masked distribution of one token), so it is committed now instead of
        costing a forward of its own, one step less for every constrained answer (a JSON
        object's closing brace, then its EOS). Not where log probabilities are asked: those
        come from a row of logits."""
        grammar = seq.grammar
        if grammar is None or not new or len(seq.eos) != 1 or seq.params.logprobs is not None:
            return new
        if new[-1] in seq.eos or grammar.consumed != len(seq.generated) + len(new) or \
                not grammar.done:
            return new
        (eos,) = seq.eos
        grammar.advance(eos)
        return [*new, eos]

    def _finish(
        self,
        generated: list[int],
        new: list[int],
        params: GenerationParams,
        eos: frozenset[int],
    ) -> tuple[list[int], str | None, str | None]:
        """Cut a block's new tokens at EOS, max tokens or a stop string; say why it ended."""
        finish = None
        for i, t in enumerate(new):
            if t in eos:
                new, finish = new[: i + 1], "eos"
                break
        room = params.max_tokens - len(generated)
        if len(new) > room:
            new, finish = new[:room], "length"
        elif len(new) == room and finish is None:
            finish = "length"
        if not params.stop:
            return new, finish, None
        decode = self.backend.tokenizer.decode
        for i in range(len(new)):
            text = decode(generated + new[: i + 1])
            cut = min((p for p in (text.find(s) for s in params.stop) if p >= 0), default=-1)
            if cut >= 0:
                return new[: i + 1], "stop", text[:cut]
        return new, finish, decode(generated + new) if finish else None
