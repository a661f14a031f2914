"""`specbus keygen --out FILE`: write a fresh cluster secret (mode 0600) for --secret-file."""

from __future__ import annotations

import argparse
import sys

from bus.security import SecretError, Security, read_secret_file, write_secret_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="where to write the secret; must not exist (mode 0600)")


def run(args: argparse.Namespace) -> int:
    try:
        path = write_secret_file(args.out)
        tag = Security.from_secret(read_secret_file(path)).fingerprint
    except SecretError as exc:
        print(f"specbus keygen: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a cluster secret to {path} (cluster key fingerprint {tag}); copy it to every "
          f"node (keep mode 0600) and pass --secret-file {path}", file=sys.stderr)
    return 0
