"""Membership gossip (`heartbeat`, `leave`) parsed into typed objects, with every number
range-checked, in one place. Cards are parsed by `discovery.cards.Card.from_fields`.

The codec has already checked the field kinds; here come the bounds the codec cannot know:
counters in [0, MAX_COUNTER], a view digest of a plausible size, a suspects list no longer
than a cluster and made of node ids. Errors say whether the message was merely malformed or
carried absurd numbers (`hostile`); the caller drops and counts either (`drop`), never
raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from codec.messages import Message
from discovery.cards import CardError, check_node_id
from discovery.counters import Counters
from discovery.limits import MAX_COUNTER, MAX_CRC, MAX_MEMBERS, is_counter

log = logging.getLogger("discovery.membership")


class MalformedGossip(CardError):
    """A membership message with a missing or ill-shaped field."""

    hostile = False


class HostileGossip(MalformedGossip):
    """A membership message whose numbers no honest node sends."""

    hostile = True


@dataclass(frozen=True)
class Heartbeat:
    sender: str
    incarnation: int
    version: int
    peers: tuple[int, int] | None  # (count, crc32) of the sender's live view, if sent
    suspects: tuple[str, ...]


@dataclass(frozen=True)
class Leave:
    sender: str
    incarnation: int


def parse_heartbeat(msg: Message) -> Heartbeat:
    sender = _sender(msg)
    inc, ver = _counter(msg, "incarnation"), _counter(msg, "version")
    peers = msg.get("peers")
    if peers is not None:
        if not (isinstance(peers, list) and len(peers) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in peers)):
            raise MalformedGossip(f"heartbeat peers must be [count, crc32], got {peers!r}"[:200])
        if not (1 <= peers[0] <= MAX_MEMBERS and 0 <= peers[1] <= MAX_CRC):
            raise HostileGossip(f"heartbeat peers digest out of range: {peers!r}"[:200])
        peers = (peers[0], peers[1])
    suspects = msg.get("suspects") or []
    if len(suspects) > MAX_MEMBERS:
        raise HostileGossip(f"heartbeat lists {len(suspects)} suspects, at most {MAX_MEMBERS}")
    for s in suspects:
        try:
            check_node_id(s)
        except CardError:
            raise MalformedGossip(f"heartbeat suspect {s!r} is not a node id"[:200]) from None
    return Heartbeat(sender, inc, ver, peers, tuple(suspects))


def parse_leave(msg: Message) -> Leave:
    return Leave(_sender(msg), _counter(msg, "incarnation"))


def _sender(msg: Message) -> str:
    try:
        return check_node_id(msg.sender)
    except CardError:
        raise MalformedGossip(f"{msg.type} sender {msg.sender!r} is not a node id"[:200]) \
            from None


def _counter(msg: Message, name: str) -> int:
    v = msg.get(name)
    if not is_counter(v):
        raise HostileGossip(f"{msg.type} {name} must be in [0, {MAX_COUNTER}], got {v!r}"[:200])
    return v


def drop(counters: Counters, what: str, exc: CardError) -> None:
    """Count a message we refuse: `hostile` for absurd numbers, else `dropped`."""
    counters.inc("hostile" if exc.hostile else "dropped")
    log.debug("dropped %s: %s", what, exc)
