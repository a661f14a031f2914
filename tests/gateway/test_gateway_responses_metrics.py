"""`/v1/responses` through the official openai client, vLLM's metric names on `/metrics` and
llama-server's `timings` in each response (issue 47), against a real cluster: one SmolLM2
verifier drafting with its own n-gram drafter, and a gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools.local_cluster import LocalCluster

from .conftest import MODEL, Http, sse_events

pytestmark = pytest.mark.slow

# a prompt the n-gram drafter can draft from (it repeats), so drafts are verified
REPEAT = "one two three four five six seven eight. one two three four five six seven eight. one"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One verifier (`--max-batch` 8, its default: the n choices of a request step together)
    and a gateway with its default in-flight limit (the verifier's batch)."""
    c = LocalCluster(log_dir=tmp_path_factory.mktemp("logs"), mdns=False)
    try:
        c.start_node("v", "--role", "verifier", "--threads", "1", "--drafter", "ngram")
        c.start_node("gw", "--role", "gateway", "--http", "127.0.0.1:0")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def gateway(cluster):
    url = cluster.node("gw").ready["http"]
    client = Http(url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the gateway sees the verifier
        status, _, body = client.json("GET", "/v1/models")
        if status == 200 and body["data"]:
            break
        time.sleep(0.2)
    return url


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


# -- n > 1 end to end (issue 47, item 2) ---------------------------------------------------------

def test_n_greedy_gives_identical_choices_from_one_prefill(oai):
    from nodes.gateway.openai_schema import MAX_N

    # a prompt no earlier test sent (its first choice prefills it from scratch)
    prompt = "Quietly, the orange giraffe counted seven marbles: one, two, three,"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert texts[0] and texts == [texts[0]] * 3
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"specbus": {"speculate": False}})
    assert texts[0] == plain.choices[0].text
    # one prefill of the prompt: the other two choices start from all but its last position
    p = r.usage.prompt_tokens
    assert p > 8  # longer than the prefix cache's least reuse
    cached = sorted(c["cached_tokens"] for c in r.model_extra["specbus"]["choices"])
    assert cached[1:] == [p - 1, p - 1], cached
    assert 3 * p - sum(cached) <= p + 2  # positions prefilled for three choices
    import openai

    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=MAX_N + 1)


def test_n_sampled_with_a_seed_is_reproducible_and_streams_each_index(oai):
    from nodes.gateway.openai_schema import choice_seed

    msgs = [{"role": "user", "content": "Write a short line about the sea."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, seed=1234)
    a = oai.chat.completions.create(n=3, **kw)
    b = oai.chat.completions.create(n=3, **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # reproducible
    # choice i is the single request seeded choice_seed(seed, i)
    for i in range(3):
        alone = oai.chat.completions.create(**{**kw, "seed": choice_seed(1234, i)})
        assert alone.choices[0].message.content == texts[i], i
    # streamed: every chunk names its choice; each choice's deltas add up to its text
    got = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in oai.chat.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert [got[i] for i in range(3)] == texts


# -- the sampling controls through a live gateway and the CLI (issue 47, item 1) -----------------

# mild enough that the text still repeats the prompt, so the n-gram drafter drafts (a strong
# penalty steers away from the repeat and nothing is drafted: a test of nothing)
CONTROLS = [
    {"top_k": 5},
    {"min_p": 0.2},
    {"repetition_penalty": 1.05},
    {"presence_penalty": 0.1},
    {"frequency_penalty": 0.1},
]


@pytest.mark.parametrize("controls", CONTROLS, ids=lambda c: next(iter(c)))
def test_each_control_greedy_with_speculation_equals_plain(oai, controls):
    """The n-gram drafter drafts from the repeating prompt (speculation happens); the verifier
    applies the control at every position it checks, so the text equals plain decoding's."""
    standard = {k: v for k, v in controls.items()
                if k in ("presence_penalty", "frequency_penalty")}
    extra = {k: v for k, v in controls.items() if k not in standard}

    def run(speculate: bool):
        return oai.completions.create(
            model=MODEL, prompt=REPEAT, max_tokens=24, temperature=0, **standard,
            extra_body={**extra, "specbus": {"speculate": speculate}})

    spec, plain = run(True), run(False)
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.model_extra["specbus"]["drafted"] > 0
    assert plain.model_extra["specbus"]["drafted"] == 0


def test_logit_bias_greedy_with_speculation_equals_plain_and_steers(oai):
    base = oai.completions.create(model=MODEL, prompt=REPEAT, max_tokens=16, temperature=0)
    runs = [oai.completions.create(
        model=MODEL, prompt=REPEAT, max_tokens=16, temperature=0, logit_bias={"1000": 100},
        extra_body={"specbus": {"speculate": speculate}}) for speculate in (True, False)]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    assert runs[0].choices[0].text != base.choices[0].text  # token 1000, over and over
    assert runs[0].model_extra["specbus"]["drafted"] > 0  # its repeats were drafted


ROOT = Path(__file__).resolve().parents[2]


def test_each_control_through_the_cli_speculating_equals_plain(cluster):
    """`specbus generate` against the same verifier: every control at once, greedy, with the
    verifier's n-gram drafter and with `--no-speculate`: the same token ids."""
    v = cluster.node("v")
    env = {**os.environ, **cluster.env, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "nodes.cli", "generate", "--prompt", REPEAT, "--no-chat",
            "--max-tokens", "24", "--top-k", "5", "--min-p", "0.1", "--repetition-penalty",
            "1.05", "--presence-penalty", "0.1", "--frequency-penalty", "0.1", "--logit-bias",
            "1000=-5", "--json", "--cluster", cluster.cluster, "--no-mdns", "--peer",
            v.stream.removeprefix("tcp://"), "--wait", "30"]
    outs = []
    for extra in ([], ["--no-speculate"]):
        out = subprocess.run(args + extra, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr
        outs.append(json.loads(out.stdout))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["token_ids"]
    assert outs[0]["drafted"] > 0 and outs[1]["drafted"] == 0


# -- vLLM's per-position counter and the verifier's own cumulative acceptance (items 5, d/e) -----

def test_per_position_accepted_counter_is_fed_and_cumulative_acceptance_is_the_verifiers(
        gateway, oai):
    before = scrape(gateway)
    oai.completions.create(model=MODEL, prompt=REPEAT, max_tokens=32, temperature=0)
    deadline = time.monotonic() + 30
    while True:  # the verifier's telemetry (its own cumulative figures) comes every second
        after = scrape(gateway)
        key = [k for k in after if k.startswith("specbus_verifier_drafted_all_clients{")]
        if key and after[key[0]] > before.get(key[0], 0.0):
            break
        assert time.monotonic() < deadline, "no verifier telemetry with the new figures"
        time.sleep(0.5)
    m = f"model_name={MODEL}"
    pos0 = f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{{m},position=0}}"
    assert after[pos0] > before.get(pos0, 0.0)
    per_pos = {int(k.rsplit("position=", 1)[1].rstrip("}")): v for k, v in after.items()
               if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")}
    # depth i is accepted only after depth i-1: non-increasing; they add up to the accepted
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(len(per_pos) - 1) if i + 1 in per_pos)
    assert sum(per_pos.values()) == after[f"vllm:spec_decode_num_accepted_tokens_total{{{m}}}"]
    own = [v for k, v in after.items()
           if k.startswith("specbus_verifier_acceptance_cumulative_all_clients{")]
    assert len(own) == 1 and 0.0 < own[0] <= 1.0
    drafted = [v for k, v in after.items() if k.startswith("specbus_verifier_drafted_all_clients{")]
    accepted = [v for k, v in after.items()
                if k.startswith("specbus_verifier_accepted_all_clients{")]
    assert abs(own[0] - accepted[0] / drafted[0]) < 1e-3
