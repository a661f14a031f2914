"""The gateway end to end: the official openai client and raw HTTP against a real cluster.

Two SmolLM2 verifiers and a gateway node (conftest). Greedy output must equal Hugging Face greedy
decoding of the same prompt; a verifier killed mid-stream must not change a single character.
Tests that kill verifiers run last (module order): the cluster is shared.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nodes.cluster_client import ClusterClient, GenerateRequest
from tests.polling import wait_until

from .conftest import MODEL, metrics, sse_events

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
LONG = ("Here is the list of the fifty states of the United States in alphabetical order: "
        "Alabama, Alaska,")
CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours."}]


# -- OpenAI semantics through the official client -------------------------------------------------
def test_completion_equals_hf_greedy_and_specbus_generate(oai, reference, cluster):
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    expected = reference.completion(PROMPT, 24)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.created > 0
    n_prompt = len(reference.tokenizer.encode(PROMPT, chat=False))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    # the verifier's prefix cache (what it did not prefill), in OpenAI's field
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < n_prompt
    assert set(r.model_extra["specbus"]) >= {"acceptance", "proposers", "verifier"}
    # and `specbus generate` (the cluster client) says the same
    v = cluster.nodes[0]
    with ClusterClient(cluster.cluster, peers=(v.stream,), mdns=False) as cc:
        direct = cc.generate(GenerateRequest(PROMPT, max_tokens=24, chat=False))
        gateways = cc.wait_for(lambda ms: sum("gateway" in m.card.roles for m in ms) == 2, 10)
    assert direct.text == expected
    # the gateways are members like any node: their cards say so and carry their URL
    urls = {m.card.extras.get("http") for m in gateways if "gateway" in m.card.roles}
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)


def test_completion_stream_with_usage(oai, reference):
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.completion(PROMPT, 24)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("length", "stop") and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_chat_non_stream_and_stream(oai, reference):
    expected = reference.chat(CHAT, 32)
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    chunks = list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_a_conversations_next_turn_goes_back_to_its_verifier_and_skips_its_prefill(oai,
                                                                                  reference):
    """The gateway sends a turn to the verifier that served the conversation so far (the
    cluster client's prefix affinity), whose prefix cache holds it: `cached_tokens` covers the
    whole first turn, and the answer is still HF greedy's."""
    turn1 = [{"role": "user", "content": "List four kinds of trees that grow in cold places."}]
    first = oai.chat.completions.create(model=MODEL, messages=turn1, max_tokens=24,
                                        temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Which of them keeps its leaves in winter?"}]
    second = oai.chat.completions.create(model=MODEL, messages=turn2, max_tokens=24,
                                         temperature=0)
    assert second.choices[0].message.content == reference.chat(turn2, 24)
    assert second.model_extra["specbus"]["verifier"] == first.model_extra["specbus"]["verifier"]
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def _hf_logprobs(reference, prompt_ids: list[int], max_new: int):
    """HF greedy ids and the log-softmax of one forward over prompt + output."""
    import torch

    model = reference.backend.model
    eos = next(iter(reference.tokenizer.eos_token_ids))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=eos, top_k=None, top_p=None,
                             temperature=None,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        ids = out[0, len(prompt_ids):].tolist()
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    return ids, logp


def test_logprobs_are_the_verifiers_own(oai, reference):
    tok = reference.tokenizer
    prompt = [int(i) for i in tok.hf.apply_chat_template(CHAT, add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)]
    ids, logp = _hf_logprobs(reference, prompt, 16)
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                    logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(ids) == r.usage.completion_tokens
    eos = reference.tokenizer.eos_token_ids
    ids = [t for t in ids if t not in eos]  # an end token ends the text, is not part of it
    assert len(content) == len(ids)
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    for i, e in enumerate(content):
        assert abs(e.logprob - float(logp[i, ids[i]])) < 1e-3
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob  # greedy
    plain = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                        temperature=0)
    assert plain.choices[0].logprobs is None  # not asked: none

    ids, logp = _hf_logprobs(reference, tok.encode(PROMPT, chat=False), 12)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=0, logprobs=1, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    values = [v for lp in got for v in lp.token_logprobs]
    assert len(values) == len(ids)
    assert all(abs(v - float(logp[i, ids[i]])) < 1e-3 for i, v in enumerate(values))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "".join(t for lp in got for t in lp.tokens) == text
    assert [o for lp in got for o in lp.text_offset][0] == 0


def test_stop_string_cuts_the_text(oai, reference):
    full = reference.completion(PROMPT, 24)
    word = full.split()[1]  # a word that greedy decoding produces
    cut = full[: full.index(word)]
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                               stop=[word, "never-there"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=word, stream=True))
    assert streamed == cut


def test_seed_makes_sampling_repeatable(oai):
    def once():
        return oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                      temperature=0.9, seed=1234).choices[0].text
    assert once() == once()


def test_gateway_without_tokenizer_sends_text(text_gateway, reference):
    status, _, body = text_gateway.json("POST", "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == reference.completion(PROMPT, 24)
    assert body["usage"]["prompt_tokens"] == len(reference.tokenizer.encode(PROMPT, chat=False))


def test_gateway_without_tokenizer_sends_chat_messages(text_gateway, reference):
    """The verifier renders `generate_req.messages` through its own chat template."""
    status, _, body = text_gateway.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 32, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == reference.chat(CHAT, 32)


def test_16_concurrent_streams_all_complete_and_agree(text_gateway, reference):
    """Through the gateway with the default limit (8 per verifier): 16 streams, 2 verifiers."""
    expected = reference.completion(PROMPT, 6)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "stream": True}

    def one(_):
        conn, resp = text_gateway.open_stream("/v1/completions", body)
        try:
            assert resp.status == 200, resp.read()
            events = list(sse_events(resp))
        finally:
            conn.close()
        assert events[-1] == "[DONE]"
        objs = [json.loads(e) for e in events[:-1]]
        assert not [o for o in objs if "error" in o], objs
        return "".join(o["choices"][0]["text"] for o in objs), objs[-1]["specbus"]["verifier"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [text for text, _ in results] == [expected] * 16
    assert len({v for _, v in results}) == 2  # both verifiers served


def test_models_and_health(raw, cluster):
    status, _, body = raw.json("GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    verifiers = {n.node_id for n in cluster.nodes if n.name in ("v1", "v2")}
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert set(body["data"][0]["specbus"]["verifiers"]) == verifiers
    status, _, body = raw.json("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["verifiers"] == 2


# -- raw HTTP: framing and errors ---------------------------------------------------------------
def test_sse_framing_raw(raw, reference):
    conn, resp = raw.open_stream("/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    events = list(sse_events(resp))
    conn.close()
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 8
    assert all(o["usage"] is None for o in objs[:-1])
    text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs[:-1])
    assert text == reference.chat(CHAT, 8)


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": 5}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": PROMPT, "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"model": MODEL, "prompt": PROMPT, "n": 9}, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": PROMPT, "logit_bias": {"one": 5}}, 400, "logit_bias",
     "invalid_value"),
    ({"model": MODEL, "prompt": PROMPT, "logit_bias": {"1": 500}}, 400, "logit_bias",
     "invalid_value"),
    ({"model": MODEL, "prompt": PROMPT, "presence_penalty": 3}, 400, "presence_penalty",
     "invalid_value"),
    ({"model": MODEL, "prompt": PROMPT, "frobnicate": 1}, 400, "frobnicate",
     "unsupported_parameter"),
    ({"prompt": PROMPT}, 400, "model", "missing_required_parameter"),
    ({"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ({"model": "gpt-4", "prompt": PROMPT}, 404, "model", "model_not_found"),
])
def test_completions_4xx_bodies(raw, body, status, param, code):
    got, _, raw_body = raw.request("POST", "/v1/completions", body)
    err = json.loads(raw_body)["error"]
    assert got == status
    assert (err["param"], err["code"]) == (param, code)
    assert err["message"] and err["type"] == "invalid_request_error"
    if status == 404:
        assert MODEL in err["message"]  # lists the models served


def test_chat_4xx_bodies(raw):
    for body, param in [
        ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": "hello"}, "messages"),
        ({"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}},
         "stream_options"),
    ]:
        status, _, err = raw.json("POST", "/v1/chat/completions", body)
        assert status == 400 and err["error"]["param"] == param, (body, err)


def test_body_over_1mb_is_413(raw):
    big = json.dumps({"model": MODEL, "prompt": "x" * (1024 * 1024 + 10)}).encode()
    status, _, body = raw.request("POST", "/v1/completions", big)
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"


def test_unknown_path_is_a_json_404(raw):
    status, _, body = raw.request("GET", "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_models_retrieve(oai):
    m = oai.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    import openai

    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_cors_only_for_the_origins_named(text_gateway, raw):
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type, authorization"}
    status, headers, _ = text_gateway.request("OPTIONS", "/v1/chat/completions", None, pre)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://ui.example"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    status, headers, _ = text_gateway.request("GET", "/v1/models", None,
                                              {"Origin": "http://ui.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://ui.example"
    # another origin, or a gateway without --cors-origin: refused, naming the flag (issue 47)
    status, headers, _ = text_gateway.request("OPTIONS", "/v1/chat/completions", None,
                                              {**pre, "Origin": "http://evil.example"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    status, headers, body = raw.request("OPTIONS", "/v1/chat/completions", None, pre)
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert "--cors-origin" in json.loads(body)["error"]["message"]


# -- hostile requests (issue 21) ------------------------------------------------------------------
def test_requests_the_wire_refuses_never_lock_the_gateway(raw):
    """8 chat requests whose stop holds a lone surrogate once took every balancer slot (the
    gateway answered 429 until restarted; it allows one request per verifier here)."""
    bad = (b'{"model": "%s", "max_tokens": 4, "stop": ["\\ud800"], '
           b'"messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode())
    for _ in range(8):
        status, _, body = raw.request("POST", "/v1/chat/completions", bad)
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_unicode"
    status, _, body = raw.json("POST", "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    assert raw.json("GET", "/health")[2]["inflight"] == 0


@pytest.mark.parametrize("raw_body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "%s", "prompt": "x", "temperature": %s}' % (MODEL.encode(), b"9" * 400),
    b'{"model": "%s", "prompt": "\xff\xfe"}' % MODEL.encode(),
])
def test_absurd_bodies_are_400_not_500(raw, raw_body):
    status, headers, body = raw.request("POST", "/v1/completions", raw_body)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_prompt_over_the_context_is_400_too_long(raw):
    """An SDK retries 5xx: a request that can never fit must be a 4xx."""
    status, _, body = raw.json("POST", "/v1/completions", {
        "model": MODEL, "prompt": "word " * 6000, "max_tokens": 4096, "temperature": 0})
    assert status == 400 and body["error"]["code"] == "too_long", body


def test_oversized_headers_get_the_openai_error_object(raw):
    status, headers, body = raw.request("POST", "/v1/completions", {"model": MODEL},
                                        headers={"X-Big": "a" * 20_000})
    assert 400 <= status < 500
    assert headers["Content-Type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == "bad_http"


def test_metrics_label_requests_by_route_not_by_path(raw):
    for i in range(5):
        raw.request("GET", f"/made/up/{i}")
    lines = [k for k in metrics(raw) if k.startswith("specbus_gateway_requests_total")]
    assert not any("/made/up" in k for k in lines)
    assert any('endpoint="other"' in k for k in lines)


def test_a_connection_that_never_sends_its_request_is_closed(raw):
    import socket

    s = socket.create_connection((raw.host, raw.port), timeout=60)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        s.settimeout(60)
        assert s.recv(1024) == b""  # closed by the gateway (header deadline), not by us
    finally:
        s.close()


# -- load: all verifiers busy -------------------------------------------------------------------
def _first_chunk(resp) -> dict:
    return json.loads(next(sse_events(resp)))


def test_all_verifiers_full_is_429_with_retry_after(raw):
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 300, "temperature": 0,
            "stream": True}
    streams = [raw.open_stream("/v1/completions", body) for _ in range(2)]
    try:
        served = {_first_chunk(resp)["specbus"]["verifier"] for _, resp in streams}
        assert len(served) == 2  # one per verifier: the balancer spreads the load
        status, headers, err = raw.request("POST", "/v1/completions", {**body, "stream": False})
        assert status == 429 and headers.get("Retry-After") == "1"
        assert json.loads(err)["error"]["code"] == "rate_limit_exceeded"
    finally:
        for conn, _ in streams:
            conn.close()


# -- cancellation ---------------------------------------------------------------------------------
def _wait_metric(raw, key, pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(raw)
        if pred(m.get(key)):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{key} = {m.get(key)} after {timeout}s")
        time.sleep(0.2)


def _vkey(name: str, m: dict, verifier: str) -> str:
    return next(k for k in m if k.startswith(f"specbus_verifier_{name}{{")
                and f'verifier="{verifier}"' in k)


def _settle(raw, timeout=30.0):
    """Wait until no generation is in flight anywhere (earlier tests' cancellations done)."""
    deadline = time.monotonic() + timeout
    while True:
        _, _, health = raw.json("GET", "/health")
        m = metrics(raw)
        busy = [k for k, v in m.items() if k.startswith("specbus_verifier_active{") and v]
        if health["inflight"] == 0 and not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout}s: {health}, {busy}")
        time.sleep(0.2)


def test_disconnect_cancels_the_generation_on_the_verifier(raw):
    _settle(raw)
    conn, resp = raw.open_stream("/v1/completions", {
        "model": MODEL, "prompt": LONG, "max_tokens": 1000, "temperature": 0, "stream": True})
    verifier = _first_chunk(resp)["specbus"]["verifier"]
    m = metrics(raw)
    active = _vkey("active", m, verifier)
    completed_before = m[_vkey("completed", m, verifier)]
    cancelled_before = m["specbus_gateway_cancelled_total"]
    _wait_metric(raw, active, lambda v: v == 1)  # its telemetry shows the generation running
    conn.close()  # the client goes away mid-stream
    m = _wait_metric(raw, active, lambda v: v == 0)
    assert m["specbus_gateway_cancelled_total"] == cancelled_before + 1
    # dropped, not finished: the verifier did not complete a generation meanwhile
    assert m[_vkey("completed", m, verifier)] == completed_before
    assert m[_vkey("gateway_inflight", m, verifier)] == 0


# -- failover (kills verifiers: keep last) --------------------------------------------------------
def test_failover_sigkill_mid_stream_keeps_the_text_exact(raw, reference, cluster):
    max_new = 80
    expected = reference.completion(LONG, max_new)
    killed = []

    def kill(victim):  # a few tokens in, the serving verifier
        node = next(n for n in cluster.nodes if n.node_id == victim)
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        killed.append(victim)

    text, final = _stream_with(raw, {"model": MODEL, "prompt": LONG, "max_tokens": max_new,
                                     "temperature": 0, "stream": True}, kill)
    victim = killed[0]
    assert text == expected
    assert final["specbus"]["failovers"] == 1
    assert final["specbus"]["verifiers"][0] == victim
    assert final["specbus"]["verifier"] != victim


def _stream_with(raw, body, during):
    """Stream `body`; after a few chunks call `during(serving node id)`; return (text, final)."""
    conn, resp = raw.open_stream("/v1/completions", body)
    events = sse_events(resp)
    first = json.loads(next(events))
    text = first["choices"][0]["text"]
    for _ in range(3):
        text += json.loads(next(events))["choices"][0]["text"]
    during(first["specbus"]["verifier"])
    final = None
    for e in events:
        if e == "[DONE]":
            break
        obj = json.loads(e)
        assert "error" not in obj, obj
        text += obj["choices"][0]["text"]
        if obj["choices"][0]["finish_reason"]:
            final = obj
    conn.close()
    return text, final


def test_failover_when_the_serving_verifier_is_stopped(raw, reference, cluster):
    """SIGSTOP (a frozen machine): the membership finds it silent, another verifier resumes."""
    cluster.start_node("v3", "--role", "verifier", "--threads", "1", seed=True)
    deadline = time.monotonic() + 60
    while len(raw.json("GET", "/v1/models")[2]["data"][0]["specbus"]["verifiers"]) < 2:
        assert time.monotonic() < deadline, "the gateway did not see the new verifier"
        time.sleep(0.2)
    _settle(raw)
    max_new = 60
    expected = reference.completion(LONG, max_new)
    stopped = []

    def stop(victim):
        node = next(n for n in cluster.nodes if n.node_id == victim)
        node.proc.send_signal(signal.SIGSTOP)
        stopped.append(node)

    try:
        text, final = _stream_with(raw, {"model": MODEL, "prompt": LONG, "max_tokens": max_new,
                                         "temperature": 0, "stream": True}, stop)
    finally:
        for node in stopped:  # it stays out of the cluster for the tests that follow
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()
    assert text == expected
    assert final["specbus"]["failovers"] == 1
    assert final["specbus"]["verifiers"][0] == stopped[0].node_id


def test_a_stalled_lone_verifier_is_waited_for(raw, reference, cluster):
    """Issue 21: a 5 s SIGSTOP of the only verifier once ended the stream with `no_verifier`
    (membership said dead after ~1.6 s). Its connection is alive, so the gateway waits and
    the stream goes on where it was."""
    alive = [n for n in cluster.nodes if n.name in ("v1", "v2", "v3") and n.proc.poll() is None]
    assert len(alive) == 1
    _settle(raw)
    max_new = 40
    expected = reference.completion(LONG, max_new)

    def stall(victim):
        node = next(n for n in cluster.nodes if n.node_id == victim)
        node.proc.send_signal(signal.SIGSTOP)
        time.sleep(5)  # the scenario: longer than membership's dead_after
        node.proc.send_signal(signal.SIGCONT)

    text, final = _stream_with(raw, {"model": MODEL, "prompt": LONG, "max_tokens": max_new,
                                     "temperature": 0, "stream": True}, stall)
    assert text == expected
    assert final["specbus"]["failovers"] == 0
    assert wait_until(lambda: raw.json("GET", "/health")[0] == 200, 30)  # alive again


def test_no_verifier_left_ends_the_stream_with_an_error_event(raw, cluster):
    alive = [n for n in cluster.nodes if n.name in ("v1", "v2", "v3") and n.proc.poll() is None]
    assert len(alive) == 1
    conn, resp = raw.open_stream("/v1/completions", {
        "model": MODEL, "prompt": LONG, "max_tokens": 200, "temperature": 0, "stream": True})
    events = sse_events(resp)
    next(events)
    alive[0].proc.send_signal(signal.SIGKILL)
    alive[0].proc.wait()
    rest = list(events)
    conn.close()
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert err["code"] == "no_verifier" and "failed mid-generation" in err["message"]
    status, _, body = raw.json("GET", "/health")
    assert status == 503 and body["status"] == "no_verifier"
    status, headers, body = raw.json("POST", "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503 and body["error"]["code"] == "no_verifier"  # not a 404 for the model

