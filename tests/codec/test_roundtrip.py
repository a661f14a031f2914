"""Every message type and every dtype survives encode -> decode, tensors arrive zero-copy."""

import numpy as np
import pytest
import zmq

from codec import messages as m
from codec.messages import SCHEMAS
from codec.tensors import (
    INLINE_MAX_BYTES,
    WIRE_DTYPES,
    BFloat16Bits,
    bfloat16_bits,
    prepare,
    view_frame,
)

SAMPLE_FIELDS = {
    "card": dict(cluster="c", incarnation=3, version=7, roles=["verifier"],
                 endpoints={"gossip": "tcp://127.0.0.1:1", "stream": "tcp://127.0.0.1:2"},
                 backend="torch", model="smollm2-135m", tokenizer="abc", vocab=49152,
                 tok_s=23.5, load=0.5, free_mem=1 << 33, extras={"k": [1, 2]}),
    "heartbeat": dict(cluster="c", incarnation=1, version=2),
    "leave": dict(cluster="c", incarnation=1),
    "stats": dict(cluster="c", incarnation=1, stats={"tok_s": 3.0}),
    "snapshot_req": dict(cluster="c"),
    "snapshot": dict(cards=[{"a": 1}]),
    "ping": dict(payload="x"),
    "pong": dict(),
    "cancel": dict(),
    "session_open": dict(lease_s=5.0, tokenizer="abc", sampling={"temperature": 0.0}),
    "session_extend": dict(committed=12),
    "draft_chunk": dict(base=12, chunk=3),
    "session_close": dict(),
    "generate_req": dict(prompt="hello", max_tokens=16, temperature=0.7, seed=1, stop=["\n"]),
    "token_chunk": dict(index=0, text="hi"),
    "done": dict(finish_reason="stop", stats={"acceptance": 0.5}),
    "error": dict(code="oops", message="bad"),
    "suffix_pub": dict(cluster="c", tokenizer="fp", output_start=1),
    "suffix_snapshot_req": dict(cluster="c"),
    "suffix_snapshot": dict(tokenizer="fp"),
    "blob": dict(note="any"),
}

TOKENS = np.array([1, 2, 3], dtype=np.int32)
SAMPLE_TENSORS = {
    "session_open": [TOKENS],
    "session_extend": [TOKENS],
    "token_chunk": [TOKENS],
    "draft_chunk": [TOKENS],
    "suffix_pub": [TOKENS],
    "suffix_snapshot": [TOKENS, np.array([1, 2], np.int32), np.array([0, 1], np.int32)],
    "blob": [np.zeros((2, 2, 2), np.uint8), np.ones(3, bool),
             np.random.default_rng(0).random((3, 11), dtype=np.float32)],
}


def test_every_type_has_a_sample():
    assert set(SAMPLE_FIELDS) == set(SCHEMAS)


@pytest.mark.parametrize("type_", sorted(SCHEMAS))
def test_roundtrip_every_message_type(type_):
    msg = m.make(type_, tensors=SAMPLE_TENSORS.get(type_, []), sender="node-a", seq=9,
                 session="s1", rid=42, more=True, **SAMPLE_FIELDS[type_])
    out = m.decode(m.encode(msg))
    assert (out.type, out.sender, out.seq, out.session, out.rid, out.more) == (
        type_, "node-a", 9, "s1", 42, True)
    assert out.fields == SAMPLE_FIELDS[type_]
    assert len(out.tensors) == len(msg.tensors)
    for a, b in zip(msg.tensors, out.tensors, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def _sample(name, shape):
    rng = np.random.default_rng(1)
    if name == "bfloat16":
        return bfloat16_bits(rng.integers(0, 2**16, size=shape, dtype=np.uint16))
    if name == "bool":
        return rng.random(shape) > 0.5
    dt = WIRE_DTYPES[name]
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    return rng.integers(0, 100, size=shape).astype(dt)


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(0,), (5,), (2, 3), (2, 3, 4)])
def test_roundtrip_every_dtype(name, shape):
    """The tensor path decode uses (prepare -> bytes -> view_frame) for every wire dtype."""
    arr, spec = prepare(_sample(name, shape))
    assert spec == {"dtype": name, "shape": list(shape)}
    out = view_frame(memoryview(arr.tobytes()), spec, 1 << 20)
    assert out.shape == tuple(shape)
    assert np.array_equal(out.view(np.uint8), np.asarray(arr).view(np.uint8))
    assert isinstance(out, BFloat16Bits) == (name == "bfloat16")


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_roundtrip_probability_dtypes_through_messages(name):
    probs = _sample(name, (3, 7))
    out = m.decode(m.encode(m.make("blob", tensors=[TOKENS, probs])))
    assert out.tensors[1].dtype == np.asarray(probs).dtype
    assert np.array_equal(np.asarray(out.tensors[1]), np.asarray(probs))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_roundtrip_token_dtypes_through_messages(dtype):
    out = m.decode(m.encode(m.make("session_extend", committed=3,
                                   tensors=[np.arange(3, dtype=dtype)])))
    assert out.tensors[0].dtype == dtype and out.tensors[0].tolist() == [0, 1, 2]


def test_big_endian_and_noncontiguous_are_normalised():
    big = np.arange(6, dtype=">i4").reshape(2, 3).T  # big-endian and not C-contiguous
    arr, spec = prepare(big)
    assert arr.flags.c_contiguous and arr.dtype == np.dtype("<i4")
    assert np.array_equal(arr, big)
    msg = m.make("blob", tensors=[TOKENS, big.astype(">f4")])
    assert np.array_equal(m.decode(m.encode(msg)).tensors[1], big)


def test_received_tensor_is_a_view_over_the_zmq_frame():
    """Receive path is zero-copy: the array shares memory with the frame buffer."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://zc")
    b.connect("inproc://zc")
    probs = np.ones((4, 32768), dtype=np.float32)  # 512 KiB frame
    a.send_multipart(m.encode(m.make("blob", tensors=[TOKENS, probs[:3]])), copy=False)
    frames = b.recv_multipart(copy=False)
    assert len(frames) == 2  # the 12-byte token tensor travelled inline, in the header
    out = m.decode(frames)
    assert np.shares_memory(out.tensors[1], np.frombuffer(frames[1].buffer, dtype=np.uint8))
    assert out.tensors[0].tolist() == TOKENS.tolist()
    a.close(), b.close(), ctx.term()


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_small_tensors_travel_inline_and_arrive_as_arrays(name):
    """Under the threshold a tensor is header bytes, not a frame; it decodes to the same array."""
    small = _sample(name, (2, 3))
    big = np.zeros(INLINE_MAX_BYTES + 1, np.uint8)
    frames = m.encode(m.make("blob", tensors=[small, big, small[:0]]))
    assert len(frames) == 2 and frames[1] is not None  # header + the one big frame
    out = m.decode(frames)
    assert [t.shape for t in out.tensors] == [(2, 3), big.shape, (0, 3)]
    assert isinstance(out.tensors[0], np.ndarray) and out.tensors[0].dtype == small.dtype
    assert isinstance(out.tensors[0], BFloat16Bits) == (name == "bfloat16")
    assert np.array_equal(out.tensors[0].view(np.uint8), np.asarray(small).view(np.uint8))
    assert not out.tensors[0].flags.writeable  # same contract as frames: read-only views


def test_inline_threshold_is_the_senders_choice():
    t = np.arange(8, dtype=np.int64)
    assert len(m.encode(m.make("session_extend", committed=1, tensors=[t]))) == 1
    framed = m.encode(m.make("session_extend", committed=1, tensors=[t]), inline_max_bytes=0)
    assert len(framed) == 2
    assert m.decode(framed).tensors[0].tolist() == list(range(8))


def test_unknown_fields_are_tolerated():
    frames = m.encode(m.make("heartbeat", cluster="c", incarnation=1, version=1, future="x"))
    assert m.decode(frames).get("future") == "x"


def test_torch_and_mlx_conversions_roundtrip_bfloat16():
    torch = pytest.importorskip("torch")
    from codec.tensors import from_mlx, from_torch, to_mlx, to_torch

    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    wire = from_torch(t)
    assert isinstance(wire, BFloat16Bits)
    frames = m.encode(m.make("blob", tensors=[TOKENS, wire.reshape(1, 3)]))
    back = to_torch(m.decode(frames).tensors[1])
    assert back.dtype == torch.bfloat16 and torch.equal(back.reshape(3), t)
    mx = pytest.importorskip("mlx.core")
    arr = to_mlx(wire)
    assert arr.dtype == mx.bfloat16
    assert np.array_equal(from_mlx(arr).view(np.uint16), np.asarray(wire))


def test_inline_tensors_fall_back_to_frames_when_the_header_would_overflow():
    """A header near the cap still encodes: its small tensors then go as frames."""
    limits = m.Limits(max_header_bytes=2000)
    note = "x" * 1700  # fits alone, not with 400 inline bytes
    small = np.arange(100, dtype=np.int32)  # 400 bytes: inline by default
    frames = m.encode(m.make("blob", note=note, tensors=[small]), limits)
    assert len(frames) == 2
    assert m.decode(frames, limits).tensors[0].tolist() == small.tolist()
