"""Bounds on every number membership accepts from outside (wire, mDNS, state files).

Incarnations and versions are counters that only ever grow by one at a time (a restart, a
refutation, a card change), so a peer never legitimately shows a huge jump, and no honest node
comes near the ceiling. The ceiling is far below what the codec can carry (2**64 - 1) and what
JSON tools print exactly (2**53), so a node can always encode its next incarnation.
"""

from __future__ import annotations

MAX_COUNTER = 2**53 - 1  # largest incarnation or version a card may hold
MAX_JUMP = 2**20  # largest plausible step between what we know of a node and what it claims
MAX_MEMBERS = 10_000  # largest cluster we accept (snapshot entries, suspects, view digest)
#: members one node keeps in its table (observers included). Each costs a SUB connection;
#: joins beyond it are refused and counted (`refused_joins`), departed members go first. Far
#: above "a handful of machines", far below what crashed a node (2,000 forged members).
MAX_TABLE = 256
MAX_CRC = 2**32 - 1
MAX_PORT = 65_535
MAX_PROTO = 2**16 - 1
MAX_VOCAB = 2**31 - 1
MAX_FREE_MEM = 2**63 - 1  # bytes
MAX_RATE = 1e12  # tok_s and load: finite, non-negative, below this
MAX_ENDPOINTS = 8  # entries in a card's endpoints map
MAX_EXTRAS_BYTES = 4096  # a card's extras map, as msgpack


def is_counter(v: object) -> bool:
    """A plain int in [0, MAX_COUNTER] (bools are not numbers here)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNTER


def is_plausible_step(known: int, claimed: int) -> bool:
    """`claimed` is no further ahead of `known` than a live node could have moved."""
    return claimed <= known + MAX_JUMP


def parse_decimal(text: str, maximum: int) -> int | None:
    """ASCII digits only (str.isdigit accepts '²', which int() rejects), at most `maximum`."""
    if not (0 < len(text) <= len(str(maximum)) and text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= maximum else None
