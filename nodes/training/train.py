"""Training an EAGLE-3 head for a verifier, with EAGLE-3's training-time test.

The head is unrolled `ttt` steps over whole teacher-forced sequences: step 0 reads the
verifier's features; step s reads, at position j, its own step s-1 output at j-1 (what it
will read while drafting s tokens past the verifier) and attends to the real entries up to
j-s plus its own earlier steps' entries on that diagonal, exactly the context a depth-s draft
node has at inference. Every step predicts the same target (the verifier's distribution one
position on), weighted 0.8^s. The LM head starts from the verifier's own output rows for the
draft vocabulary and `norm` from its final norm, so training starts from a useful head.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nodes.drafters.eagle.config import EagleConfig
from nodes.drafters.eagle.head import Eagle3Head
from nodes.training.data import Example

log = logging.getLogger(__name__)

STEP_WEIGHT = 0.8


def new_head(backend, draft_ids: torch.Tensor, layers: tuple[int, ...],
             seed: int = 0) -> Eagle3Head:
    """A head shaped like one layer of the verifier, sharing its embedding, warm-started
    from its LM head and final norm."""
    vc = backend.model.config
    torch.manual_seed(seed)
    cfg = EagleConfig(
        hidden_size=int(vc.hidden_size),
        num_attention_heads=int(vc.num_attention_heads),
        num_key_value_heads=int(getattr(vc, "num_key_value_heads", vc.num_attention_heads)),
        intermediate_size=int(vc.intermediate_size),
        draft_vocab_size=len(draft_ids),
        vocab_size=int(backend.vocab_size),
        rms_norm_eps=float(getattr(vc, "rms_norm_eps", 1e-5)),
        rope_theta=float(_rope_theta(vc)),
        head_dim=getattr(vc, "head_dim", None),
        layer_ids=tuple(layers),
        max_position_embeddings=int(getattr(vc, "max_position_embeddings", 8192)),
    )
    head = Eagle3Head(cfg)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    with torch.no_grad():
        lm = backend.model.get_output_embeddings().weight.detach().float().cpu()
        head.lm_head.weight.copy_(lm[draft_ids])
        final_norm = getattr(backend.model.model, "norm", None)
        if final_norm is not None:
            head.norm.weight.copy_(final_norm.weight.detach().float().cpu())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.shared_embedding = backend.model.get_input_embeddings().weight.detach().float().cpu()
    return head


def _rope_theta(vc) -> float:
    params = getattr(vc, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return getattr(vc, "rope_theta", 10000.0)


def unroll(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """Pre-norm outputs [B, n, H] of each training-time-test step, n = T - 1 entries
    (entry j: feature j, token j+1)."""
    cfg = head.cfg
    n = tokens.shape[1] - 1
    toks = tokens[:, 1:]
    pos = torch.arange(n, device=tokens.device)
    # the head's float dtype from its norm: a quantized `fc` (int8 weights, for evaluating
    # a CPU head) has no float `weight` to read it from
    feature = head.fc(features[:, :n].flatten(-2).to(head.norm.weight.dtype))
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    scale = cfg.dim_head ** -0.5
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs = []
    j = torch.arange(n, device=tokens.device)
    for s in range(steps):
        q, k, v, residual = head.project(toks, feature, pos)
        keys.append(k.repeat_interleave(rep, -3))
        values.append(v.repeat_interleave(rep, -3))
        # real entries up to j - s (rows j < s see entry 0 only; they carry no loss)
        allowed = j[None, :] <= (j[:, None] - s).clamp(min=0)
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
        for t in range(1, s + 1):  # this diagonal's own earlier steps: position j - s + t
            shifted = _shift(keys[t], s - t)
            scores.append((q * shifted).sum(-1, keepdim=True) * scale)
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = probs[..., :n] @ values[0]
        for t in range(1, s + 1):
            out = out + probs[..., n + t - 1 : n + t] * _shift(values[t], s - t)
        h = head.finish(out, residual)
        outs.append(h)
        feature = _shift(h, 1, dim=-2)
    return outs


def _shift(x: torch.Tensor, by: int, dim: int = -2) -> torch.Tensor:
    """x moved `by` places later along `dim` (zeros first): out[j] = x[j - by]."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - by)], dim=dim)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T]
    features: torch.Tensor  # [B, T, 3, H]
    top_ids: torch.Tensor  # [B, T, K]
    top_p: torch.Tensor  # [B, T, K]
    top1: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]

    @classmethod
    def of(cls, examples: list[Example], device) -> Batch:
        T = max(len(e.tokens) for e in examples)

        def pad(get, fill=0):
            rows = []
            for e in examples:
                x = get(e)
                extra = T - x.shape[0]
                if extra:
                    x = torch.cat([x, x.new_full((extra, *x.shape[1:]), fill)])
                rows.append(x)
            return torch.stack(rows).to(device)

        return cls(pad(lambda e: e.tokens), pad(lambda e: e.features),
                   pad(lambda e: e.top_ids), pad(lambda e: e.top_p), pad(lambda e: e.top1),
                   torch.tensor([len(e.tokens) for e in examples], device=device))


def losses(head: Eagle3Head, batch: Batch, steps: int):
    """Weighted loss over the unrolled steps, and per step (correct, counted) top-1 hits
    against the verifier's argmax."""
    outs = unroll(head, batch.tokens, batch.features, steps)
    n = batch.tokens.shape[1] - 1
    j = torch.arange(n, device=batch.tokens.device)
    target_ids = head.target_ids()
    total = torch.zeros((), device=batch.tokens.device)
    hits = []
    p = batch.top_p[:, 1:].float()  # the target of entry j is the verifier's row j + 1
    idx = batch.top_ids[:, 1:]
    top1 = batch.top1[:, 1:]
    for s, h in enumerate(outs):
        valid = (j[None] >= s) & (j[None] <= batch.lengths[:, None] - 2)
        logq = F.log_softmax(head.logits(h).float(), dim=-1)
        ce = -(p * logq.gather(-1, idx)).sum(-1)
        total = total + STEP_WEIGHT**s * (ce * valid).sum() / valid.sum().clamp(min=1)
        pred = target_ids[logq.argmax(-1)]
        hits.append((int(((pred == top1) & valid).sum()), int(valid.sum())))
    return total, hits


def evaluate(head: Eagle3Head, examples: list[Example], steps: int, device,
             batch_size: int = 4) -> list[float]:
    """Held-out top-1 accuracy per unrolled step (step 0: the first draft token)."""
    counts = [[0, 0] for _ in range(steps)]
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            _, hits = losses(head, Batch.of(examples[i : i + batch_size], device), steps)
            for s, (c, n) in enumerate(hits):
                counts[s][0] += c
                counts[s][1] += n
    return [c / n if n else 0.0 for c, n in counts]


def lr_at(step: int, frac: float, peak: float, warmup: int = 20) -> float:
    """Linear warm-up, then cosine down to a tenth over `frac` (0..1) of the run."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@dataclass
class TrainState:
    step: int = 0
    elapsed_s: float = 0.0
    epoch: int = 0


def train_loop(head: Eagle3Head, train: list[Example], held: list[Example], *, steps: int,
               ttt: int, batch_size: int, lr: float, max_seconds: float, device,
               optimizer: torch.optim.Optimizer | None = None, state: TrainState | None = None,
               save=None, save_every: int = 50, report=print, seed: int = 0):
    """Train until `steps` optimizer steps or `max_seconds` of training; `save(state, opt)`
    checkpoints (resumable); `report(line)` shows progress."""
    state = state or TrainState()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = optimizer or torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(seed * 1000 + state.epoch)
    order: list[int] = []
    start = time.monotonic() - state.elapsed_s
    head.train()
    while state.step < steps and time.monotonic() - start < max_seconds:
        if not order:
            # batches of similar lengths (less padding), in random order
            ranked = sorted(range(len(train)), key=lambda i: len(train[i].tokens))
            groups = [ranked[i : i + batch_size] for i in range(0, len(ranked), batch_size)]
            rng.shuffle(groups)
            order = [i for g in groups for i in g]
            state.epoch += 1
        pick, order = order[:batch_size], order[batch_size:]
        for group in opt.param_groups:
            # the run ends at `steps` or `max_seconds`, whichever comes first
            frac = max(state.step / steps, (time.monotonic() - start) / max_seconds)
            group["lr"] = lr_at(state.step, frac, lr)
        loss, hits = losses(head, Batch.of([train[i] for i in pick], device), ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state.step += 1
        state.elapsed_s = time.monotonic() - start
        if state.step % 10 == 0 or state.step == 1:
            acc = hits[0][0] / max(1, hits[0][1])
            report(f"step {state.step}/{steps}  loss {loss.item():.3f}  train top-1 {acc:.3f}  "
                   f"{state.elapsed_s:.0f} s")
        if save is not None and state.step % save_every == 0:
            head.eval()
            held_acc = evaluate(head, held, ttt, device)
            head.train()
            report(f"step {state.step}: held-out top-1 " +
                   " / ".join(f"{a:.3f}" for a in held_acc) + " (per draft depth)")
            save(state, opt)
    head.eval()
    return state, opt
