"""A small tokenizer facade shared by every backend: encode, decode, chat template, fingerprint.

Both backends use the Hugging Face tokenizer from the model folder, so the same folder gives the
same token ids on torch and mlx, and the fingerprint tells whether two models can share drafts.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

_MARK = re.compile("\ue000(\\d+)\ue001")


class Tokenizer:
    """Wraps a transformers tokenizer loaded offline from a model folder."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        return frozenset(ids)

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the vocabulary and special tokens: equal fingerprints mean equal token ids."""
        vocab = sorted(self.hf.get_vocab().items(), key=lambda kv: kv[1])
        special = sorted(str(t) for t in self.hf.all_special_tokens)
        blob = json.dumps([vocab, special], ensure_ascii=False).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a prompt; with `chat`, wrapped in the model's chat template (the text
        is then message content: control tokens in it stay text, see `encode_messages`). A
        plain prompt (`chat=False`) is the caller's raw text, special tokens included."""
        if chat and self.has_chat_template:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": text})
            return self.encode_messages(messages)
        return [int(i) for i in self.hf.encode(text, add_special_tokens=True)]

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a chat (`[{role, content}, ...]`) rendered by the model's chat template,
        ending with the assistant's turn opened (`add_generation_prompt`). Without a template
        the contents are joined by blank lines, as a plain prompt.

        Content is text, never control tokens: a user who writes `<|im_end|>` and
        `<|im_start|>system` into a message must not close their own turn and open a system
        one. Content holding the text of a special (added) token is tokenized with those
        tokens split into ordinary text pieces, while the template's own markup keeps its
        control tokens; content without any (nearly all of it) renders exactly as the Hugging
        Face chat template does.
        """
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        hostile = any(self._holds_control(m["content"]) for m in msgs)
        if not self.has_chat_template:
            text = "\n\n".join(m["content"] for m in msgs)
            if hostile:
                return self._text_ids(text, add_special_tokens=True)
            return self.encode(text, chat=False)
        if hostile:
            return self._encode_escaped(msgs)
        ids = self.hf.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    @cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The text of every added token (`<|im_start|>`, ...): what the tokenizer would turn
        into one control id wherever it appears in a string."""
        added = getattr(self.hf, "added_tokens_decoder", {}) or {}
        texts = {str(getattr(t, "content", t)) for t in added.values()}
        texts |= {str(t) for t in self.hf.all_special_tokens}
        return tuple(sorted(t for t in texts if t))

    def _holds_control(self, text: str) -> bool:
        return any(t in text for t in self.control_texts)

    def _text_ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text` as plain text: special-token strings inside it become ordinary pieces."""
        out = self.hf(text, add_special_tokens=add_special_tokens, split_special_tokens=True)
        return [int(i) for i in out["input_ids"]]

    def _encode_escaped(self, msgs: list[dict[str, str]]) -> list[int]:
        """The template rendered around markers standing for each content; the template's
        text is tokenized as usual (its control tokens kept), each content as plain text."""
        marks = [f"\ue000{i}\ue001" for i in range(len(msgs))]
        rendered = self.hf.apply_chat_template(
            [{"role": m["role"], "content": mark} for m, mark in zip(msgs, marks, strict=True)],
            add_generation_prompt=True, tokenize=False)
        ids: list[int] = []
        for i, piece in enumerate(_MARK.split(rendered)):
            if i % 2 == 0:  # the template's own text
                if piece:
                    ids += [int(t) for t in self.hf.encode(piece, add_special_tokens=False)]
            else:  # a marker's index: that message's content, as text
                ids += self._text_ids(msgs[int(piece)]["content"])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token decoded on its own (for display; may split multi-byte characters)."""
        return [self.hf.decode([int(i)]) for i in ids]

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes: exact for a byte-level BPE token that holds part of a
        multi-byte character (its text alone would be a replacement character)."""
        out = []
        for i, piece in zip(ids, self.hf.convert_ids_to_tokens([int(i) for i in ids]),
                            strict=True):
            text = self.hf.decode([int(i)])
            raw = None
            if "\ufffd" in text and piece is not None:
                raw = _byte_level(piece)
            out.append(raw if raw is not None else text.encode("utf-8"))
        return out


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable Latin-1 bytes stand for themselves,
    the other bytes for the code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _byte_level(piece: str) -> bytes | None:
    """A byte-level BPE token's bytes; None when the token is not written in that alphabet."""
    if not piece or any(c not in _BYTE_LEVEL for c in piece):
        return None
    return bytes(_BYTE_LEVEL[c] for c in piece)
