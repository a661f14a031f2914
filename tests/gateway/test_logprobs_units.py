"""Log probabilities in the OpenAI shapes: what the body may ask, and how they are rendered."""

from __future__ import annotations

import math

import pytest

from nodes import models
from nodes.backends.tokenizer import Tokenizer
from nodes.gateway.openai_logprobs import ReceivedLogprobs, chat_logprobs, completion_logprobs
from nodes.gateway.openai_schema import ApiError, parse_request

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(models.resolve(models.DEFAULT_MODEL).path)


@pytest.mark.parametrize("kind, body, want", [
    ("chat", {}, None),
    ("chat", {"logprobs": False, "top_logprobs": 0}, None),
    ("chat", {"logprobs": True}, 0),
    ("chat", {"logprobs": True, "top_logprobs": 20}, 20),
    ("completion", {}, None),
    ("completion", {"logprobs": None}, None),
    ("completion", {"logprobs": 0}, 0),
    ("completion", {"logprobs": 5}, 5),
])
def test_what_a_body_asks(kind, body, want):
    body = {"model": "m", **({"messages": HI} if kind == "chat" else {"prompt": "hi"}), **body}
    assert parse_request(kind, body).logprobs == want


@pytest.mark.parametrize("kind, body, param", [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completion", {"logprobs": 6}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"top_logprobs": 2}, "top_logprobs"),  # a chat field
])
def test_what_a_body_may_not_ask(kind, body, param):
    body = {"model": "m", **({"messages": HI} if kind == "chat" else {"prompt": "hi"}), **body}
    with pytest.raises(ApiError) as exc:
        parse_request(kind, body)
    assert exc.value.status == 400 and exc.value.param == param


def test_rendering_keeps_the_bytes_of_a_split_character(tok):
    ids = tok.hf.encode(" 日本", add_special_tokens=False)
    lp = ReceivedLogprobs()
    n = len(ids)
    lp.add(ids, [-0.5] * n, [t for t in ids for _ in range(2)], [-0.5, -2.0] * n, 2)
    chat = chat_logprobs(tok, lp, 2)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == " 日本"
    assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 2 for e in chat)
    comp = completion_logprobs(tok, lp, 1, offset=10)
    assert comp["token_logprobs"] == [-0.5] * n and comp["text_offset"][0] == 10
    assert all(len(row) == 1 for row in comp["top_logprobs"])
    assert completion_logprobs(tok, lp, 0)["top_logprobs"] is None
    assert math.isfinite(sum(comp["token_logprobs"]))
