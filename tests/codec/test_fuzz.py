"""Decoding arbitrary input raises only CodecError (property-based, hypothesis)."""

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec import errors
from codec import messages as m
from codec.messages import SCHEMAS
from codec.schema import PROTOCOL_VERSION

FUZZ = settings(max_examples=400, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)


def decodes_or_codec_error(frames):
    try:
        msg = m.decode(frames)
    except errors.CodecError as exc:
        assert exc.code in errors.ERROR_CODES
        return None
    assert msg.type in SCHEMAS
    return msg


@FUZZ
@given(st.lists(st.binary(max_size=256), min_size=0, max_size=5))
def test_random_bytes(frames):
    decodes_or_codec_error(frames)


@FUZZ
@given(msgpack_values, st.lists(st.binary(max_size=64), max_size=3))
def test_random_msgpack_headers(header, tail):
    decodes_or_codec_error([msgpack.packb(header, use_bin_type=True), *tail])


header_dicts = st.fixed_dictionaries(
    {"v": st.just(PROTOCOL_VERSION) | msgpack_values,
     "t": st.sampled_from(sorted(SCHEMAS)) | st.text(max_size=8)},
    optional={
        "from": msgpack_values, "seq": msgpack_values, "sid": msgpack_values,
        "rid": msgpack_values, "more": msgpack_values,
        "tensors": st.lists(
            st.fixed_dictionaries({}, optional={
                "dtype": st.sampled_from(["int32", "float32", "bfloat16", "complex", ""])
                | msgpack_values,
                "shape": st.lists(st.integers(-3, 2**40), max_size=10) | msgpack_values,
                "data": st.binary(max_size=40) | msgpack_values,
            }), max_size=4) | msgpack_values,
        "committed": msgpack_values, "k": msgpack_values, "cluster": msgpack_values,
        "incarnation": msgpack_values, "code": msgpack_values, "message": msgpack_values,
    },
)


@FUZZ
@given(header_dicts, st.lists(st.binary(max_size=128), max_size=4))
def test_structured_headers_with_random_values(header, tail):
    decodes_or_codec_error([msgpack.packb(header, use_bin_type=True), *tail])


def _valid_frames():
    """Tokens inline in the header, probabilities in a frame (over the inline threshold)."""
    probs = np.full((2, 200), 0.2, dtype=np.float32)
    frames = m.encode(m.make("blob", sender="n",
                             tensors=[np.array([3, 4], dtype=np.int32), probs]))
    assert len(frames) == 2
    return frames


@FUZZ
@given(st.data())
def test_mutated_valid_messages(data):
    frames = [bytes(f) if isinstance(f, bytes) else f.tobytes() for f in _valid_frames()]
    action = data.draw(st.sampled_from(["flip", "truncate", "drop", "dup", "extend"]))
    i = data.draw(st.integers(0, len(frames) - 1))
    if action == "flip" and frames[i]:
        pos = data.draw(st.integers(0, len(frames[i]) - 1))
        b = bytearray(frames[i])
        b[pos] ^= data.draw(st.integers(1, 255))
        frames[i] = bytes(b)
    elif action == "truncate":
        frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i])))]
    elif action == "drop":
        del frames[i]
    elif action == "dup":
        frames.insert(i, frames[i])
    else:
        frames[i] += data.draw(st.binary(min_size=1, max_size=16))
    decodes_or_codec_error(frames)


@pytest.mark.parametrize(
    "header, tail, code",
    [
        ({"v": 99, "t": "ping"}, [], "bad_version"),
        ({"t": "ping"}, [], "bad_version"),
        ({"v": 2, "t": "nope"}, [], "unknown_type"),
        ({"v": 2, "t": "heartbeat", "cluster": "c", "incarnation": 1}, [], "missing_field"),
        ({"v": 2, "t": "heartbeat", "cluster": 5, "incarnation": 1, "version": 1}, [],
         "bad_field"),
        ({"v": 2, "t": "session_extend", "committed": 1,
          "tensors": [{"dtype": "int32", "shape": [2]}]}, [], "frame_count"),
        ({"v": 2, "t": "session_extend", "committed": 1,
          "tensors": [{"dtype": "int32", "shape": [2]}]}, [b"\0" * 7], "byte_count"),
        ({"v": 2, "t": "session_extend", "committed": 1,
          "tensors": [{"dtype": "int32", "shape": [-2]}]}, [b""], "bad_shape"),
        ({"v": 2, "t": "session_extend", "committed": 1,
          "tensors": [{"dtype": "int32", "shape": [2**40]}]}, [b""], "oversize"),
        ({"v": 2, "t": "session_extend", "committed": 1,
          "tensors": [{"dtype": "complex64", "shape": [1]}]}, [b"\0" * 8], "bad_dtype"),
        ({"v": 2, "t": "session_extend", "committed": 1,
          "tensors": [{"dtype": "float32", "shape": [1]}]}, [b"\0" * 4], "bad_dtype"),
        ({"v": 2, "t": "session_extend", "committed": 1,
          "tensors": [{"dtype": "int32", "shape": [1, 1]}]}, [b"\0" * 4], "bad_shape"),
    ],
)
def test_specific_errors(header, tail, code):
    with pytest.raises(errors.CodecError) as info:
        m.decode([msgpack.packb(header), *tail])
    assert info.value.code == code


@pytest.mark.parametrize(
    "spec, tail, code",
    [
        ({"dtype": "int32", "shape": [2], "data": b"\0" * 7}, [], "byte_count"),
        ({"dtype": "int32", "shape": [2], "data": b"\0" * 9}, [], "byte_count"),
        ({"dtype": "int32", "shape": [2], "data": "text, not bin"}, [], "bad_shape"),
        ({"dtype": "int32", "shape": [2], "data": None}, [], "bad_shape"),
        ({"dtype": "complex64", "shape": [1], "data": b"\0" * 8}, [], "bad_dtype"),
        ({"dtype": "int32", "shape": [2**40], "data": b""}, [], "oversize"),
        ({"dtype": "int32", "shape": [-1], "data": b""}, [], "bad_shape"),
        # an inline tensor takes no frame: a frame after it is one too many
        ({"dtype": "int32", "shape": [1], "data": b"\0" * 4}, [b"\0" * 4], "frame_count"),
    ],
)
def test_inline_tensors_are_validated_like_frames(spec, tail, code):
    header = {"v": 2, "t": "session_extend", "committed": 1, "tensors": [spec]}
    with pytest.raises(errors.CodecError) as info:
        m.decode([msgpack.packb(header, use_bin_type=True), *tail])
    assert info.value.code == code


def test_inline_tensors_count_towards_the_limits():
    spec = {"dtype": "uint8", "shape": [600], "data": b"\1" * 600}
    header = msgpack.packb({"v": 2, "t": "blob", "tensors": [spec, spec]}, use_bin_type=True)
    tight = m.Limits(max_tensor_bytes=500)
    with pytest.raises(errors.Oversize):
        m.decode([header], tight)
    with pytest.raises(errors.Oversize):
        m.decode([header], m.Limits(max_message_bytes=1000))
    with pytest.raises(errors.Oversize):  # inline bytes are header bytes: the header cap binds
        m.decode([header], m.Limits(max_header_bytes=1000))
    assert m.decode([header]).tensors[1].tolist() == [1] * 600


def test_not_msgpack_and_oversized_header():
    with pytest.raises(errors.BadHeader):
        m.decode([b"\xc1garbage"])
    with pytest.raises(errors.Oversize):
        m.decode([b"\x00" * (m.DEFAULT_LIMITS.max_header_bytes + 1)])
    with pytest.raises(errors.FrameCount):
        m.decode([])


def test_encode_rejects_bad_messages():
    with pytest.raises(errors.UnknownType):
        m.encode(m.make("nope"))
    with pytest.raises(errors.MissingField):
        m.encode(m.make("leave", cluster="c"))
    with pytest.raises(errors.BadField):
        m.encode(m.make("ping", **{"from": "x"}))
    with pytest.raises(errors.BadDtype):
        m.encode(m.make("session_extend", committed=1, tensors=[np.zeros(2, np.complex64)]))
