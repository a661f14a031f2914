"""`specbus train-drafter`: train an EAGLE-3 head for a verifier, offline.

Data is made from the verifier itself (nodes/training/data.py): its answers to built-in
prompts, whose generating forwards also keep the three hidden states and its next-token
distributions (no second pass), and any `--text` files, teacher-forced through it once; the
head is
trained with EAGLE-3's training-time test (nodes/training/train.py) and written in the
published layout (config.json + fp16 model.safetensors) that `--drafter eagle:DIR` loads.
Work files (the data, the optimizer state) live in DIR/.train, so an interrupted run resumes
where it was: run the same command again.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="verifier model reference (default: "
                        "the embedded smollm2-135m)")
    parser.add_argument("--out", required=True, help="output folder for the head")
    parser.add_argument("--prompts", type=int, default=0,
                        help="use the first N built-in prompts (default: all)")
    parser.add_argument("--chat-prompts", type=int, default=0,
                        help="use N generated open-ended chat prompts (templates x topics, "
                        "nodes/training/prompts.py) instead of the 64 built-in ones")
    parser.add_argument("--self-prompts", type=int, default=0,
                        help="add N prompts the verifier writes itself (sampled after its chat "
                        "template's user header; far more varied than templates), answered "
                        "like the others")
    parser.add_argument("--extra-data", action="append", default=[],
                        help="also train on an earlier run's data (its DIR/.train/data.pt; "
                        "same draft vocabulary, e.g. with --init that run's head); repeatable")
    parser.add_argument("--cycle-temperatures", action="store_true",
                        help="answer every prompt once, generation batch b at temperature b "
                        "mod the list (default: every prompt once per temperature)")
    parser.add_argument("--gen-minutes", type=float, default=0.0,
                        help="stop generating responses after this many minutes (0: no "
                        "limit); what was made is used")
    parser.add_argument("--hold-every", type=int, default=10,
                        help="hold out every Nth prompt's responses (default 10)")
    parser.add_argument("--init", default=None,
                        help="start from this head (its weights and draft vocabulary) "
                        "instead of the verifier's LM head")
    parser.add_argument("--text", action="append", default=[],
                        help="a local text file, teacher-forced in 256-token chunks "
                        "(repeatable)")
    parser.add_argument("--max-new", type=int, default=128,
                        help="tokens per generated response (default 128)")
    parser.add_argument("--gen-batch", type=int, default=16, help="generation batch size")
    parser.add_argument("--temperatures", default="0,0.8",
                        help="one response per prompt per temperature (default 0,0.8)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps at most")
    parser.add_argument("--minutes", type=float, default=60.0,
                        help="training wall time at most (data making not counted)")
    parser.add_argument("--ttt", type=int, default=3, help="training-time-test unroll steps")
    parser.add_argument("--batch", type=int, default=4, help="sequences per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint interval")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="ignore a previous run's state")


def run(args: argparse.Namespace) -> int:
    from nodes.engine.errors import GenerationError

    try:
        return _run(args)
    except (GenerationError, ValueError, OSError) as exc:
        print(f"specbus train-drafter: {exc}", file=sys.stderr)
        return 2


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    import torch

    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.eagle.checkpoint import save_head
    from nodes.drafters.eagle.config import default_layer_ids
    from nodes.training import data as D
    from nodes.training import train as T

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    work = out / ".train"
    work.mkdir(parents=True, exist_ok=True)
    backend = TorchBackend.load(args.model, device=device)
    layers = default_layer_ids(backend.num_layers)
    data_file, state_file = work / "data.pt", work / "state.pt"

    t0 = time.monotonic()
    if data_file.exists() and not args.fresh:
        blob = torch.load(data_file, weights_only=False)
        _say(f"data: reusing {data_file} ({len(blob['train'])} + {len(blob['held'])} sequences)")
    else:
        blob = _make_data(args, backend, layers, D)
        blob["seconds"] = time.monotonic() - t0
        torch.save(blob, data_file)
    data_s = blob.get("seconds", 0.0)  # what making it took, also when reused
    train, held, draft_ids = blob["train"], blob["held"], blob["draft_ids"]
    for extra in args.extra_data:
        more = torch.load(extra, weights_only=False)
        if not torch.equal(more["draft_ids"].cpu(), draft_ids.cpu()):
            raise ValueError(f"--extra-data {extra}: another draft vocabulary than this run's "
                             "(start both from the same --init head)")
        train, held = train + more["train"], held + more["held"]
        _say(f"data: + {len(more['train'])} + {len(more['held'])} sequences from {extra}")

    head = T.new_head(backend, draft_ids, layers, seed=args.seed)
    if args.init:
        from nodes.drafters.eagle.checkpoint import VerifierShape, load_head

        start, start_layers = load_head(args.init, VerifierShape.of(backend))
        if tuple(start_layers) != tuple(layers) or not torch.equal(
                start.d2t.cpu() + torch.arange(len(start.d2t)), draft_ids.cpu()):
            raise ValueError(f"--init {args.init}: other layers or draft vocabulary than "
                             "this run's data")
        head.load_state_dict(start.state_dict())
        _say(f"starting from the head in {args.init}")
    head.to(device)
    head.shared_embedding = head.shared_embedding.to(device)
    state = opt = None
    if state_file.exists() and not args.fresh:
        saved = torch.load(state_file, weights_only=False)
        head.load_state_dict(saved["head"])
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr,
                                betas=(0.9, 0.95))
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        _say(f"resuming at step {state.step} ({state.elapsed_s:.0f} s trained)")

    def save(st, optimizer) -> None:
        tmp = state_file.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "opt": optimizer.state_dict(), "state": st}, tmp)
        os.replace(tmp, state_file)

    tokens = sum(len(e.tokens) for e in train)
    _say(f"training on {len(train)} sequences ({tokens} tokens), held out {len(held)}; "
         f"draft vocab {len(draft_ids)}, layers {list(layers)}, device {device}")
    state, opt = T.train_loop(head, train, held, steps=args.steps, ttt=args.ttt,
                              batch_size=args.batch, lr=args.lr, max_seconds=args.minutes * 60,
                              device=device, optimizer=opt, state=state, save=save,
                              save_every=args.save_every, report=_say, seed=args.seed)
    save(state, opt)
    held_acc = T.evaluate(head, held, args.ttt, device)
    meta = {
        "tokenizer_fingerprint": backend.fingerprint,
        "verifier": backend.model_name,
        "layer_ids": list(layers),
        "training": {
            "sequences": len(train), "tokens": tokens, "held_out_sequences": len(held),
            "steps": state.step, "epochs": state.epoch, "train_seconds": round(state.elapsed_s),
            "data_seconds": round(data_s), "ttt": args.ttt, "batch": args.batch,
            "lr": args.lr, "device": device, "draft_vocab": len(draft_ids),
            "init": args.init,
            "held_out_top1_per_depth": [round(a, 4) for a in held_acc],
        },
    }
    save_head(out, head, meta)
    _say(f"held-out top-1 per draft depth: {' / '.join(f'{a:.3f}' for a in held_acc)}; "
         f"head written to {out}")
    return 0


def _make_data(args, backend, layers, D) -> dict:
    import torch

    if args.chat_prompts:
        from nodes.training.prompts import chat_prompts

        prompts = chat_prompts(args.chat_prompts, seed=args.seed)
    elif not args.self_prompts:
        prompts = D.PROMPTS[: args.prompts] if args.prompts else D.PROMPTS
    else:
        prompts = []
    if args.self_prompts:
        prompts = list(prompts) + _self_prompts(args, backend, D)
    temps = tuple(float(t) for t in args.temperatures.split(","))
    t0 = time.monotonic()
    # each generation batch (tokens, hidden states, labels) is saved as it is made: an
    # interrupted run goes on where it was
    shards = Path(args.out) / ".train" / "responses"
    done = None if args.fresh else _load_shards(shards, D)
    if done is not None:
        _say(f"data: resuming after {len(done.tokens)} responses")

    def keep(seqs, start: int) -> None:
        shards.mkdir(parents=True, exist_ok=True)
        part = D.Sequences(seqs.tokens[start:], seqs.captured[start:])
        tmp = shards / f"{start:07d}.tmp"
        torch.save(part, tmp)
        os.replace(tmp, shards / f"{start:07d}.pt")
        _say(f"data: {len(seqs.tokens)} responses, {sum(map(len, seqs.tokens))} tokens, "
             f"{time.monotonic() - t0:.0f} s")

    deadline = t0 + args.gen_minutes * 60 if args.gen_minutes else None
    seqs = D.make_responses(backend, prompts, max_new=args.max_new, batch=args.gen_batch,
                            temperatures=temps, seed=args.seed, cycle=args.cycle_temperatures,
                            done=done, deadline=deadline, on_batch=keep, layers=layers)
    _say(f"data: {len(seqs.tokens)} responses (hidden states and labels captured while "
         f"generating) in {time.monotonic() - t0:.0f} s")
    # hold out whole prompts (all their responses), so held-out text is unseen in training
    n = len(prompts)
    every = max(2, args.hold_every)
    held_prompts = {i for i in range(n) if i % every == every - 1} or {n - 1}
    which = (lambda k: k) if args.cycle_temperatures else (lambda k: k % n)
    held_out = [which(k) in held_prompts for k in range(len(seqs.tokens))]
    text = D.Sequences([])
    for path in args.text:
        text.tokens += D.text_chunks(backend, Path(path).read_text())
    held_out += [False] * len(text.tokens)  # held-out accuracy is measured on responses
    if args.init:  # the starting head's draft vocabulary
        from nodes.drafters.eagle.checkpoint import VerifierShape, load_head

        start, _ = load_head(args.init, VerifierShape.of(backend))
        draft_ids = (start.d2t.cpu() + torch.arange(len(start.d2t))).long()
    else:
        draft_ids = D.draft_vocab(D.Sequences(seqs.tokens + text.tokens), args.draft_vocab,
                                  backend.vocab_size)
    skip = _shared_prefix(backend) if backend.tokenizer.has_chat_template else 0
    examples = D.examples_from_captured(seqs, draft_ids, skip=skip)
    examples += D.teacher_force(backend, text, layers, draft_ids)
    train = [e for e, h in zip(examples, held_out, strict=True) if not h]
    held = [e for e, h in zip(examples, held_out, strict=True) if h]
    _say(f"data: {len(examples)} sequences in {time.monotonic() - t0:.0f} s ({len(text.tokens)} "
         f"text chunks teacher-forced; the first {skip} positions of each response, the chat "
         "template's shared system prompt, read but not trained on)")
    return {"train": train, "held": held, "draft_ids": draft_ids,
            "responses": len(seqs.tokens)}


def _self_prompts(args, backend, D) -> list[str]:
    """The verifier's own prompts, kept in DIR/.train/self_prompts.json as they are written
    (a rerun reuses them, so its response batches still answer the same prompts)."""
    import json

    path = Path(args.out) / ".train" / "self_prompts.json"
    have = [] if args.fresh or not path.exists() else json.loads(path.read_text())
    if len(have) >= args.self_prompts:
        return have[: args.self_prompts]
    t0 = time.monotonic()

    def keep(prompts: list[str]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(prompts, ensure_ascii=False, indent=0))
        os.replace(tmp, path)
        _say(f"data: {len(prompts)} of {args.self_prompts} prompts written by the verifier, "
             f"{time.monotonic() - t0:.0f} s")

    prompts = D.model_written_prompts(backend, args.self_prompts, seed=args.seed,
                                      batch=args.gen_batch, on_batch=keep)
    keep(prompts)
    return prompts


def _load_shards(folder: Path, D):
    """The generation batches a previous run saved, in order (None: none saved)."""
    import torch

    files = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    if not files:
        return None
    out = D.Sequences([], [])
    for f in files:
        if int(f.stem) != len(out.tokens):
            raise ValueError(f"{folder}: batch file {f.name} does not follow the "
                             f"{len(out.tokens)} responses before it; remove the folder or "
                             "pass --fresh")
        part = torch.load(f, weights_only=False)
        out.tokens += part.tokens
        out.captured += part.captured
    return out


def _shared_prefix(backend) -> int:
    """Positions every chat-template prompt starts with (its system prompt), less the two
    tokens that lead into the user's turn."""
    from nodes.training.data import user_turn_prefix

    return max(0, len(user_turn_prefix(backend.tokenizer)) - 2)
