"""mDNS work caught by shutdown never holds the process exit.

CI once saw a proposer take more than 10 s to exit after SIGTERM: a zeroconf lookup in flight
when `Zeroconf.close()` stopped its loop waits its timeout plus zeroconf's 10 s margin, and the
lookups ran on ThreadPoolExecutor workers, which the interpreter joins at exit. Real zeroconf on
loopback here; the lookups are for a service nobody announces, so they are in flight at close.
"""

from __future__ import annotations

import threading
import uuid

from zeroconf import ServiceStateChange

from discovery.cards import Card
from discovery.daemon_workers import DaemonWorkers
from discovery.interfaces import resolve_interface
from discovery.mdns import SERVICE_TYPE, Mdns


def _non_daemon_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.daemon and t.is_alive()}


def _card() -> Card:
    node_id = uuid.uuid4().hex[:12]
    return Card(node_id=node_id, cluster=f"t-{node_id[:6]}", incarnation=1, version=1,
                roles=("proposer",),
                endpoints={"gossip": "tcp://127.0.0.1:5001", "stream": "tcp://127.0.0.1:5002"})


def test_a_lookup_in_flight_at_close_leaves_no_thread_the_exit_would_wait_for():
    before = _non_daemon_threads()
    mdns = Mdns(resolve_interface("127.0.0.1"), on_peer=lambda ad: None)
    assert mdns.start(_card())
    # A peer "appears": its lookup (3 attempts of 1.5 s, nobody answers) is still running
    # when we close.
    mdns._on_change(mdns._zc, SERVICE_TYPE, f"ghost{uuid.uuid4().hex[:8]}.{SERVICE_TYPE}",
                    ServiceStateChange.Added)
    started = threading.Event()
    assert mdns._pool.submit(started.set)
    assert started.wait(30)
    mdns.close()
    assert _non_daemon_threads() <= before


def test_daemon_workers_run_calls_survive_failures_and_drop_work_at_close():
    workers = DaemonWorkers(1, "t-workers")
    assert all(t.daemon for t in workers.threads)
    ran: list[int] = []
    release, blocked = threading.Event(), threading.Event()

    def fail() -> None:
        raise RuntimeError("a failing call")

    def block() -> None:
        blocked.set()
        release.wait(30)

    assert workers.submit(fail)
    assert workers.submit(ran.append, 1)
    assert workers.submit(block)
    assert blocked.wait(30)
    assert ran == [1]  # the failure before it did not end the worker
    assert workers.submit(ran.append, 2)  # queued behind the blocked call
    workers.close()  # returns at once although a call is blocked
    assert not workers.submit(ran.append, 3)
    release.set()
    for t in workers.threads:
        t.join(30)
        assert not t.is_alive()
    assert ran == [1]  # queued and late calls were dropped, not run
