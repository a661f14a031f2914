"""The `specbus` command: a thin dispatcher over subcommand modules.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command is chosen, so `specbus bench bus` never pays for
importing torch, and `nodes` has no import-time dependency on `tools`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from nodes.logs import LEVELS, configure_logging

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "node": ("nodes.cmd_node", "run a node (verifier, proposer and/or gateway: the "
                               "OpenAI-compatible API) until SIGINT/SIGTERM"),
    "generate": ("nodes.cmd_generate", "generate text, locally or through a cluster"),
    "members": ("tools.members", "join briefly as an observer and print the membership table"),
    "monitor": ("tools.monitor", "attach to the bus and watch the cluster live"),
    "demo": ("tools.demo", "start a local cluster and compare plain vs speculative decoding"),
    "bench": ("tools.bench", "benchmarks: bus, membership, decode, serve"),
    "keygen": ("nodes.cmd_keygen", "write a fresh cluster secret for --secret-file"),
    "train-drafter": ("nodes.training.command", "train an EAGLE-3 draft head for a verifier"),
}


def available_commands() -> dict[str, tuple[str, str]]:
    """Commands whose module is present in this installation."""
    return {
        name: spec
        for name, spec in COMMANDS.items()
        if importlib.util.find_spec(spec[0]) is not None
    }


def add_subcommands(
    parser: argparse.ArgumentParser,
    commands: dict[str, tuple[str, str]],
    argv: Sequence[str],
    dest: str,
) -> None:
    """Declare every command for `--help`, but import and configure only the chosen one.

    A module with a `SUBCOMMANDS` table (like `tools.bench`) is a dispatcher of its own.
    """
    chosen = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    sub = parser.add_subparsers(dest=dest, metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # accepted after the command too (`python -m nodes --role ... --log-level INFO`)
        p.add_argument("--log-level", type=str.upper, choices=LEVELS, default=argparse.SUPPRESS,
                       help="logging level (default: WARNING)")
        if chosen is not None and name == argv[chosen]:
            module = importlib.import_module(module_name)
            if hasattr(module, "SUBCOMMANDS"):
                present = {
                    n: s
                    for n, s in module.SUBCOMMANDS.items()
                    if importlib.util.find_spec(s[0]) is not None
                }
                add_subcommands(p, present, argv[chosen + 1 :], dest + "_sub")
            else:
                module.add_arguments(p)
                p.set_defaults(_run=module.run)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LEVELS,
        help="logging level (default: WARNING)",
    )


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specbus",
        description="Distributed speculative decoding on a ZeroMQ bus with gossip membership.",
    )
    add_common_arguments(parser)
    add_subcommands(parser, available_commands(), argv, "command")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the global --log-level may come before the command; strip its value before choosing
    scan = [a for i, a in enumerate(argv) if not (i > 0 and argv[i - 1] == "--log-level")]
    parser = build_parser(scan)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # `python -m nodes.cli COMMAND ...`, same as `specbus COMMAND ...`
    sys.exit(main())
