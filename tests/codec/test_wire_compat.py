"""The typed declarations put the same bytes on the wire as the hand-written structs before
them (protocol 2): `wire_v2_frames.json` holds the frames those wrote for these samples."""

import json
from pathlib import Path

import numpy as np
import pytest

from codec.messages import encode
from codec.sampling import SamplingParams
from codec.structs import (
    Cancel,
    Done,
    DraftChunk,
    ErrorReply,
    GenerateReq,
    Ping,
    Pong,
    SessionClose,
    SessionExtend,
    SessionOpen,
    SuffixPub,
    SuffixSnapshot,
    SuffixSnapshotReq,
    TokenChunk,
)

GOLDEN = json.loads((Path(__file__).parent / "wire_v2_frames.json").read_text())
T = np.array([1, 2, 3], np.int32)
ENV = dict(sender="node-1", seq=3, rid=9)
SAMPLES = {
    "generate_full": lambda: GenerateReq(
        prompt="hello", max_tokens=7, sampling=SamplingParams(0.7, 0.9, 40, 5),
        stop=("\n", "END"), proposers=("a", "b"), draft="force").to_message(**ENV),
    "generate_chat": lambda: GenerateReq(messages=(
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
    )).to_message(**ENV),
    "generate_tokens": lambda: GenerateReq(
        tokens=np.array([1, 2, 3], np.int64), chat=False, speculate=False,
        sampling=SamplingParams(temperature=1, top_p=1, top_k=0, seed=0)).to_message(),
    "generate_big": lambda: GenerateReq(tokens=np.arange(400, dtype=np.int32),
                                        max_tokens=1).to_message(rid=1),
    "token_chunk": lambda: TokenChunk(0, np.array([5, 6], np.int32), "hi").to_message(
        more=True, rid=9),
    "token_chunk_empty_text": lambda: TokenChunk(4, np.array([7], np.int64)).to_message(
        rid=2, more=True),
    "done_full": lambda: Done("stop", "the text", {"acceptance": 0.5, "drafted": 3}).to_message(
        rid=9),
    "done_bare": lambda: Done("closed").to_message(),
    "error": lambda: ErrorReply("bad_request", "top_p: must be in (0, 1]").to_message(
        rid=4, sender="v"),
    "session_open_full": lambda: SessionOpen(
        "s1", T, 5, SamplingParams(0.5, 0.95, 3, 77), tokenizer="fp", drafter="ngram",
        horizon=8).to_message(**ENV),
    "session_open_bare": lambda: SessionOpen("s2", np.array([9], np.int64), 2.5).to_message(),
    "session_extend": lambda: SessionExtend("s1", np.array([4, 5], np.int32), 10,
                                            horizon=4).to_message(**ENV),
    "session_extend_empty": lambda: SessionExtend("s1", np.zeros(0, np.int32), 10).to_message(),
    "draft_chain": lambda: DraftChunk("s1", 7, np.array([5, 6], np.int32)).to_message(
        more=True, rid=5),
    "draft_tree": lambda: DraftChunk(
        "s1", 7, np.array([5, 6, 7], np.int32), 2, alt_tokens=np.array([9, 10, 11], np.int32),
        alt_parents=np.array([-1, 1, 4], np.int32)).to_message(more=True),
    "draft_tree_conf": lambda: DraftChunk(
        "s1", 7, np.array([5, 6, 7], np.int32), 2, alt_tokens=np.array([9, 10, 11], np.int32),
        alt_parents=np.array([-1, 1, 4], np.int64), conf=np.array([0.5, 0.6, 0.7], np.float32),
        alt_conf=np.array([0.2, 0.3, 1.0], np.float64)).to_message(more=True),
    "draft_chain_conf": lambda: DraftChunk(
        "s1", 0, np.array([5], np.int32), 1, conf=np.array([0.25], np.float32),
        alt_conf=np.zeros(0, np.float32)).to_message(),
    "draft_big": lambda: DraftChunk("s9", 3, np.arange(256, dtype=np.int64) + 1, 1).to_message(),
    "session_close": lambda: SessionClose("s1").to_message(rid=3),
    "suffix_pub": lambda: SuffixPub("c", "fp", np.array([5, 6, 7], np.int32), 1).to_message(
        sender="v1"),
    "suffix_snapshot": lambda: SuffixSnapshot.of("fp", (
        (np.array([1, 2, 3], np.int32), 0), (np.array([4], np.int64), 0))).to_message(rid=2),
    "suffix_snapshot_empty": lambda: SuffixSnapshot.of("fp", ()).to_message(),
    "ping": lambda: Ping().to_message(),
    "ping_env": lambda: Ping().to_message(sender="bench", rid=1),
    "pong": lambda: Pong(payload="").to_message(sender="s", rid=7),
    "cancel": lambda: Cancel().to_message(sender="c", rid=11),
    "suffix_snapshot_req": lambda: SuffixSnapshotReq("c").to_message(),
}


def test_every_golden_sample_is_built():
    assert set(SAMPLES) == set(GOLDEN)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_same_bytes_as_protocol_2(name):
    frames = encode(SAMPLES[name]())
    got = [bytes(memoryview(f).cast("B")).hex() if not isinstance(f, bytes) else f.hex()
           for f in frames]
    assert got == GOLDEN[name]
