"""Find a shard group's members through cluster membership and assign ranks.

Every process of a group joins first as a non-worker member (no roles: never offered work)
whose card carries `extras.shard = {group, of, phase: "forming", store, layers}`; `store` is a
TCP port it already listens on, used only if it becomes rank 0. Once exactly `of` alive members
of the group are forming, each process sorts their node ids: that order is the ranks, the same
on every host without any hand-typed address.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

from discovery.table import State
from nodes.shard.layout import ShardConfigError

log = logging.getLogger(__name__)

FORMING = "forming"


@dataclass(frozen=True)
class Plan:
    """This process's place in a formed group."""

    rank: int
    world: int
    members: tuple[str, ...]  # node ids in rank order
    store_host: str
    store_port: int


def shard_extras(group: str, of: int, store_port: int, layers: int) -> dict:
    return {"group": group, "of": of, "phase": FORMING, "store": store_port, "layers": layers}


def listen_socket(host: str) -> socket.socket:
    """The socket a rank 0 hands to its TCP store: bound on the node's own address only."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(64)
    return sock


def _host_of(endpoint: str) -> str:
    return endpoint[len("tcp://"):].rpartition(":")[0]


def plan_from(cards: list, me: str, group: str, of: int) -> Plan | None:
    """Ranks from the forming members' cards, or None while the group is incomplete.

    Raises ShardConfigError when the members disagree (model, tokenizer, shard count) or when
    more processes than `of` claim the group's slots.
    """
    mine = [c for c in cards if (c.extras.get("shard") or {}).get("group") == group
            and (c.extras.get("shard") or {}).get("phase") == FORMING]
    if len(mine) > of:
        raise ShardConfigError(
            f"shard group {group!r}: {len(mine)} processes claim its {of} slots "
            f"({', '.join(sorted(c.node_id for c in mine))}); stop the extra one")
    if len(mine) < of or me not in {c.node_id for c in mine}:
        return None
    ref = next(c for c in mine if c.node_id == me)
    for c in mine:
        sh = c.extras["shard"]
        if sh.get("of") != of:
            raise ShardConfigError(f"shard group {group!r}: {c.node_id} runs --shards "
                                   f"{sh.get('of')}, this process --shards {of}")
        if c.model != ref.model or sh.get("layers") != ref.extras["shard"].get("layers"):
            raise ShardConfigError(f"shard group {group!r}: {c.node_id} runs model "
                                   f"{c.model!r}, this process {ref.model!r}")
        if c.tokenizer != ref.tokenizer:
            raise ShardConfigError(f"shard group {group!r}: {c.node_id} has a different "
                                   "tokenizer than this process")
    order = sorted(c.node_id for c in mine)
    leader = next(c for c in mine if c.node_id == order[0])
    port = leader.extras["shard"].get("store")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ShardConfigError(f"shard group {group!r}: rank 0 publishes a bad store port "
                               f"{port!r}")
    return Plan(order.index(me), of, tuple(order), _host_of(leader.endpoints["stream"]), port)


def wait_for_group(node, group: str, of: int, stop, poll_s: float = 0.1) -> Plan | None:
    """Block until the group is complete (a Plan), or `stop` is set (None)."""
    me = node.node_id
    announced = -1
    while not stop.is_set():
        cards = [m.card for m in node.membership.members(include_self=True)
                 if m.state is State.ALIVE or m.node_id == me]
        plan = plan_from(cards, me, group, of)
        if plan is not None:
            return plan
        seen = sum(1 for c in cards if (c.extras.get("shard") or {}).get("group") == group
                   and (c.extras.get("shard") or {}).get("phase") == FORMING)
        if seen != announced:
            log.info("shard group %r: %d of %d processes present", group, seen, of)
            announced = seen
        time.sleep(poll_s)
    return None
