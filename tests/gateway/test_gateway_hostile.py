"""The gateway's HTTP server against hostile clients, in this process: a real `GatewayRole`
(its aiohttp server on its own thread, real loopback sockets) over a node with no members, so
no model is loaded. Generation requests get their `503 no_verifier` once their body is read,
which is all a "normal request being served" needs here.

Covers issue 47's leftovers: slow bodies (a deadline for the whole body, and the connection cap
giving the place of the longest-unserved connection to a new one), the `Host` check (DNS
rebinding) and the browser origins allowed by default on a loopback gateway.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse

import pytest

from nodes.gateway.role import GatewayRole


class _Membership:
    def members(self, include_self: bool = False):
        return []

    def get(self, node_id):
        return None


class _Node:
    """What the gateway's routes read of a node: nobody is a member."""

    node_id = "gw-test"
    membership = _Membership()


def start(**kwargs) -> GatewayRole:
    role = GatewayRole("127.0.0.1", 0, **kwargs)
    role._node = _Node()
    role._thread.start()
    assert role._ready.wait(30) and role._error is None, role._error
    return role


def request(url: str, method: str, path: str, body: dict | None = None,
            headers: dict | None = None, timeout: float = 60.0):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body).encode(),
                  headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.slow
def test_500_slow_bodies_do_not_lock_out_normal_requests():
    """500 connections send their headers and then a body byte now and then, against a cap of
    128 connections: each is answered 408 or displaced, never held past its body deadline, and
    normal requests (a GET, a POST with its body) are served the whole time."""
    role = start(max_connections=128, body_timeout=3.0)
    u = urllib.parse.urlparse(role.url)
    slow: list[socket.socket] = []
    stop = threading.Event()
    try:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{u.port}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
        for _ in range(500):
            s = socket.create_connection((u.hostname, u.port), timeout=30)
            s.sendall(head + b"{")
            slow.append(s)

        def trickle():  # one more byte on every slow connection each second
            while not stop.wait(1.0):
                for s in slow:
                    try:
                        s.send(b" ")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        served = []
        for _ in range(10):  # normal requests while the slow ones trickle
            status, _, _ = request(role.url, "GET", "/health")
            served.append(status)
            status, _, raw = request(role.url, "POST", "/v1/chat/completions", CHAT)
            served.append(status)
            assert json.loads(raw)["error"]["code"] == "no_verifier"
        assert served == [503] * 20  # every one answered (no verifier: its honest status)

        # every slow connection ends, answered 408 (its body ran past the deadline) or closed
        # to make room (displaced at the cap): none is held on (a recv that waits out its
        # 60 s here is one held; a reset is the server closing while trickled bytes arrived)
        for s in slow:
            s.settimeout(60)
            try:
                while s.recv(65536):
                    pass
            except ConnectionResetError:
                pass
        ended = role.metrics.body_timeouts + role.connections.displaced
        assert role.metrics.body_timeouts > 0 and role.connections.displaced > 0
        assert 500 <= ended <= 520  # each slow one, and at most the 20 normal ones besides
        status, _, raw = request(role.url, "POST", "/v1/chat/completions", CHAT)
        assert status == 503
    finally:
        stop.set()
        for s in slow:
            s.close()
        role.close()


def test_a_body_that_never_ends_gets_408_with_the_openai_error():
    role = start(body_timeout=1.0)
    u = urllib.parse.urlparse(role.url)
    try:
        with socket.create_connection((u.hostname, u.port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
            data = b""
            while True:  # the answer, then the connection closed
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == "body_timeout"
    finally:
        role.close()


def test_a_foreign_host_is_refused_and_the_served_addresses_are_not():
    role = start()
    port = urllib.parse.urlparse(role.url).port
    try:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", "LOCALHOST.:80"):
            status, _, _ = request(role.url, "GET", "/v1/models", headers={"Host": host})
            assert status == 200, host
        for host in (f"evil.example:{port}", "attacker.localhost.example", "192.168.1.7"):
            status, _, raw = request(role.url, "POST", "/v1/chat/completions", CHAT,
                                     headers={"Host": host, "Content-Type": "text/plain"})
            err = json.loads(raw)["error"]
            assert status == 403 and err["code"] == "host_not_allowed", host
            assert "--allow-host" in err["message"]
    finally:
        role.close()
    role = start(allow_hosts=("gw.lan",))
    try:
        status, _, _ = request(role.url, "GET", "/v1/models", headers={"Host": "gw.lan:80"})
        assert status == 200
    finally:
        role.close()


def test_browser_pages_of_this_machine_are_allowed_and_others_told_the_flag():
    role = start()
    try:
        for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8080"):
            status, headers, _ = request(role.url, "OPTIONS", "/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert status == 204, origin
            assert headers["Access-Control-Allow-Origin"] == origin
            assert "POST" in headers["Access-Control-Allow-Methods"]
            status, headers, _ = request(role.url, "GET", "/v1/models",
                                         headers={"Origin": origin})
            assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
        for method, body in (("OPTIONS", None), ("POST", CHAT)):
            status, headers, raw = request(role.url, method, "/v1/chat/completions", body,
                                           headers={"Origin": "http://evil.example",
                                                    "Content-Type": "text/plain"})
            err = json.loads(raw)["error"]
            assert status == 403 and err["code"] == "origin_not_allowed", method
            assert "--cors-origin" in err["message"]
            assert "Access-Control-Allow-Origin" not in headers
    finally:
        role.close()
    role = start(cors_origins=("http://evil.example",))
    try:
        status, headers, _ = request(role.url, "OPTIONS", "/v1/chat/completions",
                                     headers={"Origin": "http://evil.example"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://evil.example"
    finally:
        role.close()


def test_a_network_gateway_allows_no_origin_by_default():
    from nodes.gateway.origins import Origins

    o = Origins("192.168.1.5")
    assert not o.origin_allowed("http://localhost:5173")
    assert o.host_allowed("192.168.1.5:8000") and not o.host_allowed("10.0.0.1:8000")
    assert not o.host_allowed("evil.example")
    wild = Origins("0.0.0.0")
    assert wild.host_allowed("10.0.0.1:8000") and wild.host_allowed("localhost:8000")
    assert not wild.host_allowed("evil.example:8000")
    assert Origins("127.0.0.1", allow_hosts=("*",)).host_allowed("evil.example")


def test_brackets_inside_strings_are_not_nesting():
    from nodes.gateway.openai_schema import MAX_JSON_DEPTH, parse_json

    text = "[" * 40 + "{" * 40 + ' \\" [[[ '
    body = parse_json(json.dumps({"messages": [{"role": "user", "content": text}]}).encode())
    assert body["messages"][0]["content"] == text
    from nodes.gateway.openai_schema import ApiError

    with pytest.raises(ApiError) as err:
        parse_json(("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)).encode())
    assert err.value.body()["error"]["code"] == "invalid_json"
    with pytest.raises(ApiError):  # a quote escaped inside a string does not end it
        parse_json(('{"a": "\\"' + "]" * 3 + '", "b": ' + "[" * 40 + "]" * 40 + "}").encode())


def test_a_body_over_the_limit_is_answered_413_while_it_is_still_being_sent():
    role = start()
    try:
        big = {"model": "m", "prompt": "x" * (1024 * 1024 + 10)}
        status, _, raw = request(role.url, "POST", "/v1/completions", big)
        assert status == 413 and json.loads(raw)["error"]["code"] == "body_too_large"
    finally:
        role.close()
