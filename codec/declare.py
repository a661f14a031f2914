"""Declaring a wire message once: a frozen dataclass whose fields say how they travel.

Each field of a message class is made by one of the helpers below (`integer`, `number`,
`text`, `tokens`, ...). The helper records where the field travels (a header field, a tensor
frame, the `sid` header), its wire kind (what `decode` checks of every message before anything
else: an int is an int) and its value bounds (what the typed struct checks: a `top_p` is in
(0, 1]). `@message("type")` makes the class a frozen dataclass and derives from those same
fields the kind-level `Schema` the codec encodes and decodes with, the value checks run on
construction, `from_message` and `to_message`. A field is declared once, so the two levels
cannot disagree and a new field cannot be forgotten by one of them.

A `@record` (the sampling settings) is a group of fields that travels inside a message, either
flat among the message's own fields or as one map; a message checks its records with the prefix
that names the field (`sampling.top_p`). A record does not check itself on construction: the
engine makes its own and reports its own error type (`nodes/engine/sampling.py`).

Header fields go on the wire in declaration order (the msgpack map keeps it), so a message's
bytes stay what they were as long as its fields keep their order; tensors go in declaration
order too, each optional one left out when empty and nothing after it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, dataclass_transform

import numpy as np

from codec import checks
from codec.envelope import Message, make
from codec.errors import BadRequest, UnknownType
from codec.schema import BOOL, FLOAT, INT, MAP, STR, STRS, TOKEN_DTYPES, Schema, TensorRule

WIRE = "specbus.wire"  # the dataclass field metadata key holding a field's `Wire`
HEADER, TENSOR, SESSION, FLAT = "header", "tensor", "session", "flat"


def _same(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class Wire:
    """How one field travels and which values it may hold."""

    place: str  # HEADER, TENSOR, SESSION or FLAT (a record's fields among the message's)
    check: Callable[[str, Any], Any]  # (field name, value) -> the value in its one form
    kind: str | None = None  # header fields: the schema kind `decode` checks
    rule: TensorRule | None = None  # tensor fields: dtypes and dims `decode` checks
    encode: Callable[[Any], Any] = _same  # the value as it travels
    decode: Callable[[Any], Any] = _same  # a received value (kind-checked) into the field
    required: bool | None = None  # on the wire; None: when the field has no default
    omit_empty: bool = False  # a header field left out when empty (else only when None)
    record: type | None = None  # FLAT: the record whose fields travel flat


def _field(wire: Wire, default: Any, default_factory: Any) -> Any:
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={WIRE: wire})


# -- field helpers -------------------------------------------------------------------------------
def integer(lo: int, hi: int, *, default: Any = MISSING, required: bool | None = None) -> Any:
    """An int header field in lo..hi."""
    return _field(Wire(HEADER, lambda n, v: checks.int_in(n, v, lo, hi), INT, encode=int,
                       required=required), default, MISSING)


def number(lo: float, hi: float, *, lo_open: bool = False, default: Any = MISSING) -> Any:
    """A float header field in [lo, hi] (or (lo, hi]); an int is accepted and sent as a
    float."""
    return _field(Wire(HEADER, lambda n, v: checks.number_in(n, v, lo, hi, lo_open=lo_open),
                       FLOAT, encode=float), default, MISSING)


def text(*, default: Any = MISSING, blank: bool = True,
         choices: tuple[str, ...] = ()) -> Any:
    """A str header field; `blank=False` refuses an empty or all-space one; `choices`
    restricts it to those values."""

    def check(name: str, v: Any) -> str:
        v = checks.text(name, v, allow_empty=blank)
        if choices and v not in choices:
            allowed = " or ".join(repr(c) for c in choices)
            raise BadRequest(name, f"must be {allowed}{' or absent' if default is None else ''}"
                             f", got {checks.shown(repr(v))}")
        return v

    return _field(Wire(HEADER, check, STR), default, MISSING)


def flag(*, default: Any = MISSING) -> Any:
    """A bool header field."""
    return _field(Wire(HEADER, checks.flag, BOOL), default, MISSING)


def strings(max_items: int, *, chars: tuple[int, int] | None = None, blank: bool = True,
            default: Any = MISSING, omit_empty: bool = False) -> Any:
    """A list of at most `max_items` strings (a tuple in memory); each of `chars` = (lo, hi)
    characters when given, not blank when `blank=False`; left off the wire when empty with
    `omit_empty`. Errors name the entry (`stop[2]`)."""

    def check(name: str, v: Any) -> tuple[str, ...]:
        if not isinstance(v, list | tuple) or len(v) > max_items:
            raise BadRequest(name, f"must be a list of at most {max_items} strings")
        for i, s in enumerate(v):
            checks.text(f"{name}[{i}]", s, allow_empty=blank)
            if chars is not None and not chars[0] <= len(s) <= chars[1]:
                raise BadRequest(f"{name}[{i}]", f"must have {chars[0]}..{chars[1]} characters")
        return tuple(v)

    return _field(Wire(HEADER, check, STRS, encode=list, omit_empty=omit_empty), default,
                  MISSING)


def mapping(*, omit_empty: bool = False) -> Any:
    """A map header field with string keys (a dict in memory; values unchecked: free-form
    figures such as a generation's stats)."""

    def check(name: str, v: Any) -> dict[str, Any]:
        if not isinstance(v, Mapping):
            raise BadRequest(name, f"must be a map, got {type(v).__name__}")
        return dict(v)

    return _field(Wire(HEADER, check, MAP, encode=dict, omit_empty=omit_empty), MISSING, dict)


def custom(kind: str, check: Callable[[str, Any], Any], encode: Callable[[Any], Any], *,
           default: Any = MISSING) -> Any:
    """A header field of `kind` with its own value check and wire form (chat messages)."""
    return _field(Wire(HEADER, check, kind, encode=encode), default, MISSING)


def session(*, required: bool = True) -> Any:
    """The session id, carried in the envelope's `sid`; `required`: it may not be empty."""

    def check(_name: str, v: Any) -> str:
        checks.text("sid", v)
        if required and not v:
            raise BadRequest("sid", "needs a session id (header 'sid')")
        return v

    return _field(Wire(SESSION, check), MISSING, MISSING)


def token_ids(*, blank: bool = True, most: int | None = None, as_given: bool = False,
              default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A tensor frame of token ids: 1-D, ids >= 0, at most `most` of them; sent as int32, or
    `as_given` in the caller's integer dtype (int64 ids stay int64: `generate_req` always
    sent them so, and its bytes do not change within the protocol version)."""

    def check(name: str, v: Any) -> np.ndarray:
        arr = checks.tokens_1d(name, v, allow_empty=blank)
        if most is not None:
            checks.length(name, arr, 0, most)
        return arr

    return _field(Wire(TENSOR, check, rule=TensorRule("", TOKEN_DTYPES, 1),
                       encode=np.ascontiguousarray if as_given else _int32),
                  default, default_factory)


def indices(lo: int, *, default_factory: Any = MISSING) -> Any:
    """A tensor frame of integers >= lo (lengths, positions, parent indices); sent as int32."""
    return _field(Wire(TENSOR, lambda n, v: checks.indices_1d(n, v, lo),
                       rule=TensorRule("", TOKEN_DTYPES, 1), encode=_int32),
                  MISSING, default_factory)


def probabilities(*, default: Any = MISSING) -> Any:
    """A tensor frame of probabilities in [0, 1]; sent as float32."""
    return _field(Wire(TENSOR, checks.probabilities,
                       rule=TensorRule("", ("float32", "float16"), 1), encode=_float32),
                  default, MISSING)


def features(*, default_factory: Any = MISSING) -> Any:
    """A tensor frame of hidden-state values, flattened; sent as float16."""
    return _field(Wire(TENSOR, checks.features, rule=TensorRule("", ("float16",), 1),
                       encode=lambda v: np.ascontiguousarray(v, dtype=np.float16)),
                  MISSING, default_factory)


def log_probabilities(*, default_factory: Any = MISSING) -> Any:
    """A tensor frame of natural-log probabilities (<= 0); sent as float32."""
    return _field(Wire(TENSOR, checks.log_probabilities,
                       rule=TensorRule("", ("float32", "float16"), 1), encode=_float32),
                  MISSING, default_factory)


def nested(record_cls: type, *, flat: bool = False) -> Any:
    """A record (`@record`) inside a message: its fields flat among the message's own
    (`flat=True`; errors name the inner field, `top_p`), or as one map under this field's
    name (errors name `sampling.top_p`). Absent fields take the record's defaults."""

    def check(name: str, v: Any) -> Any:
        if not isinstance(v, record_cls):
            raise BadRequest(name, f"must be a {record_cls.__name__}, got {type(v).__name__}")
        v.check("" if flat else f"{name}.")
        return v

    def decode(v: Any) -> Any:  # a map (kind-checked) into the record; else left to `check`
        return record_cls.from_fields(v) if isinstance(v, Mapping) else v

    wire = (Wire(FLAT, check, record=record_cls) if flat else
            Wire(HEADER, check, MAP, encode=lambda r: r.to_fields(), decode=decode))
    return _field(wire, MISSING, record_cls)


def _int32(v: Any) -> np.ndarray:
    return np.ascontiguousarray(v, dtype=np.int32)


def _float32(v: Any) -> np.ndarray:
    return np.ascontiguousarray(v, dtype=np.float32)


FIELD_HELPERS = (integer, number, text, flag, strings, mapping, custom, session, token_ids,
                 indices, probabilities, log_probabilities, features, nested)


# -- layouts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Slot:
    name: str
    wire: Wire
    has_default: bool
    default_none: bool


def _slots(cls: type) -> tuple[_Slot, ...]:
    out = []
    for f in dataclasses.fields(cls):
        wire = f.metadata.get(WIRE)
        if wire is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with a codec.declare "
                            "field helper")
        if wire.place == TENSOR:  # the rule takes the field's name (decode errors say it)
            wire = dataclasses.replace(wire, rule=dataclasses.replace(wire.rule, name=f.name))
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        out.append(_Slot(f.name, wire, has_default, has_default and f.default is None))
    return tuple(out)


def _run_checks(obj: Any, slots: tuple[_Slot, ...], prefix: str, store: bool) -> None:
    for s in slots:
        v = getattr(obj, s.name)
        if v is None and s.default_none:
            continue
        try:
            got = s.wire.check(s.name, v)
        except BadRequest as exc:
            if not prefix:
                raise
            raise BadRequest(prefix + exc.field, exc.reason) from None
        if store and got is not v:
            object.__setattr__(obj, s.name, got)


class Struct:
    """Base of every `@message` class: construction checks every field, then the class's
    `_cross_check` (rules between fields); `from_message` and `to_message` are the one place
    a message of the type is read and built."""

    TYPE: ClassVar[str]
    SCHEMA: ClassVar[Schema]
    _SLOTS: ClassVar[tuple[_Slot, ...]]
    _COUNTS: ClassVar[tuple[int, ...]]

    def __post_init__(self) -> None:
        _run_checks(self, self._SLOTS, "", store=True)
        self._cross_check()

    def _cross_check(self) -> None:
        """Rules between fields (a message overrides it); each field is checked already."""

    @classmethod
    def from_message(cls, msg: Message) -> Any:
        """The typed object of a received message (raises BadRequest / UnknownType)."""
        if msg.type != cls.TYPE:
            raise UnknownType(f"expected a {cls.TYPE} message, got {msg.type!r}")
        n = len(msg.tensors)
        if n not in cls._COUNTS:
            names = [s.name for s in cls._SLOTS if s.wire.place == TENSOR]
            raise BadRequest("tensors", f"a {cls.TYPE} carries "
                             f"{' or '.join(map(str, cls._COUNTS))} tensors "
                             f"({', '.join(names)} in order), got {n}")
        kw: dict[str, Any] = {}
        i = 0
        for s in cls._SLOTS:
            place = s.wire.place
            if place == SESSION:
                kw[s.name] = msg.session
            elif place == TENSOR:
                if i < n:
                    kw[s.name] = msg.tensors[i]
                i += 1
            elif place == FLAT:
                kw[s.name] = s.wire.record.from_fields(msg.fields)
            else:
                v = msg.fields.get(s.name)
                if v is not None:  # nil on the wire means "not given"
                    kw[s.name] = s.wire.decode(v)
                elif not s.has_default:
                    raise BadRequest(s.name, f"{cls.TYPE} needs field {s.name!r}")
        return cls(**kw)

    def to_message(self, **envelope: Any) -> Message:
        """The message of this object; `envelope` takes `sender`, `seq`, `rid`, `more`."""
        fields: dict[str, Any] = {}
        tensors: list[tuple[Wire, Any]] = []
        given = 0  # tensors go up to the last one given
        for s in self._SLOTS:
            v = getattr(self, s.name)
            place = s.wire.place
            if place == SESSION:
                envelope["session"] = v
            elif place == TENSOR:
                tensors.append((s.wire, v))
                if (not s.has_default or (s.default_none and v is not None)
                        or (v is not None and len(v))):  # given: required, set, or non-empty
                    given = len(tensors)
            elif place == FLAT:
                fields.update(v.to_fields())
            elif v is not None and not (s.wire.omit_empty and not v):
                fields[s.name] = s.wire.encode(v)
        frames = [w.encode(v) for w, v in tensors[:given]]
        return make(self.TYPE, tensors=frames, **envelope, **fields)


class Record:
    """Base of every `@record` class: a group of fields travelling inside a message."""

    _SLOTS: ClassVar[tuple[_Slot, ...]]

    def check(self, prefix: str = "") -> None:
        """Every field's bounds; a BadRequest names the field after `prefix`. A record is
        frozen, so one that passed is not checked again: settings checked where they entered
        (the gateway's HTTP parse, the CLI, a received message) travel on to the engine
        without a second range check (`dataclasses.replace` makes a new one, checked anew)."""
        if self.__dict__.get("_checked"):
            return
        _run_checks(self, self._SLOTS, prefix, store=False)
        object.__setattr__(self, "_checked", True)

    @classmethod
    def from_fields(cls, fields: Any) -> Any:
        """The record from a map of wire fields (absent or nil: the default; values are
        checked by `check`, which the enclosing message runs)."""
        if not isinstance(fields, Mapping):
            raise BadRequest(cls.__name__, f"must be a map, got {type(fields).__name__}")
        return cls(**{s.name: s.wire.decode(fields[s.name]) for s in cls._SLOTS
                      if fields.get(s.name) is not None})

    def to_fields(self) -> dict[str, Any]:
        """The wire fields of the record, in declaration order (nil ones left out)."""
        return {s.name: s.wire.encode(v) for s in self._SLOTS
                if (v := getattr(self, s.name)) is not None}


# -- decorators ----------------------------------------------------------------------------------
@dataclass_transform(frozen_default=True, field_specifiers=FIELD_HELPERS)
def message(type_: str, *, counts: tuple[int, ...] | None = None, eq: bool = True,
            kw_only: bool = False) -> Callable[[type], type]:
    """Declare the `Struct` subclass below as the message `type_`: a frozen dataclass, its
    `Schema` (doc: the class docstring) and its checks, all from its fields. `counts`: the
    numbers of tensors it may carry (default: any from the required ones to all)."""

    def wrap(cls: type) -> type:
        cls = dataclass(frozen=True, eq=eq, kw_only=kw_only)(cls)
        slots = _slots(cls)
        cls.TYPE = type_
        cls._SLOTS = slots
        cls.SCHEMA = _schema(type_, cls.__doc__ or "", slots, counts)
        n_tensors = len(cls.SCHEMA.tensors)
        cls._COUNTS = counts or tuple(range(cls.SCHEMA.min_tensors, n_tensors + 1))
        return cls

    return wrap


@dataclass_transform(frozen_default=True, field_specifiers=FIELD_HELPERS)
def record(cls: type) -> type:
    """Declare the `Record` subclass below: a frozen dataclass whose fields travel inside a
    message (`nested`)."""
    cls = dataclass(frozen=True)(cls)
    cls._SLOTS = _slots(cls)
    for s in cls._SLOTS:
        if s.wire.place != HEADER:
            raise TypeError(f"record field {cls.__name__}.{s.name} must be a header field")
    return cls


def _schema(type_: str, doc: str, slots: tuple[_Slot, ...],
            counts: tuple[int, ...] | None) -> Schema:
    required: dict[str, str] = {}
    optional: dict[str, str] = {}
    rules = []
    min_tensors = 0
    for s in slots:
        w = s.wire
        if w.place == HEADER:
            needed = not s.has_default if w.required is None else w.required
            (required if needed else optional)[s.name] = w.kind
        elif w.place == FLAT:
            optional.update({r.name: r.wire.kind for r in w.record._SLOTS})
        elif w.place == TENSOR:
            rules.append(w.rule)
            if not s.has_default:
                min_tensors = len(rules)
    return Schema(type_, " ".join(doc.split()), required=required, optional=optional,
                  tensors=tuple(rules), min_tensors=min(counts) if counts else min_tensors)
