from contextlib import contextmanager

import pytest

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
def bus(loop, factory):
    """(loop, factory): a started I/O loop and a socket factory (tests/conftest.py)."""
    return loop, factory


@pytest.fixture
def host(bus):
    return BusHost(*bus)


def one_verifier(tmp_path_factory, *flags: str, proposers=()):
    """A local cluster of one real verifier process (`--threads 1` and `flags`), no mDNS, for
    a module-scoped fixture to yield and stop; `proposers`: (name, *flags) each, a seeded
    `--role proposer` process started after it (the cluster stopped if one fails)."""
    from tools.local_cluster import LocalCluster

    c = LocalCluster(log_dir=tmp_path_factory.mktemp("logs"), mdns=False)
    try:
        c.start_node("v", "--role", "verifier", "--threads", "1", *flags)
        for name, *proposer_flags in proposers:
            c.start_node(name, "--role", "proposer", *proposer_flags, seed=True)
    except BaseException:
        c.stop()
        raise
    return c


@contextmanager
def client_of(cluster, verifiers_s: float | None = None):
    """A cluster client that knows the cluster's first node's stream (no mDNS), closed on exit;
    with `verifiers_s`, once it has seen a verifier (waiting up to that long)."""
    from nodes.cluster_client import ClusterClient

    with ClusterClient(cluster.cluster, peers=(cluster.nodes[0].stream,), mdns=False) as cc:
        if verifiers_s is not None:
            cc.verifiers(verifiers_s)
        yield cc


def gossiped_stats(cluster, client, node_id: str, role: str):
    """A function returning `role`'s figures in the latest stats gossip of `node_id` ({}
    until one is heard), heard by `client`'s node on `cluster`'s stats topic."""
    from nodes.telemetry import stats_topic
    from tools.monitor_view import ClusterView

    view = ClusterView()
    client.node.register_gossip("stats", lambda topic, msg: view.on_stats(msg.sender,
                                                                         msg["stats"]))
    client.node.gossip.subscribe(stats_topic(cluster.cluster))

    def latest() -> dict:
        ns = view.stats(node_id)
        return {} if ns is None else ns.latest.get(role, {})

    return latest


@pytest.fixture(scope="module")
def cluster(model_cluster):
    """The session's shared model cluster (tests/conftest.py); a module may add (and kill) its
    own nodes on it, or define its own `cluster`."""
    return model_cluster


@pytest.fixture(scope="module")
def client(cluster):
    """A cluster client of `cluster`, once a verifier is known (30 s at most)."""
    with client_of(cluster, verifiers_s=30) as cc:
        yield cc
