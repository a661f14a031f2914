"""Value checks for typed wire fields: each takes the field's name and raises `BadRequest`
naming it, and returns the value in its one in-memory form (an int, a float, a tuple, an
int32 array).

They are the building blocks of the field declarations in `codec.declare`; a message's
own cross-field rules (`codec.structs`) use them too, so every refusal reads the same.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from codec.errors import BadRequest

MAX_TOKEN_ID = 2**31 - 1
EMPTY_TOKENS = np.zeros(0, dtype=np.int32)


def shown(v: Any) -> str:
    """A value as an error message shows it: short, whatever its size (a 400-digit number
    is not echoed back in full)."""
    text = str(v)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def int_in(name: str, v: Any, lo: int, hi: int) -> int:
    if not is_int(v):
        raise BadRequest(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= int(v) <= hi:
        raise BadRequest(name, f"must be in {lo}..{hi}, got {shown(int(v))}")
    return int(v)


def number_in(name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
        raise BadRequest(name, f"must be a number, got {type(v).__name__}")
    left = "(" if lo_open else "["
    try:
        x = float(v)
    except OverflowError:  # an int too large for a float: out of any range
        raise BadRequest(name, f"must be in {left}{lo:g}, {hi:g}], got {shown(v)}") from None
    if not math.isfinite(x):
        raise BadRequest(name, f"must be finite, got {x}")
    if x < lo or x > hi or (lo_open and x == lo):
        raise BadRequest(name, f"must be in {left}{lo:g}, {hi:g}], got {x:g}")
    return x


def text(name: str, v: Any, *, allow_empty: bool = True) -> str:
    if not isinstance(v, str):
        raise BadRequest(name, f"must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise BadRequest(name, f"empty {name}: must hold some text")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 (so no msgpack str) can carry it
        raise BadRequest(name, "holds a lone UTF-16 surrogate, not a character") from None
    return v


def flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(name, f"must be true or false, got {type(v).__name__}")
    return v


def tokens_1d(name: str, t: Any, *, allow_empty: bool = True) -> np.ndarray:
    """A 1-D array of token ids >= 0 (upper bound: the node's vocabulary, checked there)."""
    arr = np.asarray(t)
    if arr.ndim != 1:
        raise BadRequest(name, f"must be a 1-D token tensor, got shape {list(arr.shape)}")
    if len(arr) == 0:
        if not allow_empty:
            raise BadRequest(name, "must hold at least one token id")
        return EMPTY_TOKENS
    if arr.dtype.kind not in "iu":
        raise BadRequest(name, f"must hold integer token ids, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > MAX_TOKEN_ID:
        raise BadRequest(name, f"token id {lo if lo < 0 else hi} is not a valid id")
    return arr


def indices_1d(name: str, t: Any, lo: int) -> np.ndarray:
    """A 1-D int32 array of integers >= lo (positions, lengths, parent indices)."""
    arr = np.asarray(t)
    if arr.ndim != 1 or (len(arr) and arr.dtype.kind not in "iu"):
        raise BadRequest(name, f"must be a 1-D integer tensor, got shape {list(arr.shape)} "
                         f"{arr.dtype}")
    if len(arr) and (int(arr.min()) < lo or int(arr.max()) > MAX_TOKEN_ID):
        raise BadRequest(name, f"every entry must be in {lo}..{MAX_TOKEN_ID}")
    return arr.astype(np.int32, copy=False)


def _floats_1d(name: str, v: Any, what: str, dtype, ok, rule: str) -> np.ndarray:
    """A 1-D float array in `dtype` whose values all pass `ok` (an empty one passes)."""
    arr = np.asarray(v)
    if arr.ndim != 1 or (len(arr) and arr.dtype.kind != "f"):
        raise BadRequest(name, f"must be {what}, got shape {list(arr.shape)} {arr.dtype}")
    arr = arr.astype(dtype, copy=False)
    if len(arr) and not np.all(ok(arr)):  # NaN fails every rule
        raise BadRequest(name, rule)
    return arr


def probabilities(name: str, v: Any) -> np.ndarray:
    """A 1-D float32 array of probabilities, each finite and in [0, 1]."""
    return _floats_1d(name, v, "probabilities", np.float32, lambda a: (a >= 0) & (a <= 1),
                      "every probability must be in [0, 1]")


def features(name: str, v: Any) -> np.ndarray:
    """A 1-D float16 array of finite values (a model's hidden states, flattened)."""
    return _floats_1d(name, v, "a 1-D float tensor", np.float16, np.isfinite,
                      "every value must be finite (fp16 overflows past 65504)")


def log_probabilities(name: str, v: Any) -> np.ndarray:
    """A 1-D float32 array of natural-log probabilities: each <= 0, -inf allowed, no NaN."""
    return _floats_1d(name, v, "log probabilities", np.float32, lambda a: a <= 0,
                      "every log probability must be <= 0")


def length(name: str, arr: Any, lo: int, hi: int, what: str = "tokens") -> None:
    """A sequence's length within lo..hi."""
    n = len(arr)
    if n > hi:
        raise BadRequest(name, f"at most {hi} {what}, got {n}")
    if n < lo:
        raise BadRequest(name, f"at least {lo} {what}, got {n}")
