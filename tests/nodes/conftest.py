import pytest

from bus.loop import IOLoop
from bus.sockets import SocketFactory
from bus.streams import StreamClient, StreamServer


class BusHost:
    """The part of `nodes.node.Node` a role uses (request registry + client), on a real bus."""

    def __init__(self, loop, factory, node_id="host"):
        self.node_id = node_id
        self.loop = loop
        self.factory = factory
        self._handlers = {}
        self.server = StreamServer(loop, factory, self._dispatch, sender=node_id)
        self.client = StreamClient(loop, factory, sender=node_id)
        self.membership = None

    def register_request(self, type_, fn):
        self._handlers[type_] = fn

    def _dispatch(self, req):
        fn = self._handlers.get(req.message.type)
        if fn is None:
            req.fail("unsupported", req.message.type)
        else:
            fn(req)


@pytest.fixture
def bus():
    loop = IOLoop(name="roles-io").start()
    factory = SocketFactory()
    yield loop, factory
    loop.stop()


@pytest.fixture
def host(bus):
    return BusHost(*bus)


def one_verifier(tmp_path_factory, *flags: str):
    """A local cluster of one real verifier process (`--threads 1` and `flags`), no mDNS, for
    a module-scoped fixture to yield and stop."""
    from tools.local_cluster import LocalCluster

    c = LocalCluster(log_dir=tmp_path_factory.mktemp("logs"), mdns=False)
    try:
        c.start_node("v", "--role", "verifier", "--threads", "1", *flags)
    except BaseException:
        c.stop()
        raise
    return c


def client_of(cluster):
    """A cluster client that knows the cluster's first node's stream (no mDNS)."""
    from nodes.cluster_client import ClusterClient

    return ClusterClient(cluster.cluster, peers=(cluster.nodes[0].stream,), mdns=False)
