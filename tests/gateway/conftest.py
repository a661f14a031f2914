"""One real cluster for the gateway tests: two SmolLM2 verifiers and a gateway node.

Processes on loopback (no mDNS: seeds only), the gateway on an ephemeral HTTP port. The gateway
takes at most one request per verifier (`--gateway-max-inflight 1`) and queues none
(`--gateway-queue 0`) so that "all verifiers busy" (429) is reachable with two streams, and a
failover always lands on the other verifier. (The gateway's queue: test_gateway_queue.py.)
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import pytest

from tools.local_cluster import LocalCluster

MODEL = "smollm2-135m"


class Http:
    """A tiny raw HTTP client (stdlib), for what the openai client hides: status, headers,
    SSE framing, a connection closed mid-stream."""

    def __init__(self, base: str) -> None:
        u = urllib.parse.urlparse(base)
        self.host, self.port = u.hostname, u.port
        self.base = base

    def conn(self, timeout: float = 120.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict | None = None):
        c = self.conn()
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        c.request(method, path, body=data,
                  headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        raw = r.read()
        c.close()
        return r.status, dict(r.getheaders()), raw

    def json(self, method: str, path: str, body=None):
        status, headers, raw = self.request(method, path, body)
        return status, headers, json.loads(raw)

    def open_stream(self, path: str, body: dict):
        """Start a streaming request; returns (connection, response) to read events from."""
        c = self.conn()
        c.request("POST", path, body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        return c, c.getresponse()


def sse_events(resp):
    """Yield each SSE `data:` payload (str) of a response, checking the framing as it goes."""
    while True:
        line = resp.readline()
        if not line:
            return
        assert line.startswith(b"data: "), line
        blank = resp.readline()
        assert blank == b"\n", (line, blank)
        yield line[len(b"data: "):].rstrip(b"\n").decode()


def metrics(client: Http) -> dict[str, float]:
    """`name{labels}` -> value from /metrics."""
    status, _, raw = client.request("GET", "/metrics")
    assert status == 200
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Its own two verifiers (not the session's shared cluster: the failover tests kill the
    verifiers they stream from), plus two gateways."""
    c = LocalCluster(log_dir=tmp_path_factory.mktemp("logs"), mdns=False)
    try:
        c.start_node("v1", "--role", "verifier", "--threads", "1")
        v2 = c.spawn("v2", "--role", "verifier", "--threads", "1")
        gateways = [
            c.spawn("gw", "--role", "gateway", "--http", "127.0.0.1:0",
                    "--gateway-max-inflight", "1", "--gateway-queue", "0"),
            c.spawn("gw-text", "--role", "gateway", "--http", "127.0.0.1:0",
                    "--gateway-no-tokenizer", "--cors-origin", "http://ui.example"),
        ]
        for node in (v2, *gateways):  # loaded in parallel, seeded by v1
            node.wait_ready()
        yield c
    finally:
        c.stop()


def _url(cluster, name: str) -> str:
    return cluster.node(name).ready["http"]


@pytest.fixture(scope="module")
def text_gateway(cluster, gateway_url) -> Http:
    """A gateway without a tokenizer: it sends prompts and chat messages as they are."""
    return Http(_url(cluster, "gw-text"))


@pytest.fixture(scope="module")
def gateway_url(cluster) -> str:
    url = _url(cluster, "gw")
    client = Http(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the gateway sees both verifiers
        status, _, body = client.json("GET", "/v1/models")
        if status == 200 and body["data"] and len(body["data"][0]["specbus"]["verifiers"]) == 2:
            return url
        time.sleep(0.2)
    raise AssertionError(f"the gateway did not see both verifiers: {body}")


@pytest.fixture(scope="module")
def raw(gateway_url) -> Http:
    return Http(gateway_url)


@pytest.fixture(scope="module")
def oai(gateway_url):
    import openai

    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0,
                         timeout=180)


@pytest.fixture(scope="module")
def reference():
    """Hugging Face greedy `generate` on the same model: the exact expected output."""
    import torch

    from nodes.backends.torch_backend import TorchBackend

    torch.set_num_threads(1)
    backend = TorchBackend.load(None)
    tok = backend.tokenizer
    eos = next(iter(tok.eos_token_ids))

    def greedy(prompt_ids: list[int], max_new: int) -> str:
        out = backend.model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                   dtype=torch.long),
            do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos,
            top_k=None, top_p=None, temperature=None)
        return tok.decode(out[0, len(prompt_ids):].tolist())

    def completion(prompt: str, max_new: int) -> str:
        return greedy(tok.encode(prompt, chat=False), max_new)

    def chat(messages: list[dict], max_new: int) -> str:
        ids = tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        return greedy([int(i) for i in ids], max_new)

    return type("Reference", (), {"completion": staticmethod(completion),
                                  "chat": staticmethod(chat), "tokenizer": tok,
                                  "backend": backend})
