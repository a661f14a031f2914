"""A small tokenizer facade shared by every backend: encode, decode, chat template, fingerprint.

Both backends use the Hugging Face tokenizer from the model folder, so the same folder gives the
same token ids on torch and mlx, and the fingerprint tells whether two models can share drafts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path


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
        """Token ids for a prompt; with `chat`, wrapped in the model's chat template."""
        if chat and self.has_chat_template:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": text})
            ids = self.hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.hf.encode(text, add_special_tokens=True)]

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a chat (`[{role, content}, ...]`) rendered by the model's chat template,
        ending with the assistant's turn opened (`add_generation_prompt`). Without a template
        the contents are joined by blank lines, as a plain prompt."""
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        if not self.has_chat_template:
            return self.encode("\n\n".join(m["content"] for m in msgs), chat=False)
        ids = self.hf.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token decoded on its own (for display; may split multi-byte characters)."""
        return [self.hf.decode([int(i)]) for i in ids]
