"""`Message`, one message in memory, and `make`, its plain constructor.

Kept apart from the encoder (`codec.messages`) so that the typed declarations
(`codec.structs`) can build messages while the encoder takes its schemas from them: the
imports run one way, envelope <- structs <- messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Message:
    """One decoded (or to-be-encoded) message: type, envelope, fields and tensors."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: list[np.ndarray] = field(default_factory=list)
    sender: str = ""
    seq: int = 0
    session: str = ""
    rid: int = 0
    more: bool = False

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def make(type_: str, *, tensors: Sequence[np.ndarray] = (), sender: str = "", seq: int = 0,
         session: str = "", rid: int = 0, more: bool = False, **fields: Any) -> Message:
    """Build a message (validated when encoded). Types with a typed struct in
    `codec.structs` are built through it instead (`Struct(...).to_message()`)."""
    return Message(type_, dict(fields), list(tensors), sender, seq, session, rid, more)
