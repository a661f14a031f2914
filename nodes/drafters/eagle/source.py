"""The EAGLE-3 head as an in-process draft source, and its `Drafter`.

The engine captures the verifier's hidden states at the head's layers in its verify forwards
and hands the committed ones to the source with each step's `Feedback` (the source declares
`hidden_layers`). Before drafting, the source feeds the head the entries it has not read yet
(committed position i: the verifier's features there and token i+1) in one head forward, after
cropping its cache back to the committed entries (draft entries never stay); then it drafts an
EAGLE-2 tree (greedy) or a chain sampled from the head's own distribution (keyed to the
verifier's noise where the request has a seed, so the two agree whenever the head is right).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from nodes.drafters.base import Drafter, DraftState
from nodes.drafters.eagle.cache import HeadCache
from nodes.drafters.eagle.checkpoint import VerifierShape, load_head
from nodes.drafters.eagle.draft_state import EagleState
from nodes.drafters.eagle.head import Eagle3Head
from nodes.drafters.eagle.quantize import quantize_head
from nodes.drafters.eagle.tree import draft_tree
from nodes.drafters.model import MIN_ALT_CONF
from nodes.engine.errors import BadRequestError
from nodes.engine.sampling import (
    SamplingParams,
    keyed_sample,
    position_noise,
    probs_from_logits,
    sample,
)
from nodes.engine.sources import DraftSource, Feedback
from nodes.engine.tree import EMPTY_TREE, DraftTree

log = logging.getLogger(__name__)

#: nodes per tree level (and children offered per node)
TREE_WIDTH = 4
#: the most committed entries one catch-up feeds the head: after a long stretch unread (the
#: prompt, before the first draft; a gap while the cost model turned the head down) it reads
#: only the latest ones, since its cost grows with the stretch (its layer over 200 positions
#: took 70 ms on one CPU core, more than a verify step) and a draft leans on the recent ones
CATCH_UP_WINDOW = 64
#: the head trained for the embedded model, shipped as package data (when present)
SHIPPED_HEAD = Path(__file__).with_name("smollm2_head")


class EagleSource(DraftSource):
    """One generation's head state: its KV cache, the committed tokens and the verifier
    features not yet read."""

    def __init__(self, head: Eagle3Head, layers: tuple[int, ...], prompt: Sequence[int],
                 params: SamplingParams, width: int, name: str) -> None:
        self.head, self.hidden_layers, self.params = head, tuple(layers), params
        self.width, self.name = width, name
        self.tokens = [int(t) for t in prompt]
        self.pending: list[torch.Tensor] = []  # verifier features [k, 3, H] not yet fed
        self.known = 0  # committed positions whose features arrived
        self.fed = 0  # committed positions the head has read up to (some skipped: a window)
        self.held = 0  # committed entries in the head cache (fewer than `fed` after a gap)
        self.last: torch.Tensor | None = None  # pre-norm output of the last fed entry
        p = next(head.parameters())
        self.cache = HeadCache(head.cfg.num_key_value_heads, head.cfg.dim_head, p.dtype,
                               p.device)
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.default_rng([int(seed) % 2**63, 0xEA61E])

    def feedback(self, fb: Feedback) -> None:
        self.tokens.extend(int(t) for t in fb.committed)
        if fb.hidden is not None and len(fb.hidden):
            self.pending.append(fb.hidden)
            self.known += len(fb.hidden)
            if len(self.pending) > 1 and sum(map(len, self.pending)) > 2 * CATCH_UP_WINDOW:
                # only the last window is ever read (`_catch_up`): a head turned down through
                # a long generation keeps no more than that
                self.pending = [torch.cat(self.pending)[-CATCH_UP_WINDOW:]]

    def propose(self, committed: Sequence[int], budget: int) -> DraftTree:
        if len(committed) != len(self.tokens):
            self.tokens = [int(t) for t in committed]
        if budget <= 0 or not self._catch_up():
            return EMPTY_TREE
        with torch.inference_mode():
            if self.params.greedy and self.width > 1:
                tree = draft_tree(self.head, self.cache, self.last, self.tokens[-1], budget,
                                  self.width, position=self.fed)
            else:
                tree = self._chain(budget)
        self.cache.crop(self.held)
        return tree

    def propose_chain(self, committed: Sequence[int], budget: int, width: int
                      ) -> DraftTree | None:
        """A proposer's draft: the head's greedy chain of `budget` tokens and, at each depth,
        up to `width - 1` runners-up worth at least `MIN_ALT_CONF` as one-token branches, as
        the model drafter offers them; None when the head cannot draft yet."""
        if len(committed) != len(self.tokens):
            self.tokens = [int(t) for t in committed]
        if budget <= 0 or not self._catch_up():
            return None
        with torch.inference_mode():
            out = self._chain(budget, width)
        self.cache.crop(self.held)
        return out

    def _catch_up(self) -> bool:
        """Feed the committed entries the head has not read, in one forward: the last
        `CATCH_UP_WINDOW` of them when more are waiting (positions stay true: the head's
        attention then skips the gap, as a draft's quality barely depends on it, while the
        output never does)."""
        if self.known != len(self.tokens) - 1:
            log.debug("%s: features for %d of %d positions; not drafting", self.name,
                      self.known, len(self.tokens) - 1)
            return False
        if self.pending:
            with torch.inference_mode():
                feats = torch.cat(self.pending)[-CATCH_UP_WINDOW:]
                feats = feats.to(self.cache.k.device, self.cache.k.dtype)
                self.pending = []
                start = self.known - len(feats)
                self.cache.crop(self.held)
                dev = self.cache.k.device
                tokens = torch.tensor(self.tokens[start + 1 : self.known + 1], device=dev)
                out = self.head.step(self.cache, tokens, feats,
                                     torch.arange(start, self.known, device=dev))
                self.last, self.fed, self.held = out[-1], self.known, self.cache.length
        return self.last is not None

    def _chain(self, budget: int, width: int = 1):
        """Greedy: the head's argmax chain (and, `width` > 1, each depth's runners-up as
        one-token branches). Sampling: tokens drawn from the head's distribution (processed
        like the verifier's)."""
        head, greedy = self.head, self.params.greedy
        target = head.target_ids()
        vocab = head.cfg.vocab_size
        ids, conf, branches = [], [], []
        h = self.last
        for depth in range(1, budget + 1):
            logits = head.logits(h[None])[0].float()
            if greedy:
                q = torch.softmax(logits, -1)
                top = torch.topk(q, min(max(width, 1), len(q)))
                d = int(top.indices[0])
                tok = int(target[d])
                conf.append(float(top.values[0]))
                branches += [(depth - 1, (int(target[int(i)]),), (float(p),))
                             for p, i in zip(top.values[1:], top.indices[1:], strict=True)
                             if p >= MIN_ALT_CONF]
            else:
                full = np.full(vocab, -np.inf)
                full[target.cpu().numpy()] = logits.cpu().numpy()
                q = probs_from_logits(full, self.params)[0]
                if self.params.seed is not None:  # the verifier's own noise there: its draw
                    # and this one agree whenever the head's q is close to its p
                    tok = keyed_sample(q, position_noise(self.params.seed,
                                                         len(self.tokens) + depth - 1, vocab))
                else:
                    tok = sample(q, self.rng)
                conf.append(float(q[tok]))
            ids.append(tok)
            if depth == budget:
                break
            dev = self.cache.k.device
            h = head.step(self.cache, torch.tensor([tok], device=dev), h[None],
                          torch.tensor([self.fed - 1 + depth], device=dev))[0]
        return DraftTree.branched(ids, conf, branches)

    def close(self) -> None:
        self.pending = []
        self.last = None


class EagleDrafter(Drafter):
    """An EAGLE-3 head for torch verifiers of one model: in process it reads its verifier's
    hidden states; behind a proposer node they come over the wire (`EagleState`)."""

    def __init__(self, head: Eagle3Head, layers: tuple[int, ...], fingerprint: str,
                 name: str = "eagle", tree_width: int = TREE_WIDTH) -> None:
        self.head, self.layers = head, tuple(layers)
        self.fingerprint, self.name, self.tree_width = fingerprint, name, tree_width
        #: what a proposer serving this head asks of verifiers (its card says so)
        self.hidden_layers = self.layers
        self.hidden_size = head.cfg.feature_size
        #: a served session's cost per token (the proposer's session budget): its hidden
        #: states as float32 and the head's K/V, with room to spare
        self.bytes_per_token = 4 * self.hidden_size * (len(self.layers) + 2) + 256

    @classmethod
    def load(cls, path: str | Path | None, verifier, int8: bool | None = None) -> EagleDrafter:
        """The head at `path` (None: the one shipped for the embedded model), checked
        against `verifier` (a torch backend). `int8` (default: on a CPU) drafts with int8
        weights (`quantize.quantize_head`: ~4x faster a step there, same top-1)."""
        if verifier is None:
            raise BadRequestError("the eagle drafter needs the verifier model (torch backend)")
        shape = VerifierShape.of(verifier)
        if path is None:
            path = SHIPPED_HEAD
            if not (path / "config.json").exists():
                raise BadRequestError("no eagle head is shipped with this install; train one "
                                      "with `specbus train-drafter` and pass --drafter "
                                      "eagle:PATH")
        device = str(getattr(verifier, "device", "cpu"))
        head, layers = load_head(path, shape, device=device)
        if int8 or (int8 is None and device == "cpu"):
            if device != "cpu":
                raise BadRequestError(f"an int8 eagle head drafts on a CPU, not on {device}")
            head = quantize_head(head)
        return cls(head, layers, verifier.fingerprint)

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftState:
        """A proposer's session: the verifier's hidden states come with its commits."""
        source = EagleSource(self.head, self.layers, prompt_ids, SamplingParams(), 1, self.name)
        return EagleState(source, self.hidden_size, prompt_ids)

    def open_source(self, prompt_ids: Sequence[int], params: SamplingParams) -> EagleSource:
        return EagleSource(self.head, self.layers, prompt_ids, params, self.tree_width,
                           self.name)
