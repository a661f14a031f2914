"""`/v1/responses` through the official openai client, vLLM's metric names on `/metrics` and
llama-server's `timings` in each response (issue 47), against a real cluster: one SmolLM2
verifier drafting with its own n-gram drafter, and a gateway."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools.local_cluster import LocalCluster

from .conftest import MODEL, Http, sse_events

pytestmark = pytest.mark.slow

# a prompt the n-gram drafter can draft from (it repeats), so drafts are verified
REPEAT = "one two three four five six seven eight. one two three four five six seven eight. one"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    c = LocalCluster(log_dir=tmp_path_factory.mktemp("logs"), mdns=False)
    try:
        c.start_node("v", "--role", "verifier", "--threads", "1", "--drafter", "ngram")
        gw = c.start_node("gw", "--role", "gateway", "--http", "127.0.0.1:0")
        url = gw.ready["http"]
        client = Http(url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the gateway sees the verifier
            status, _, body = client.json("GET", "/v1/models")
            if status == 200 and body["data"]:
                break
            time.sleep(0.2)
        yield url
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oai(gateway):
    import openai

    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=180)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as `name{sorted labels}` -> value, read by prometheus_client's
    own parser."""
    status, _, raw = Http(url).request("GET", "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(raw.decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_vllm_metrics_are_served_and_increase_and_responses_carry_timings(gateway, oai):
    before = scrape(gateway)
    r = oai.completions.create(model=MODEL, prompt=REPEAT, max_tokens=24, temperature=0)
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens > 0
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    assert t["draft_n"] == r.model_extra["specbus"]["drafted"] > 0
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["prompt_ms"] >= 0 and t["predicted_ms"] >= 0 and "predicted_per_token_ms" in t
    # streamed: the final chunk carries them
    c, resp = Http(gateway).open_stream("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 16,
        "temperature": 0, "stream": True})
    events = [json.loads(e) for e in sse_events(resp) if e != "[DONE]"]
    c.close()
    assert events[-1]["timings"]["predicted_n"] > 0
    after = scrape(gateway)
    m = f"model_name={MODEL}"
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:request_success_total", "vllm:generation_tokens_total",
                 "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count",
                 "vllm:time_per_output_token_seconds_count"):
        key = f"{name}{{{m}}}"
        assert after[key] > before.get(key, 0.0), name
    key = f"vllm:spec_decode_num_accepted_tokens_total{{{m}}}"
    assert after[key] >= before.get(key, 0.0)
    # the cumulative acceptance per verifier, beside the last generation's
    cumulative = [v for k, v in after.items()
                  if k.startswith("specbus_verifier_acceptance_cumulative{")]
    assert len(cumulative) == 1 and 0.0 <= cumulative[0] <= 1.0


def test_responses_plain_streamed_and_continued(oai):
    plain = oai.responses.create(model=MODEL, input="Name three colours.",
                                 instructions="You are a concise assistant.",
                                 max_output_tokens=16, temperature=0)
    assert plain.status in ("completed", "incomplete") and plain.output_text
    # the same text as the chat endpoint's for the same turns (greedy)
    chat = oai.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours."}])
    assert plain.output_text == chat.choices[0].message.content
    assert plain.usage.output_tokens == chat.usage.completion_tokens

    stream = oai.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "You are a concise assistant."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}],
        max_output_tokens=16, temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    follow = oai.responses.create(model=MODEL, input="And one more?", max_output_tokens=8,
                                  temperature=0, previous_response_id=plain.id)
    assert follow.output_text and follow.previous_response_id == plain.id
    # its prompt holds the first turn and its answer
    assert follow.usage.input_tokens > plain.usage.input_tokens + plain.usage.output_tokens - 8

    import openai

    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown")
    assert err.value.body["code"] == "previous_response_not_found"
