"""What a role gets from its node, in one place: `RoleHost`.

A role (`VerifierRole`, `ProposerRole`, `GatewayRole`, the suffix-share `Publisher` and
`Subscriber`) is handed the node once, in `attach(node)`, before the node starts; everything it
uses of the node afterwards is listed here. `nodes.node.Node` is the one implementation; tests
may pass any object with these members. tests/nodes/test_role_host.py checks both sides: every
member a role module reads off its node is declared here, and `Node` has every one of them.

Threads: `register_request` / `register_gossip` are called from `attach` (before start); the
handlers they register run on the I/O thread (`loop`); `loop.call_soon` is how another thread
hands work to it. `gossip`, `server`, `client` and `membership` exist once the node has started
(None before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from bus.gossip import GossipChannel
    from bus.loop import IOLoop
    from bus.sockets import SocketFactory
    from bus.streams import Request, StreamClient, StreamServer
    from codec.messages import Message
    from discovery.membership import Membership


class HostConfig(Protocol):
    """The node settings a role reads."""

    #: the cluster's name: topics (`stats`, `suffix_pub`) and keys derive from it
    cluster: str


class RoleHost(Protocol):
    """The node as a role sees it."""

    config: HostConfig
    #: the I/O thread: `in_loop()`, `call_soon`, `call_later`
    loop: IOLoop
    #: makes the sockets a role owns itself (a verifier's `DirectClient` DEALERs)
    factory: SocketFactory
    gossip: GossipChannel | None
    #: the request server (a role reads which connections are alive: `liveness`)
    server: StreamServer | None
    #: requests to other members (suffix share, the gateway's generations)
    client: StreamClient | None
    #: the member table: `workers()`, `get(id)`, `members()`, `subscribe`, `card`
    membership: Membership | None

    @property
    def node_id(self) -> str: ...

    def register_request(self, type_: str, fn: Callable[[Request], None]) -> None:
        """`fn` answers requests of `type_` (on the I/O thread)."""

    def register_gossip(self, type_: str, fn: Callable[[str, Message], None]) -> None:
        """`fn(topic, message)` gets gossip of `type_` (on the I/O thread)."""


class Role(Protocol):
    """What the node drives of a role: attach before start, close at shutdown."""

    def attach(self, node: RoleHost) -> None: ...

    def close(self) -> None: ...


def members(cls: Any) -> frozenset[str]:
    """The names a Protocol class declares: annotated attributes, methods, properties."""
    names = set(getattr(cls, "__annotations__", {}))
    names |= {n for n, v in vars(cls).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return frozenset(names)


#: everything a role may use of its node (tests/nodes/test_role_host.py holds roles to it)
HOST_MEMBERS: frozenset[str] = members(RoleHost)

__all__ = ["HOST_MEMBERS", "HostConfig", "Role", "RoleHost", "members"]
