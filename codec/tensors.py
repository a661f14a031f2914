"""Tensors on the wire: dtype names, zero-copy views, and torch/mlx conversions.

A tensor frame is a raw little-endian C-contiguous buffer; its dtype and shape travel in the
header. Received frames are wrapped with `numpy.frombuffer` over the frame's own buffer, so
decoding never copies. Small tensors (at most `INLINE_MAX_BYTES`) travel inline instead: the
same raw bytes as a msgpack `bin` under the spec's `data` key, which saves a frame (a frame
costs more than copying a few hundred bytes; pyzmq copies frames under 64 KiB anyway). numpy has
no bfloat16: such tensors travel and arrive as their uint16 bit patterns, marked by the
`BFloat16Bits` ndarray subclass; `to_torch`/`to_mlx` reinterpret the bits. torch and mlx are
imported only when those conversions are called.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from codec.errors import BadDtype, BadShape, ByteCount, Oversize

# wire name -> numpy dtype of the buffer (little-endian)
WIRE_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

MAX_DIMS = 8
INLINE_MAX_BYTES = 1024  # tensors up to this size go inside the header (sender's choice)


class BFloat16Bits(np.ndarray):
    """A uint16 array holding bfloat16 bit patterns; tells the codec to tag it `bfloat16`."""


def bfloat16_bits(array: np.ndarray) -> BFloat16Bits:
    """Mark a uint16 array as bfloat16 bits (a view, no copy)."""
    arr = np.asarray(array)
    if arr.dtype != np.uint16:
        raise BadDtype(f"bfloat16 bits must be uint16, got {arr.dtype}")
    return arr.view(BFloat16Bits)


def wire_dtype(array: np.ndarray) -> str:
    """The wire name for an array's dtype, or BadDtype."""
    if isinstance(array, BFloat16Bits):
        return "bfloat16"
    dt = array.dtype
    for name, wdt in WIRE_DTYPES.items():
        if name == "bfloat16":
            continue
        if dt.kind == wdt.kind and dt.itemsize == wdt.itemsize:  # any byte order
            return name
    raise BadDtype(f"dtype {dt} cannot travel (allowed: {', '.join(WIRE_DTYPES)})")


def prepare(array: Any) -> tuple[np.ndarray, dict]:
    """Return a C-contiguous little-endian array ready to send, and its header entry."""
    if not isinstance(array, np.ndarray):
        raise BadDtype(f"tensor must be a numpy array, got {type(array).__name__}")
    name = wire_dtype(array)
    want = WIRE_DTYPES[name]
    out = array
    if out.dtype != want:  # big-endian or native alias: normalise
        out = out.astype(want)
    if not out.flags.c_contiguous:
        out = np.ascontiguousarray(out)
    if name == "bfloat16" and not isinstance(out, BFloat16Bits):
        out = out.view(BFloat16Bits)
    return out, {"dtype": name, "shape": list(out.shape)}


def check_spec(spec: Any, max_bytes: int) -> tuple[np.dtype, tuple[int, ...], int]:
    """Validate one `{dtype, shape}` header entry; return (dtype, shape, expected bytes)."""
    if not isinstance(spec, dict):
        raise BadShape(f"tensor spec must be a map, got {type(spec).__name__}")
    name = spec.get("dtype")
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise BadDtype(f"unknown tensor dtype {name!r}")
    shape = spec.get("shape")
    if not isinstance(shape, list | tuple):
        raise BadShape(f"tensor shape must be a list, got {type(shape).__name__}")
    if len(shape) > MAX_DIMS:
        raise BadShape(f"tensor has {len(shape)} dims, at most {MAX_DIMS} allowed")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise BadShape(f"tensor dims must be non-negative integers, got {shape!r}")
    dtype = WIRE_DTYPES[name]
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > max_bytes:
        raise Oversize(f"tensor of shape {shape} {name} is {nbytes} bytes, limit {max_bytes}")
    return dtype, tuple(shape), nbytes


def view_frame(buffer: Any, spec: Any, max_bytes: int) -> np.ndarray:
    """Wrap a received frame buffer as an array without copying, after validating it."""
    return view_checked(buffer, spec, check_spec(spec, max_bytes))


def view_checked(buffer: Any, spec: dict,
                 checked: tuple[np.dtype, tuple[int, ...], int]) -> np.ndarray:
    """Wrap `buffer` (a frame, or an inline spec's bytes) given `check_spec`'s verdict on spec.

    The byte count must equal shape x itemsize exactly, inline or not; the array is read-only
    when the buffer is (received frames and msgpack bytes both are).
    """
    dtype, shape, nbytes = checked
    mv = memoryview(buffer)
    if mv.nbytes != nbytes:
        where = "inline data" if "data" in spec else "frame"
        raise ByteCount(f"{where} has {mv.nbytes} bytes, header says {shape} x {dtype.itemsize}")
    arr = np.frombuffer(mv, dtype=dtype).reshape(shape)
    if spec["dtype"] == "bfloat16":
        arr = arr.view(BFloat16Bits)
    return arr


def inline_data(spec: dict) -> bytes | None:
    """The inline bytes of a header spec, None for a frame tensor; BadShape if not bytes."""
    if "data" not in spec:
        return None
    data = spec["data"]
    if type(data) is not bytes:
        raise BadShape(f"inline tensor data must be bin, got {type(data).__name__}")
    return data


# -- framework conversions (lazy imports) -------------------------------------------------

def from_torch(tensor: Any) -> np.ndarray:
    """A CPU numpy view (or copy, if the tensor lives on a device) of a torch tensor."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).view(BFloat16Bits)
    return t.numpy()


def to_torch(array: np.ndarray) -> Any:
    """A torch tensor sharing memory with `array` where torch allows it (bf16 reinterpreted)."""
    import torch

    bf16 = isinstance(array, BFloat16Bits)
    array = np.asarray(array)
    if not array.flags.writeable:
        # torch warns on read-only buffers; received frames (and inline tensors) are read-only
        array = array.copy()
    if bf16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def from_mlx(array: Any) -> np.ndarray:
    """numpy array from an mlx array (mlx evaluates lazily; this forces evaluation)."""
    import mlx.core as mx

    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16), copy=False).view(BFloat16Bits)
    return np.array(array, copy=False)


def to_mlx(array: np.ndarray) -> Any:
    """An mlx array from a numpy array (bf16 bits reinterpreted)."""
    import mlx.core as mx

    if isinstance(array, BFloat16Bits):
        return mx.array(np.asarray(array)).view(mx.bfloat16)
    return mx.array(np.asarray(array))
