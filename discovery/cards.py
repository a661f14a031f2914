"""Capability cards: what a node can do, owned and versioned by that node.

A card is ordered by `(incarnation, version)` only. The incarnation grows at every start of a
node id (see `discovery.identity`) and when the node refutes a suspicion; the version grows
with every change the owner makes to its card during one incarnation. Wall clocks never take
part in ordering, so skewed clocks between machines cannot make an old card win.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import msgpack

from discovery.limits import (
    MAX_COUNTER,
    MAX_ENDPOINTS,
    MAX_EXTRAS_BYTES,
    MAX_FREE_MEM,
    MAX_PORT,
    MAX_RATE,
    MAX_VOCAB,
    is_counter,
    parse_decimal,
)

CLUSTER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KNOWN_ROLES = ("verifier", "proposer", "gateway")
MAX_ROLES = 8
MAX_TEXT = 200


class CardError(ValueError):
    """A card (from the wire or from the command line) is not acceptable."""

    hostile = False  # True: numbers no honest node sends (counted apart from malformed input)


class OutOfRange(CardError):
    """A card number (incarnation, version, sizes) outside what an honest node publishes."""

    hostile = True


def check_cluster(name: str) -> str:
    """Cluster names travel in DNS TXT records and ZeroMQ topics: keep them plain."""
    if not isinstance(name, str) or not CLUSTER_RE.match(name):
        raise CardError(
            f"cluster name must be 1-63 characters of letters, digits, '.', '_' or '-' "
            f"starting with a letter or digit, got {name!r}"
        )
    return name


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not NODE_ID_RE.match(node_id):
        raise CardError(f"node id must be 1-64 characters of [A-Za-z0-9._-], got {node_id!r}")
    return node_id


def new_node_id() -> str:
    """A random id, unique in practice (48 bits); the display name lives on the card."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Card:
    """One node's capabilities. Immutable: the owner makes a new one with `evolve()`."""

    node_id: str
    cluster: str
    incarnation: int
    version: int
    roles: tuple[str, ...]
    endpoints: dict[str, str]  # {"gossip": PUB endpoint, "stream": ROUTER endpoint}
    name: str = ""
    backend: str = ""
    model: str = ""
    tokenizer: str = ""  # tokenizer fingerprint
    vocab: int = 0
    tok_s: float = 0.0  # measured tokens per second
    load: float = 0.0
    free_mem: int = 0  # bytes
    observer: bool = False
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int]:
        """The owner's ordering: a card with a larger key replaces one with a smaller key."""
        return (self.incarnation, self.version)

    @property
    def is_worker(self) -> bool:
        """Observers are never counted as workers nor offered work."""
        return not self.observer and bool(self.roles)

    def evolve(self, **changes: Any) -> Card:
        """The next version of this card (same incarnation, version + 1)."""
        return replace(self, version=self.version + 1, **changes)

    def wire_fields(self) -> dict[str, Any]:
        """Fields of a `card` gossip message (the node id travels as the sender)."""
        out = asdict(self)
        del out["node_id"]
        out["roles"] = list(self.roles)
        out["endpoints"] = dict(self.endpoints)
        out["extras"] = dict(self.extras)
        return out

    def to_map(self) -> dict[str, Any]:
        """A self-contained map (node id included), as carried in snapshots."""
        return {"node_id": self.node_id, **self.wire_fields()}

    @classmethod
    def from_fields(cls, node_id: str, fields: dict[str, Any]) -> Card:
        """Build a card from wire fields already type-checked by the codec schema.

        Re-checks what the schema cannot (ids, cluster, endpoints, sizes), raising CardError.
        """
        check_node_id(node_id)
        check_cluster(fields.get("cluster"))
        inc, ver = fields.get("incarnation"), fields.get("version")
        for label, v in (("incarnation", inc), ("version", ver)):
            if not is_counter(v):
                raise OutOfRange(f"card {label} must be an integer in [0, {MAX_COUNTER}], "
                                f"got {v!r}"[:200])
        roles = fields.get("roles")
        if not isinstance(roles, list) or len(roles) > MAX_ROLES or not all(
            isinstance(r, str) and 0 < len(r) <= 32 for r in roles
        ):
            raise CardError(f"card roles must be a short list of role names, got {roles!r}")
        endpoints = fields.get("endpoints")
        if not isinstance(endpoints, dict) or len(endpoints) > MAX_ENDPOINTS:
            raise CardError(f"card endpoints must be a map of at most {MAX_ENDPOINTS} entries")
        if not all(isinstance(k, str) and len(k) <= 32 and isinstance(v, str) and len(v) <= 100
                   for k, v in endpoints.items()):
            raise CardError("card endpoints must map short names to short strings")
        for k in ("gossip", "stream"):
            if not check_endpoint(endpoints.get(k)):
                raise CardError(f"card endpoint {k!r} must be tcp://HOST:PORT, got "
                                f"{endpoints.get(k)!r}")
        kw: dict[str, Any] = {}
        for name, kind in (("name", str), ("backend", str), ("model", str), ("tokenizer", str),
                           ("vocab", int), ("tok_s", float), ("load", float),
                           ("free_mem", int), ("observer", bool), ("extras", dict)):
            v = fields.get(name)
            if v is None:
                continue
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise CardError(f"card field {name!r} must be {kind.__name__}, got {v!r}"[:200])
            if kind is str and len(v) > MAX_TEXT:
                raise CardError(f"card field {name!r} is longer than {MAX_TEXT} characters")
            if kind is str and not is_plain_text(v):
                raise CardError(f"card field {name!r} holds control characters (a terminal "
                                f"escape, a newline or a bidi override): {printable(v)!r}")
            _check_range(name, v)
            kw[name] = v
        return cls(node_id=node_id, cluster=fields["cluster"], incarnation=inc, version=ver,
                   roles=tuple(roles), endpoints=dict(endpoints), **kw)

    @classmethod
    def from_map(cls, data: Any) -> Card:
        """Inverse of `to_map` (snapshot entries); raises CardError."""
        if not isinstance(data, dict):
            raise CardError(f"snapshot entry must be a map, got {type(data).__name__}")
        return cls.from_fields(data.get("node_id"), data)


_NUMBER_RANGES: dict[str, tuple[float, float]] = {
    "vocab": (0, MAX_VOCAB), "free_mem": (0, MAX_FREE_MEM), "tok_s": (0.0, MAX_RATE),
    "load": (0.0, MAX_RATE),
}


def _check_range(name: str, v: Any) -> None:
    """Numbers within what a real node reports; extras small enough to gossip every 5 s."""
    if name in _NUMBER_RANGES:
        lo, hi = _NUMBER_RANGES[name]
        if not (math.isfinite(v) and lo <= v <= hi):
            raise OutOfRange(f"card field {name!r} must be in [{lo}, {hi}], got {v!r}"[:200])
    elif name == "extras":
        try:
            size = len(msgpack.packb(v))
        except (TypeError, ValueError, OverflowError) as exc:
            raise CardError(f"card extras cannot be encoded: {exc}"[:200]) from None
        if size > MAX_EXTRAS_BYTES:
            raise OutOfRange(f"card extras take {size} bytes, at most {MAX_EXTRAS_BYTES}")


_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def is_plain_text(text: str) -> bool:
    """No C0/C1 control character (ESC, newline, ...) and no bidi control: a peer-chosen
    string that cannot rewrite a terminal, forge a log line or reorder what is shown."""
    return _CONTROLS.search(text) is None


def printable(text: Any, limit: int = 80) -> str:
    """A peer-chosen value made safe to show (terminal, log, TUI): controls become `?`, and
    it is cut to `limit` characters. Use it wherever something from the wire is displayed."""
    out = _CONTROLS.sub("?", str(text))
    return out if len(out) <= limit else out[: limit - 1] + "…"


def check_endpoint(ep: Any) -> bool:
    """True for `tcp://HOST:PORT` with a numeric port (what our sockets bind and advertise)."""
    if not isinstance(ep, str) or not ep.startswith("tcp://") or len(ep) > 100:
        return False
    host, _, port = ep[len("tcp://"):].rpartition(":")
    number = parse_decimal(port, MAX_PORT)
    return bool(host) and number is not None and number > 0
