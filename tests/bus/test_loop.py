import threading
import time

import numpy as np
import pytest
import zmq

from bus.loop import IOLoop
from bus.sockets import bind, check_bind_host
from tests.polling import wait_until as poll


def test_call_soon_runs_on_the_io_thread(loop):
    seen = []
    done = threading.Event()
    loop.call_soon(lambda: (seen.append(threading.current_thread().name), done.set()))
    assert done.wait(10)
    assert seen == ["test-io"]


def test_run_sync_returns_results_and_raises_errors(loop):
    assert loop.run_sync(lambda: 6 * 7) == 42
    with pytest.raises(ZeroDivisionError):
        loop.run_sync(lambda: 1 / 0)


def test_timers_fire_in_order_and_cancel(loop):
    fired = []
    loop.call_later(0.05, lambda: fired.append("b"))
    loop.call_later(0.01, lambda: fired.append("a"))
    # scheduled and cancelled on the loop thread: it cannot fire in between, however slow
    # this thread is scheduled
    loop.run_sync(lambda: loop.call_later(0.02, lambda: fired.append("never")).cancel())
    ticks = []
    every = loop.call_every(0.01, lambda: ticks.append(1))
    assert wait_until(lambda: len(fired) == 2 and len(ticks) >= 5)
    assert fired == ["a", "b"]  # by deadline; the cancelled one (due before b) was skipped
    loop.run_sync(every.cancel)  # on the loop thread: no tick can be running meanwhile
    n = loop.run_sync(lambda: len(ticks))
    time.sleep(0.05)  # several intervals: a live timer would tick again
    assert loop.run_sync(lambda: len(ticks)) == n


def wait_until(pred, bound=10.0):
    return poll(pred, bound, step=0.01)


def test_a_failing_handler_does_not_kill_the_loop(loop):
    loop.call_soon(lambda: 1 / 0)
    assert loop.run_sync(lambda: "still alive") == "still alive"
    assert loop.errors == 1


def test_stop_closes_registered_sockets(factory):
    lp = IOLoop().start()
    sock = lp.run_sync(lambda: factory.router())
    lp.run_sync(lambda: lp.add_reader(sock, lambda s: None))
    lp.stop()
    assert sock.closed
    assert not lp.running
    lp.call_soon(lambda: None)  # after stop: dropped, not an error


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "::", "", "localhost-ish"])
def test_wildcard_and_malformed_bind_hosts_are_refused(host):
    with pytest.raises(ValueError):
        check_bind_host(host)


def test_bind_picks_a_free_port_on_loopback(factory):
    sock = factory.router()
    try:
        ep = bind(sock, "tcp://127.0.0.1:0")
        assert ep.startswith("tcp://127.0.0.1:") and not ep.endswith(":0")
    finally:
        sock.close()


def test_factory_applies_options_to_every_socket(factory):
    for make in (factory.pub, factory.sub, factory.router, factory.dealer):
        s = make()
        try:
            assert s.getsockopt(zmq.LINGER) == factory.options.linger_ms
            assert s.getsockopt(zmq.MAXMSGSIZE) == factory.options.max_msg_bytes
            assert s.getsockopt(zmq.SNDHWM) == factory.options.sndhwm
            assert s.getsockopt(zmq.TCP_KEEPALIVE) == 1
        finally:
            s.close()


def test_many_calls_from_another_thread_all_run_in_order(loop):
    """call_soon writes one wake byte per sleep, not per call: none may be lost."""
    seen = []
    for i in range(5000):
        loop.call_soon(lambda i=i: seen.append(i))
    assert loop.run_sync(lambda: len(seen)) == 5000
    assert seen == list(range(5000))


def test_frames_ready_reads_every_waiting_message_then_stops(factory):
    from bus.loop import frames_ready, send_frames

    a, b = factory.context.socket(zmq.PAIR), factory.context.socket(zmq.PAIR)
    try:
        a.bind("inproc://frames-ready")
        b.connect("inproc://frames-ready")
        big = np.arange(20000, dtype=np.int64)  # over zmq.COPY_THRESHOLD: zero-copy send
        for i in range(5):
            send_frames(a, [b"h%d" % i, big])
        assert b.poll(10_000)  # inproc: everything sent is there once the first is
        got = list(frames_ready(b, limit=3))
        got += list(frames_ready(b))
        assert [m[0].bytes for m in got] == [b"h%d" % i for i in range(5)]
        assert all(np.array_equal(np.frombuffer(m[1].buffer, np.int64), big) for m in got)
        assert list(frames_ready(b)) == []  # empty: returns, raises nothing
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_the_loop_stops_a_sockets_monitor_before_closing_it(loop, factory, monkeypatch):
    """A socket still monitored after its monitor's reader is gone blocks libzmq's I/O thread at
    its next event (a blocking send under the socket's monitor lock), and a closed socket can
    still report for a moment: sockets the loop closes (the watched ROUTER and PUB of a secured
    node among them) stop monitoring first."""
    watched = loop.run_sync(lambda: factory.router())
    reader = loop.run_sync(lambda: watched.get_monitor_socket(zmq.EVENT_ALL))
    loop.run_sync(lambda: loop.add_reader(watched, lambda s: None))
    steps: list[tuple[str, object]] = []
    real_monitor, real_close = zmq.Socket.monitor, zmq.Socket.close

    def monitor(sock, addr, events=zmq.EVENT_ALL):
        steps.append(("monitor", addr))
        return real_monitor(sock, addr, events)

    def close(sock, linger=None):
        steps.append(("close", linger))
        return real_close(sock, linger)

    monkeypatch.setattr(zmq.Socket, "monitor", monitor)
    monkeypatch.setattr(zmq.Socket, "close", close)
    loop.run_sync(lambda: loop.remove_reader(watched))
    assert steps == [("monitor", None), ("close", 0)]
    assert watched.closed
    # the monitor really stopped: libzmq said so to the reader, which was still there
    assert reader.poll(10_000)
    frames = reader.recv_multipart()
    assert int.from_bytes(frames[0][:2], "little") == zmq.EVENT_MONITOR_STOPPED
    monkeypatch.undo()
    reader.close(linger=0)
