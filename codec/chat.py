"""Chat messages as they travel in `generate_req.messages`: `{role, content}` maps.

Also used to read a conversation outside the wire (`specbus generate --messages FILE`), so a
file and a request are checked alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from codec import checks
from codec.errors import BadRequest

CHAT_ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise BadRequest("role", f"must be one of {'/'.join(CHAT_ROLES)}, got {self.role!r}")
        checks.text("content", self.content)

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def chat_messages(name: str, v: Any) -> tuple[ChatMessage, ...]:
    """1..MAX_MESSAGES chat messages from maps (or ChatMessages); errors name the entry."""
    if not isinstance(v, list | tuple):
        raise BadRequest(name, f"must be a list of {{role, content}} maps, got {type(v).__name__}")
    if not 1 <= len(v) <= MAX_MESSAGES:
        raise BadRequest(name, f"must hold 1..{MAX_MESSAGES} messages, got {len(v)}")
    out = []
    for i, m in enumerate(v):
        where = f"{name}[{i}]"
        if isinstance(m, ChatMessage):
            out.append(m)
            continue
        if not isinstance(m, Mapping):
            raise BadRequest(where, f"must be a {{role, content}} map, got {type(m).__name__}")
        try:
            out.append(ChatMessage(checks.text("role", m.get("role")),
                                   checks.text("content", m.get("content"))))
        except BadRequest as exc:
            raise BadRequest(f"{where}.{exc.field}", exc.reason) from None
    return tuple(out)


def as_dicts(messages: tuple[ChatMessage, ...]) -> list[dict[str, str]]:
    return [m.as_dict() for m in messages]
