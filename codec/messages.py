"""Messages and their encoding to/from ZeroMQ multipart frames.

Frames of one message: `[header] [tensor]...` (routing frames are the bus's business). The
header is a msgpack map with the common keys below plus the type's own fields, flat.

    v        protocol version (int)
    t        message type (str, one of SCHEMAS below)
    from     sender node id (str)
    seq      sender's sequence number (int)
    sid      session id (str, "" when none)
    rid      request id for request streams (int, 0 when none)
    more     True when more replies to the same request follow
    tensors  list of {dtype, shape} or {dtype, shape, data}, one per tensor, in order: an
             entry with `data` (msgpack bin, the raw bytes) is inline; every other entry is
             the next tensor frame

`SCHEMAS` holds the kind-level schema of every type: those of the typed structs, derived from
their declarations (`codec.structs`), and the untyped ones (`codec.schema.UNTYPED`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from codec.envelope import Message, make
from codec.errors import (
    BadField,
    BadHeader,
    BadVersion,
    CodecError,
    FrameCount,
    Oversize,
    UnknownType,
)
from codec.schema import PROTOCOL_VERSION, UNTYPED, Schema
from codec.structs import STRUCTS
from codec.tensors import INLINE_MAX_BYTES, check_spec, inline_data, prepare, view_checked

COMMON_KEYS = frozenset(("v", "t", "from", "seq", "sid", "rid", "more", "tensors"))
# envelope key -> (exact type msgpack yields, default); exact types also keep bools out of ints
_ENVELOPE = (("from", str, ""), ("sid", str, ""), ("seq", int, 0), ("rid", int, 0),
             ("more", bool, False), ("tensors", list, None))
_MISSING = object()

SCHEMAS: dict[str, Schema] = {**UNTYPED, **{t: c.SCHEMA for t, c in STRUCTS.items()}}


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces before allocating or trusting anything."""

    max_header_bytes: int = 64 * 1024
    max_tensors: int = 8
    max_tensor_bytes: int = 256 * 1024 * 1024
    max_message_bytes: int = 512 * 1024 * 1024


DEFAULT_LIMITS = Limits()

__all__ = ["DEFAULT_LIMITS", "SCHEMAS", "Limits", "Message", "decode", "decode_header", "encode",
           "make"]


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS,
           inline_max_bytes: int = INLINE_MAX_BYTES) -> list[Any]:
    """Validate and encode a message to frames: `[header bytes, array, array, ...]`.

    Tensors of at most `inline_max_bytes` are copied into the header (no frame); larger arrays
    are returned as-is (C-contiguous, little-endian) for a zero-copy send; the caller must not
    mutate them until the send completes.
    """
    schema = SCHEMAS.get(msg.type)
    if schema is None:
        raise UnknownType(f"unknown message type {msg.type!r}")
    if not COMMON_KEYS.isdisjoint(msg.fields):
        clash = sorted(k for k in msg.fields if k in COMMON_KEYS)
        raise BadField(f"fields {clash} collide with header keys")
    schema.check_fields(msg.fields)
    arrays, specs = [], []
    for t in msg.tensors:
        arr, spec = prepare(t)
        check_spec(spec, limits.max_tensor_bytes)
        if arr.nbytes <= inline_max_bytes:
            spec["data"] = arr.tobytes()
        else:
            arrays.append(arr)
        specs.append(spec)
    if len(specs) > limits.max_tensors:
        raise FrameCount(f"{len(specs)} tensors, limit {limits.max_tensors}")
    if specs or schema.min_tensors:
        schema.check_tensors(specs)
    header = {
        "v": PROTOCOL_VERSION, "t": msg.type, "from": msg.sender, "seq": msg.seq,
        "sid": msg.session, "rid": msg.rid, "more": msg.more, "tensors": specs, **msg.fields,
    }
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadField(f"header cannot be packed: {exc}") from exc
    if len(packed) > limits.max_header_bytes:
        if inline_max_bytes > 0 and len(arrays) < len(specs):
            # the inline tensors tipped a big header over the cap: send them as frames
            return encode(msg, limits, inline_max_bytes=0)
        raise Oversize(f"header is {len(packed)} bytes, limit {limits.max_header_bytes}")
    return [packed, *arrays]


def _buffer(frame: Any) -> memoryview:
    """The bytes of a frame without copying: zmq.Frame, bytes, or any buffer."""
    buf = getattr(frame, "buffer", frame)
    try:
        return memoryview(buf)
    except TypeError as exc:
        raise BadHeader(f"frame is not a buffer: {type(frame).__name__}") from exc


def decode_header(frame: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Unpack and check the envelope of a header frame (not the type's fields)."""
    kind = type(frame)
    if hasattr(kind, "bytes") and hasattr(kind, "buffer"):
        # a zmq.Frame: a header is small (capped here), and copying it to bytes is cheaper
        # than the buffer protocol round trip; the size is checked before copying
        if len(frame) > limits.max_header_bytes:
            raise Oversize(f"header is {len(frame)} bytes, limit {limits.max_header_bytes}")
        buf = frame.bytes
    else:
        buf = _buffer(frame)
        if buf.nbytes > limits.max_header_bytes:
            raise Oversize(f"header is {buf.nbytes} bytes, limit {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise BadHeader(f"header is not msgpack: {type(exc).__name__}: {exc}"[:200]) from exc
    if not isinstance(header, dict):
        raise BadHeader(f"header must be a map, got {type(header).__name__}")
    if "v" not in header:
        raise BadVersion("header has no protocol version")
    v = header["v"]
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise BadVersion(f"protocol version {v!r}, this node speaks {PROTOCOL_VERSION}")
    t = header.get("t")
    if type(t) is not str or t not in SCHEMAS:
        raise UnknownType(f"unknown message type {t!r}")
    for key, kind, default in _ENVELOPE:
        val = header.get(key, _MISSING)
        if val is _MISSING:
            header[key] = [] if default is None else default
        elif type(val) is not kind:
            raise BadField(f"header {key!r} must be {kind.__name__}, got {type(val).__name__}")
    if len(header["tensors"]) > limits.max_tensors:
        raise FrameCount(f"{len(header['tensors'])} tensors, limit {limits.max_tensors}")
    return header


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode `[header, tensor...]` frames into a Message; raises only CodecError.

    Tensor arrays are zero-copy views over the frames' buffers.
    """
    try:
        return _decode(frames, limits)
    except CodecError:
        raise
    except (ValueError, TypeError, OverflowError, KeyError, AttributeError) as exc:
        # belt and braces: anything we failed to anticipate is still a codec error
        raise BadHeader(f"undecodable message: {type(exc).__name__}: {exc}"[:200]) from exc


def _decode(frames: Sequence[Any], limits: Limits) -> Message:
    if not frames:
        raise FrameCount("empty message")
    header = decode_header(frames[0], limits)
    specs = header["tensors"]
    schema = SCHEMAS[header["t"]]
    checked = []
    total = 0
    n_frames = 0
    for spec in specs:
        verdict = check_spec(spec, limits.max_tensor_bytes)  # a map with dtype and shape
        checked.append(verdict)
        total += verdict[2]
        if "data" not in spec:
            n_frames += 1
    if len(frames) - 1 != n_frames:
        raise FrameCount(
            f"header lists {n_frames} tensor frames, {len(frames) - 1} frames follow")
    if total > limits.max_message_bytes:
        raise Oversize(f"message is {total} bytes, limit {limits.max_message_bytes}")
    if specs or schema.min_tensors:
        schema.check_tensors(specs)
    fields = {k: v for k, v in header.items() if k not in COMMON_KEYS}
    schema.check_fields(fields)
    tensors = []
    next_frame = 1
    for spec, verdict in zip(specs, checked, strict=True):
        data = inline_data(spec)
        if data is None:
            data = _buffer(frames[next_frame])
            next_frame += 1
        tensors.append(view_checked(data, spec, verdict))
    return Message(
        type=header["t"], fields=fields, tensors=tensors, sender=header["from"],
        seq=header["seq"], session=header["sid"], rid=header["rid"], more=header["more"],
    )
