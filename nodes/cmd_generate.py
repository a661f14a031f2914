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
from nodes.backends.weights import CHOICES as WEIGHT_CHOICES
from nodes.cluster_args import add_cluster_arguments
from nodes.engine.errors import GenerationError

log = logging.getLogger(__name__)


#: flags of --local alone: the cluster's verifier decides these
LOCAL_ONLY = ("model", "drafter", "backend", "max_draft", "weights", "kv_sink", "kv_window")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="verifier and drafter in this process")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text")
    what.add_argument("--messages", type=_messages_file, metavar="FILE",
                      help="a conversation: a JSON file holding an OpenAI-style list of "
                           "{role, content} messages (system, user, assistant)")
    parser.add_argument("--system", default=None, help="system message (chat mode)")
    local = parser.add_argument_group("local mode (--local only)")
    local.add_argument("--drafter", default=None,
                       help="none | ngram | suffix | int8 | eagle[:PATH] | model:<ref> "
                            "(default: ngram)")
    local.add_argument("--model", default=None,
                       help="alias, folder or cached HF repo id (default: the embedded "
                            "smollm2-135m)")
    local.add_argument("--backend", default=None, choices=("torch", "mlx"),
                       help="default: torch")
    local.add_argument("--weights", default=None, choices=WEIGHT_CHOICES,
                       help="the verifier's weights (default auto, or $SPECBUS_WEIGHTS: a GGUF "
                            "model's own blocks on a CPU, the embedded model's included, else "
                            "fp32; fp32: identical to HF; q8/q4: quantized at load; file: a "
                            "--model FILE.gguf's own blocks; speculation is identical to the "
                            "same weights' plain decoding)")
    local.add_argument("--max-draft", type=int, default=None,
                       help="longest draft block (default 16)")
    local.add_argument("--kv-sink", type=int, default=None, metavar="S",
                       help="bounded K/V: every full-attention layer attends to the first S "
                            "positions and the last --kv-window W and keeps only those "
                            "(both or neither)")
    local.add_argument("--kv-window", type=int, default=None, metavar="W",
                       help="the bounded K/V's window of recent positions (with --kv-sink)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling mass, in (0, 1] (default 1: off)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (default 0: off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for sampling: same seed, same request, same text "
                             "(default: a fresh one)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="drop tokens less likely than MIN_P times the most likely one")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="HF's repetition penalty over prompt and output, > 0 (1: off)")
    parser.add_argument("--presence-penalty", type=float, default=None,
                        help="OpenAI's presence penalty over the output, -2..2 (0: off)")
    parser.add_argument("--frequency-penalty", type=float, default=None,
                        help="OpenAI's frequency penalty over the output, -2..2 (0: off)")
    parser.add_argument("--logit-bias", action="append", default=None, type=_bias,
                        metavar="ID=BIAS", help="add BIAS (-100..100) to token ID's logit "
                        "(repeatable)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default: on)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    shape = parser.add_argument_group("constrained output (one of)").add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=_constraint_file("json_schema"), metavar="FILE",
                       dest="constraint", default=None,
                       help="every output is JSON valid against the JSON schema in FILE "
                            "(compact: no free whitespace); the prompt should ask for it")
    shape.add_argument("--grammar", type=_constraint_file("lark"), metavar="FILE",
                       dest="constraint", help="every output matches the Lark grammar in FILE "
                                               "(llguidance's Lark: start rule `start`)")
    shape.add_argument("--regex", type=_constraint_text("regex"), metavar="PATTERN",
                       dest="constraint", help="every output matches the regular expression "
                                               "PATTERN (whole output, anchored)")
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


def _bias(text: str) -> tuple[int, float]:
    """`--logit-bias ID=BIAS` (argparse type); the ranges are `SamplingParams.check`'s."""
    tok, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKEN_ID=BIAS") from None


def _messages_file(path: str) -> list[dict[str, str]]:
    """`--messages FILE`: read and check an OpenAI-style conversation (argparse type)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("messages"), list):
        data = data["messages"]  # a whole request body is fine too
    from codec.chat import chat_messages
    from codec.errors import BadRequest

    try:
        return [m.as_dict() for m in chat_messages("messages", data)]
    except BadRequest as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None


def _checked(c, where: str):
    """`c` checked without a tokenizer (size, JSON, compiles under the verifier's limits):
    argparse's error naming `where` and the reason otherwise."""
    from nodes.engine.errors import BadRequestError
    from nodes.engine.grammar import validate

    try:
        validate(c)
    except BadRequestError as exc:
        raise argparse.ArgumentTypeError(f"{where}: {exc}") from None
    return c


def _constraint_file(kind: str):
    """`--json-schema FILE` / `--grammar FILE`: read FILE, check its constraint (argparse
    type): a missing file, bad JSON or a schema that does not compile is an error naming
    FILE and why, before any model loads or anything is sent."""
    from nodes.engine.grammar import Constraint

    def read(path: str):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{path} is not UTF-8 text: {exc}") from None
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{path} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise argparse.ArgumentTypeError(
                    f"{path}: a JSON schema is an object (or a boolean), got "
                    f"{type(schema).__name__}")
            return _checked(Constraint.json_schema(schema), path)
        return _checked(Constraint(kind, text), path)

    return read


def _constraint_text(kind: str):
    from nodes.engine.grammar import Constraint

    def parse(text: str):
        return _checked(Constraint(kind, text), repr(text))

    return parse


def run(args: argparse.Namespace) -> int:
    try:
        return _run_local(args) if args.local else _run_cluster(args)
    except (GenerationError, CodecError) as exc:
        print(f"specbus generate: {exc}", file=sys.stderr)
        return 2


def _request(args: argparse.Namespace):
    """The wire's typed request (validated: a bad value raises BadRequest naming the field)."""
    from codec.errors import BadRequest
    from codec.sampling import SamplingParams
    from nodes.cluster_client import GenerateRequest

    prompt, messages = args.prompt, args.messages
    if messages is not None:
        if args.system:
            messages = [{"role": "system", "content": args.system}, *messages]
    elif not prompt.strip():
        raise BadRequest("prompt", "empty prompt: must hold some text")
    elif args.system and args.chat:  # the verifier renders them with its chat template
        prompt, messages = None, [{"role": "system", "content": args.system},
                                  {"role": "user", "content": args.prompt}]
    return GenerateRequest(
        prompt=prompt, messages=messages, max_tokens=args.max_tokens,
        sampling=SamplingParams(
            args.temperature, args.top_p, args.top_k, args.seed, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            logit_bias=tuple(sorted(args.logit_bias)) if args.logit_bias else None),
        stop=tuple(args.stop),
        chat=args.chat, speculate=not getattr(args, "no_speculate", False),
        proposers=getattr(args, "proposers", None),
        force_draft=getattr(args, "force_draft", False),
        grammar=None if args.constraint is None else args.constraint.to_wire(),
    )


def _run_cluster(args: argparse.Namespace) -> int:
    """Stream a generation from a verifier of the cluster; `--json` ends with its figures."""
    from nodes.cluster_client import ClusterClient, ClusterError
    from nodes.engine.errors import BadRequestError
    from nodes.node import parse_peer

    given = [f"--{k.replace('_', '-')}" for k in LOCAL_ONLY if getattr(args, k) is not None]
    if given:
        raise BadRequestError(f"{', '.join(given)} only apply with --local: in cluster mode the "
                              "verifier's model and the cluster's proposers are used (pick "
                              "proposers with --proposer)", "local")
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
    from nodes.backends.weights import default_weights
    from nodes.local_run import (
        LocalConfig,
        encode_prompt,
        load_engine,
        result_dict,
    )
    from nodes.node_common.requests import generation_params

    # validate cheap things before loading a model: the same typed path as the wire
    req = _request(args)
    params = generation_params(req)
    from nodes.backends.kv_bound import check_kv_bound

    check_kv_bound(args.kv_sink, args.kv_window)  # before the model loads
    drafter = args.drafter or "ngram"
    engine = load_engine(
        LocalConfig(
            args.model,
            args.backend or "torch",
            None if drafter == "none" else drafter,
            16 if args.max_draft is None else args.max_draft,
            args.weights or default_weights(args.kv_sink is not None
                                            or args.kv_window is not None),
            args.kv_sink,
            args.kv_window,
        )
    )
    if req.messages is not None:
        ids = engine.backend.tokenizer.encode_messages([m.as_dict() for m in req.messages])
    else:
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

    gen = engine.generate(ids, params, on_block=None if args.json else stream)
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
