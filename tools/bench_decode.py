"""`specbus bench decode --local`: plain vs speculative decoding on the embedded model.

(`--trace NAME`: repeated multi-request workloads, tools/bench_trace.py; without `--local`
or `--trace`: over the bus, tools/bench_decode_bus.py.)

One process, same prompts for every configuration: input-grounded (code edit, extraction and
quoting), where prompt lookup should shine, and open-ended chat, where speculation must not
hurt. Compares our engine (plain; ngram, int8 and the shipped EAGLE-3 head's drafts verified as
one chain and as token trees) with Hugging Face generate (plain, prompt lookup, assisted with
the same int8 drafter) and the MLX backend (plain, ngram). Reports medians over prompts per
class; greedy outputs are also checked against each backend's plain output.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
from collections.abc import Callable

from tools.arg_types import positive_int
from tools.bench_decode_bus import delay_list
from tools.decode_runs import Run, hf_runner
from tools.prompts import PROMPTS

log = logging.getLogger(__name__)

MLX_MAX_TOKENS = 48  # mlx[cpu] on Linux decodes at a few tok/s; keep its rows short


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true",
                        help="everything in this process (default: a local cluster of node "
                             "processes, over the bus vs in-process, plus a latency sweep)")
    parser.add_argument("--model", default=None, help="default: the embedded smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--quick", action="store_true", help="one prompt per class, 48 tokens, fewer configurations"
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="runs per prompt and configuration; --local: the fastest counts; over the bus: "
        "whole passes over each prompt (plain first and last in each), the median run counts",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for every configuration (default 1: with any background load, "
        "multi-threaded CPU forwards stall badly, which would swamp the comparison)",
    )
    parser.add_argument(
        "--delays",
        type=delay_list,
        default=None,
        help="over the bus: the proposers' added round trips to run, a comma-separated subset "
        "of 0,5,20,50 ms (default all; HF and in-process rows come with 0). '--delays 50 "
        "--repeat 5' measures the far-proposer rows alone with five passes a prompt",
    )
    parser.add_argument("--no-mlx", action="store_true", help="skip the MLX rows")
    parser.add_argument("--json", metavar="PATH", default=None, help="write results as JSON")
    from tools.bench_trace import add_arguments as add_trace_arguments

    add_trace_arguments(parser)  # --trace and its options (repeated workloads, issue #25)


def _engine_runner(engine) -> Callable[[list[int], int], Run]:
    from nodes.engine.core import GenerationParams

    def run(ids: list[int], n: int) -> Run:
        g = engine.generate(ids, GenerationParams(max_tokens=n))
        spec = g.stats.spec_blocks > 0
        return Run(
            g.token_ids,
            g.elapsed_s,
            g.stats.acceptance if spec else None,
            g.stats.mean_accepted_len if spec else None,
        )

    return run


def _configs(args) -> list[tuple[str, str, Callable[[], Callable[[list[int], int], Run]]]]:
    """(name, backend, factory); factories load lazily so a failing one is skipped alone."""
    from nodes.backends.registry import load_backend
    from nodes.drafters.int8 import Int8Drafter, calibration_batches, quantize_int8
    from nodes.drafters.model import TREE_WIDTH
    from nodes.drafters.ngram import NgramDrafter
    from nodes.engine.core import Engine

    cache: dict = {}

    def torch_backend():
        if "torch" not in cache:
            cache["torch"] = load_backend("torch", args.model)
        return cache["torch"]

    def int8():
        if "int8" not in cache:
            cache["int8"] = Int8Drafter.from_verifier(torch_backend())
        return cache["int8"]

    def hf_int8():
        """HF's assistant must be an HF model: the same smoothed int8 copy, as HF modules (the
        drafter's lean forward computes the same logits, nodes/backends/lean_llama.py)."""
        verifier = torch_backend()
        return quantize_int8(verifier.model, calibration_batches(verifier.tokenizer))

    def int8_chain():
        return Int8Drafter(int8().backend, name="int8", tree_width=1)

    def int8_tree():
        """Trees whatever the drafter's own default (chains where it is weight-only int8)."""
        return Int8Drafter(int8().backend, name="int8", tree_width=TREE_WIDTH)

    def eagle(tree_width: int):
        """The shipped EAGLE-3 head (int8 weights on a CPU), reading this verifier's hidden
        states in process."""
        from nodes.drafters.eagle.source import EagleDrafter

        if "eagle" not in cache:
            cache["eagle"] = EagleDrafter.load(None, torch_backend())
        head = cache["eagle"]
        return EagleDrafter(head.head, head.layers, head.fingerprint, tree_width=tree_width)

    def mlx_backend():
        if "mlx" not in cache:
            cache["mlx"] = load_backend("mlx", args.model)
        return cache["mlx"]

    configs = [
        ("engine-plain", "torch", lambda: _engine_runner(Engine(torch_backend()))),
        (
            "engine-ngram-chain",
            "torch",
            lambda: _engine_runner(Engine(torch_backend(), NgramDrafter(), tree=False)),
        ),
        (
            "engine-ngram-tree",
            "torch",
            lambda: _engine_runner(Engine(torch_backend(), NgramDrafter(branches=4))),
        ),
        ("hf-plain", "torch", lambda: hf_runner(torch_backend())),
        (
            "hf-prompt-lookup",
            "torch",
            lambda: hf_runner(torch_backend(), prompt_lookup_num_tokens=10),
        ),
        (
            "engine-int8-chain",
            "torch",
            lambda: _engine_runner(Engine(torch_backend(), int8_chain())),
        ),
        ("engine-int8-tree", "torch",
         lambda: _engine_runner(Engine(torch_backend(), int8_tree()))),
        (
            "hf-assisted-int8",
            "torch",
            lambda: hf_runner(torch_backend(), assistant_model=hf_int8()),
        ),
    ]
    if args.model is None:  # the shipped head is the embedded model's
        configs += [
            ("engine-eagle-chain", "torch",
             lambda: _engine_runner(Engine(torch_backend(), eagle(1)))),
            ("engine-eagle-tree", "torch",
             lambda: _engine_runner(Engine(torch_backend(), eagle(4)))),
        ]
    if not args.no_mlx:
        configs += [
            ("mlx-plain", "mlx", lambda: _engine_runner(Engine(mlx_backend()))),
            ("mlx-ngram", "mlx", lambda: _engine_runner(Engine(mlx_backend(), NgramDrafter()))),
        ]
    if args.quick:
        keep = {"engine-plain", "engine-ngram-chain", "engine-ngram-tree", "hf-prompt-lookup",
                "engine-int8-chain", "engine-int8-tree", "engine-eagle-chain",
                "engine-eagle-tree"}
        configs = [c for c in configs if c[0] in keep or (c[1] == "mlx" and not args.no_mlx)]
    return configs


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def run(args: argparse.Namespace) -> int:
    from nodes.engine.errors import GenerationError

    try:
        if getattr(args, "trace", None):
            from tools.bench_trace import run_trace

            return run_trace(args)
        if not args.local:
            from tools.bench_decode_bus import run_bus

            return run_bus(args, PROMPTS)
        return _run(args)
    except GenerationError as exc:
        print(f"specbus bench decode: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from nodes import models
    from nodes.backends.tokenizer import Tokenizer

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    n = 48 if args.quick else args.max_tokens
    prompts = PROMPTS
    if args.quick:
        prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    tok = Tokenizer(models.resolve(args.model).path)
    encoded = [(cls, tok.encode(text, chat=True)) for cls, text in prompts]

    runners = []
    for name, backend, factory in _configs(args):
        try:
            runner = factory()
            runner(encoded[0][1][:32], 8)  # warm-up (allocations, learnt costs)
        except Exception as exc:  # noqa: BLE001 - one broken configuration must not end the run
            log.warning("skipping %s: %s", name, exc)
            print(f"  skipped {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        runners.append((name, backend, runner))

    # interleave configurations prompt by prompt, so background load hits them all alike
    per_prompt: list[dict] = []
    baseline: dict[str, list[int]] = {}  # backend:prompt -> plain output, for the identity check
    plain_speed: dict[int, float] = {}
    mlx_prompts = {0, 2, 4} if not args.quick else {0, 1, 2}  # MLX on CPU is slow: a subset
    for i, (cls, ids) in enumerate(encoded):
        for name, backend, runner in runners:
            if backend == "mlx" and i not in mlx_prompts:
                continue
            budget = min(n, MLX_MAX_TOKENS) if backend == "mlx" else n
            r = min((runner(ids, budget) for _ in range(args.repeat)), key=lambda x: x.elapsed_s)
            tps = len(r.token_ids) / r.elapsed_s
            key = f"{backend}:{i}"
            if name in ("engine-plain", "mlx-plain"):
                baseline[key] = r.token_ids
            if name == "engine-plain":
                plain_speed[i] = tps
            if name == "mlx-plain":
                plain_speed[-1 - i] = tps
            base = plain_speed.get(-1 - i if backend == "mlx" else i)
            row = {
                "name": name,
                "backend": backend,
                "prompt_class": cls,
                "prompt": i,
                "tokens": len(r.token_ids),
                "elapsed_s": round(r.elapsed_s, 3),
                "tok_per_s": round(tps, 2),
                "speedup": round(tps / base, 3) if base else None,
                "acceptance": r.acceptance,
                "mean_accepted_len": r.mean_accepted_len,
                "identical_to_plain": (r.token_ids == baseline[key]) if key in baseline else None,
            }
            per_prompt.append(row)
            print(
                f"  {name:18s} {cls:15s} prompt {i}: {tps:6.1f} tok/s "
                f"speedup {row['speedup']} acc {r.acceptance}",
                file=sys.stderr,
                flush=True,
            )

    rows = []
    for name in dict.fromkeys(r["name"] for r in per_prompt):
        for cls in dict.fromkeys(r["prompt_class"] for r in per_prompt):
            sel = [r for r in per_prompt if r["name"] == name and r["prompt_class"] == cls]
            if not sel:
                continue
            rows.append(
                {
                    "name": name,
                    "backend": sel[0]["backend"],
                    "prompt_class": cls,
                    "prompts": len(sel),
                    "tok_per_s": _median(r["tok_per_s"] for r in sel),
                    "speedup": _median(r["speedup"] for r in sel),
                    "acceptance": _median(r["acceptance"] for r in sel),
                    "mean_accepted_len": _median(r["mean_accepted_len"] for r in sel),
                    "identical_to_plain": all(r["identical_to_plain"] is not False for r in sel),
                }
            )
    _print_table(rows, n)
    if args.json:
        doc = {
            "rows": rows,
            "threads": args.threads,
            "per_prompt": per_prompt,
            "max_tokens": n,
            "quick": args.quick,
            "command": "specbus " + " ".join(sys.argv[1:]),
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "loadavg_end": os.getloadavg(),
            },
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _print_table(rows: list[dict], n: int) -> None:
    print(
        f"decode benchmark: up to {n} new tokens per prompt (MLX: {min(n, MLX_MAX_TOKENS)}, "
        "fewer prompts), medians over prompts; speedup vs our plain greedy on the same prompt "
        "and backend"
    )
    print(
        f"{'name':18s} {'backend':7s} {'class':15s} {'tok/s':>7s} {'speedup':>8s} "
        f"{'accept':>7s} {'mean acc':>8s} {'identical':>9s}"
    )
    for r in rows:
        print(
            f"{r['name']:18s} {r['backend']:7s} {r['prompt_class']:15s} "
            f"{_fmt(r['tok_per_s'], '7.1f')} {_fmt(r['speedup'], '8.2f')} "
            f"{_fmt(r['acceptance'], '7.2f')} {_fmt(r['mean_accepted_len'], '8.2f')} "
            f"{str(r['identical_to_plain']):>9s}"
        )
