"""`specbus generate`: generate text with speculative decoding.

`--local` runs verifier and drafter in this process. Without it, the command joins `--cluster`
as an observer, finds a verifier through discovery, and streams the text it commits (drafts
come from the cluster's proposers).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from codec.errors import CodecError
from nodes.cluster_args import add_cluster_arguments
from nodes.engine.errors import GenerationError

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="verifier and drafter in this process")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--system", default=None, help="system message (chat mode)")
    parser.add_argument(
        "--drafter", default="ngram", help="none | ngram | int8 | model:<ref> (default: ngram)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="alias, folder or cached HF repo id (default: the embedded smollm2-135m)",
    )
    parser.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-draft", type=int, default=16, help="longest draft block")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default: on)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    cluster = add_cluster_arguments(parser, "cluster mode (without --local)")
    cluster.add_argument("--wait", type=float, default=10.0,
                         help="seconds to wait for a verifier to appear (default 10)")
    cluster.add_argument("--no-speculate", action="store_true",
                         help="ask the verifier to decode plainly (a baseline)")
    cluster.add_argument("--proposer", action="append", default=None, dest="proposers",
                         metavar="ID|NAME", help="use only these proposers (repeatable)")
    cluster.add_argument("--force-draft", action="store_true",
                         help="ask exactly the --proposer nodes every block, never judging "
                              "them slow (output is still verified: tests, demos)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run_local(args) if args.local else _run_cluster(args)
    except (GenerationError, CodecError) as exc:
        print(f"specbus generate: {exc}", file=sys.stderr)
        return 2


def _request(args: argparse.Namespace):
    """The typed request (validated: a bad value raises BadRequest naming the field)."""
    from codec.errors import BadRequest
    from nodes.cluster_client import GenerateRequest

    if not args.prompt.strip():
        raise BadRequest("prompt", "empty prompt: must hold some text")
    prompt, messages = args.prompt, None
    if args.system and args.chat:  # the verifier renders them with its chat template
        prompt, messages = None, [{"role": "system", "content": args.system},
                                  {"role": "user", "content": args.prompt}]
    req = GenerateRequest(
        prompt=prompt, messages=messages, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        stop=tuple(args.stop),
        chat=args.chat, speculate=not getattr(args, "no_speculate", False),
        proposers=getattr(args, "proposers", None),
        force_draft=getattr(args, "force_draft", False),
    )
    req.typed()
    return req


def _run_cluster(args: argparse.Namespace) -> int:
    """Stream a generation from a verifier of the cluster; `--json` ends with its figures."""
    from nodes.cluster_client import ClusterClient, ClusterError
    from nodes.engine.errors import BadRequestError
    from nodes.node import parse_peer

    req = _request(args)
    try:
        peers = tuple(parse_peer(p) for p in args.peer)
    except ValueError as exc:
        raise BadRequestError(str(exc), "peer") from None
    show = None if args.json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    try:
        with ClusterClient(args.cluster, args.interface, peers, mdns=not args.no_mdns,
                           secret_file=args.secret_file, insecure=args.insecure) as client:
            result = client.generate(req, client.verifiers(args.wait)[0], on_text=show)
    except ClusterError as exc:
        print(f"specbus generate: {exc}", file=sys.stderr)
        return 2 if exc.code in ("bad_request", "too_long") else 1
    except ValueError as exc:
        print(f"specbus generate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print()
    return 0


def _run_local(args: argparse.Namespace) -> int:
    from nodes.engine.local import (
        LocalConfig,
        encode_prompt,
        generate_text,
        load_engine,
        result_dict,
    )
    from nodes.roles.requests import generation_params

    # validate cheap things before loading a model: the same typed path as the wire
    params = generation_params(_request(args).typed())
    engine = load_engine(
        LocalConfig(
            args.model,
            args.backend,
            None if args.drafter == "none" else args.drafter,
            args.max_draft,
        )
    )
    ids = encode_prompt(engine, args.prompt, chat=args.chat, system=args.system)

    shown = [0]
    # hold back what could be the start of a stop string until the block that settles it
    holdback = max((len(x) for x in args.stop), default=1) - 1

    def show(block) -> None:
        text = block.text
        if text is None:
            return
        end = len(text) if block.finish_reason else max(len(text) - holdback, shown[0])
        sys.stdout.write(text[shown[0] : end])
        sys.stdout.flush()
        shown[0] = end

    decode = engine.backend.tokenizer.decode
    generated: list[int] = []

    def stream(block) -> None:
        generated.extend(block.token_ids)
        if block.text is None:
            block.text = decode(generated)
        show(block)

    gen = generate_text(engine, ids, params, on_block=None if args.json else stream)
    result = result_dict(engine, gen)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        sys.stdout.write(gen.text[shown[0] :] + "\n")
        print(
            f"[{len(gen.token_ids)} tokens, {result['tok_per_s']:.1f} tok/s, "
            f"drafter {result['drafter']}, acceptance {result['acceptance']:.2f}, "
            f"mean accepted {result['mean_accepted_len']:.2f}, finish {gen.finish_reason}]",
            file=sys.stderr,
        )
    return 0
