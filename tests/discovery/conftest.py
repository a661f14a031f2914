"""Fixtures and helpers for discovery tests (helpers are fixtures: tests/ is not a package)."""

from __future__ import annotations

import pytest

from bus.sockets import SocketFactory, bind
from codec.messages import encode, make
from discovery.membership import topic_for
from discovery.table import Timeouts
from nodes.node import Node, NodeConfig
from tests.polling import wait_until

FAST = Timeouts(heartbeat=0.05, suspect_after=0.5, dead_after=1.0, forget_after=30.0,
                check_every=0.02)


#: the membership gossip topic of cluster "specbus", as a raw PUB sends it
TOPIC = topic_for("specbus").encode()


def gossip_frames(type_, sender, **fields):
    """One gossip message as a raw PUB socket sends it: [topic, header, ...]."""
    return [TOPIC, *encode(make(type_, sender=sender, **fields))]


@pytest.fixture
def raw_pub():
    """A bare PUB socket on loopback (sock, endpoint): a hostile or broken peer's gossip."""
    sock = SocketFactory().pub()
    endpoint = bind(sock, "tcp://127.0.0.1:0")
    yield sock, endpoint
    sock.close(linger=0)


_wait_until = wait_until  # the suite's one poll (tests/polling.py), as a fixture below


def _seed_of(node: Node) -> str:
    return node.server.endpoint


def _view(node: Node) -> dict[str, str]:
    """node id -> state, as this node sees the others."""
    return {m.node_id: m.state.value for m in node.membership.members(include_self=False)}


@pytest.fixture
def wait_until():
    return _wait_until


@pytest.fixture
def seed_of():
    return _seed_of


@pytest.fixture
def view():
    return _view


@pytest.fixture
def make_node(tmp_path):
    """Start in-process nodes (no mDNS unless asked); stops them all at teardown."""
    nodes: list[Node] = []

    def start(**kw) -> Node:
        kw.setdefault("mdns", False)
        kw.setdefault("timeouts", FAST)
        kw.setdefault("roles", ("proposer",))
        kw.setdefault("state_dir", tmp_path)
        node = Node(NodeConfig(**kw)).start()
        nodes.append(node)
        return node

    yield start
    for n in nodes:
        n.stop(leave=False)
