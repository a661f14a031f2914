"""An EAGLE-3 head's config.json, as vLLM, SGLang and SpecForge write and read it.

Only what the head needs is kept; everything is checked here so a malformed config fails at
load with a message naming the field, never later inside a forward.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nodes.engine.errors import BadRequestError

ARCHITECTURE = "LlamaForCausalLMEagle3"
#: architecture names other tools write for the same layout
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (vLLM's default: 2, L/2, L-3)."""
    return tuple(sorted((min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))))


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    draft_vocab_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    head_dim: int | None = None
    target_hidden_size: int | None = None
    #: verifier layer ids (id i: the input of decoder layer i); None: the verifier's defaults
    layer_ids: tuple[int, ...] | None = None
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def feature_size(self) -> int:
        """Width of one verifier hidden state (fc takes three of them)."""
        return self.target_hidden_size or self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> EagleConfig:
        arch = raw.get("architectures") or []
        if not any(a in ARCHITECTURES for a in arch):
            raise BadRequestError(f"{where}: architectures {arch} name no Llama EAGLE-3 head "
                                  f"(expected {ARCHITECTURE!r})")

        def need(key: str) -> int:
            value = raw.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadRequestError(f"{where}: {key} must be a positive integer, "
                                      f"got {value!r}")
            return value

        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            if (not isinstance(ids, list) or len(ids) != 3
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise BadRequestError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids "
                                      f"must be three integers, got {ids!r}")
            ids = tuple(ids)
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        cfg = cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            intermediate_size=need("intermediate_size"),
            draft_vocab_size=raw.get("draft_vocab_size") or need("vocab_size"),
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            head_dim=raw.get("head_dim"),
            target_hidden_size=raw.get("target_hidden_size"),
            layer_ids=ids,
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            hidden_act=raw.get("hidden_act", "silu"),
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise BadRequestError(f"{where}: num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {cfg.num_key_value_heads}")
        if cfg.hidden_act != "silu":
            raise BadRequestError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported "
                                  "(Llama EAGLE-3 heads use silu)")
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise BadRequestError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} exceeds "
                                  f"vocab_size {cfg.vocab_size}")
        return cfg

    @classmethod
    def read(cls, folder: Path) -> EagleConfig:
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadRequestError(f"eagle head {folder}: no config.json") from None
        except (OSError, ValueError) as exc:
            raise BadRequestError(f"eagle head {path}: unreadable: {exc}") from None
        if not isinstance(raw, dict):
            raise BadRequestError(f"eagle head {path}: not a JSON object")
        return cls.from_dict(raw, str(path))

    def to_dict(self) -> dict[str, Any]:
        """The published layout's config.json (what vLLM/SGLang read)."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
        }
        if self.head_dim:
            out["head_dim"] = self.head_dim
        if self.target_hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling:
            out["rope_scaling"] = self.rope_scaling
        if self.layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
                                   "use_aux_hidden_state": True}
        return out

    def write(self, folder: Path) -> None:
        Path(folder, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> EagleConfig:
        values = asdict(self)
        values.update(changes)
        return EagleConfig(**values)
