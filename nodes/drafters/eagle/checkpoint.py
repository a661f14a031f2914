"""Load, check and save EAGLE-3 heads in the published layout (config.json + safetensors).

A checkpoint that does not fit the verifier is refused at load with a message naming what is
wrong (hidden size, vocabulary, layer ids, a missing, extra or misshapen tensor, NaN weights,
an inconsistent d2t/t2d, a tokenizer fingerprint that differs), never loaded into a drafter
that would silently propose nonsense. Heads we train also carry `specbus_head.json` (the
verifier's tokenizer fingerprint and how the head was trained); foreign heads have none.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from nodes.drafters.eagle.config import EagleConfig, default_layer_ids
from nodes.drafters.eagle.head import Eagle3Head
from nodes.engine.errors import BadRequestError, TokenizerMismatchError

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
META = "specbus_head.json"


class VerifierShape:
    """What a head must fit: the verifier's hidden size, layers, vocabulary and tokenizer."""

    def __init__(self, hidden_size: int, num_layers: int, vocab_size: int,
                 fingerprint: str | None = None, embedding: torch.Tensor | None = None) -> None:
        self.hidden_size, self.num_layers, self.vocab_size = hidden_size, num_layers, vocab_size
        self.fingerprint, self.embedding = fingerprint, embedding

    @classmethod
    def of(cls, backend: Any) -> VerifierShape:
        """From a torch backend (its input embedding is shared with heads that have none)."""
        model = getattr(backend, "model", None)
        if model is None or not hasattr(backend, "num_layers"):
            raise BadRequestError(f"an eagle head needs a torch verifier (its hidden states); "
                                  f"backend {getattr(backend, 'name', '?')!r} has none to give")
        return cls(backend.hidden_size, backend.num_layers, backend.vocab_size,
                   backend.fingerprint, model.get_input_embeddings().weight.detach())


def weight_files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise BadRequestError(f"eagle head {folder}: no .safetensors weights")
    return files


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            tensors.update(load_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - any parse failure is a bad checkpoint
            raise BadRequestError(f"eagle head {path}: unreadable safetensors: {exc}") from None
    return tensors


def resolve_layers(cfg: EagleConfig, verifier: VerifierShape, where: str) -> tuple[int, ...]:
    ids = cfg.layer_ids or default_layer_ids(verifier.num_layers)
    bad = [i for i in ids if not 0 <= i < verifier.num_layers]
    if bad:
        raise BadRequestError(f"{where}: aux hidden-state layer ids {list(ids)} out of range "
                              f"for a verifier of {verifier.num_layers} layers (0..."
                              f"{verifier.num_layers - 1})")
    return tuple(ids)


def check_fit(cfg: EagleConfig, tensors: dict[str, torch.Tensor], verifier: VerifierShape,
              where: str) -> None:
    """Dimensions and vocabulary against the verifier (before any tensor is copied)."""
    if cfg.feature_size != verifier.hidden_size:
        what = "target_hidden_size" if cfg.target_hidden_size else "hidden_size"
        raise BadRequestError(f"{where}: {what} {cfg.feature_size} does not match the "
                              f"verifier's hidden size {verifier.hidden_size}")
    if cfg.vocab_size != verifier.vocab_size:
        raise BadRequestError(f"{where}: vocab_size {cfg.vocab_size} does not match the "
                              f"verifier's {verifier.vocab_size}")
    if "embed_tokens.weight" not in tensors and cfg.hidden_size != verifier.hidden_size:
        raise BadRequestError(f"{where}: no embed_tokens and hidden_size {cfg.hidden_size} "
                              f"differs from the verifier's {verifier.hidden_size}, so its "
                              "embedding cannot be shared")


def check_tensors(head: Eagle3Head, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Names, shapes and finiteness against the head built from the config."""
    expected = {k: v.shape for k, v in head.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise BadRequestError(f"{where}: missing tensors {missing}")
    if extra:
        raise BadRequestError(f"{where}: unexpected tensors {extra} (not a Llama EAGLE-3 "
                              "head with one decoder layer?)")
    for name, shape in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(shape):
            raise BadRequestError(f"{where}: tensor {name} has shape {list(got.shape)}, "
                                  f"expected {list(shape)} from config.json")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise BadRequestError(f"{where}: tensor {name} holds NaN or infinite values")


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, where: str) -> None:
    """d2t must map every draft id to a distinct verifier id that t2d marks."""
    if d2t.is_floating_point():
        raise BadRequestError(f"{where}: d2t must hold integers, got {d2t.dtype}")
    target = torch.arange(len(d2t)) + d2t.long()
    if len(target) and (int(target.min()) < 0 or int(target.max()) >= vocab):
        raise BadRequestError(f"{where}: d2t maps draft ids outside the verifier's vocabulary "
                              f"(0...{vocab - 1})")
    if len(torch.unique(target)) != len(target):
        raise BadRequestError(f"{where}: d2t maps two draft ids to the same verifier id")
    marks = t2d.bool()
    if int(marks.sum()) != len(target) or not bool(marks[target].all()):
        raise BadRequestError(f"{where}: t2d does not mark exactly the verifier ids d2t maps to")


def load_head(folder: str | Path, verifier: VerifierShape,
              device: str | torch.device = "cpu") -> tuple[Eagle3Head, tuple[int, ...]]:
    """A checked head (float32, eval mode) and the verifier layer ids it reads."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadRequestError(f"eagle head {folder}: no such folder")
    where = f"eagle head {folder}"
    cfg = EagleConfig.read(folder)
    meta = read_meta(folder)
    fp = meta.get("tokenizer_fingerprint")
    if fp and verifier.fingerprint and fp != verifier.fingerprint:
        raise TokenizerMismatchError(f"{where} was trained for tokenizer {fp}; the verifier's "
                                     f"is {verifier.fingerprint}")
    tensors = read_tensors(folder)
    if "t2d" not in tensors and "d2t" in tensors:  # some exports keep only d2t
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        target = torch.arange(len(tensors["d2t"])) + tensors["d2t"].long()
        t2d[target.clamp(0, cfg.vocab_size - 1)] = True
        tensors["t2d"] = t2d
    check_fit(cfg, tensors, verifier, where)
    layers = resolve_layers(cfg, verifier, where)
    head = Eagle3Head(cfg, own_embedding="embed_tokens.weight" in tensors)
    check_tensors(head, tensors, where)
    check_vocab_map(tensors["d2t"], tensors["t2d"], cfg.vocab_size, where)
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    head.load_state_dict({k: v.float() if v.is_floating_point() else v
                          for k, v in tensors.items()})
    if head.embed_tokens is None:
        head.shared_embedding = verifier.embedding
    head.to(device).eval()
    log.info("eagle head %s: hidden %d, draft vocab %d, layers %s, %s embedding", folder,
             cfg.hidden_size, cfg.draft_vocab_size, list(layers),
             "own" if head.embed_tokens is not None else "the verifier's")
    return head, layers


def read_meta(folder: Path) -> dict:
    path = Path(folder) / META
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadRequestError(f"eagle head {path}: unreadable: {exc}") from None
    return meta if isinstance(meta, dict) else {}


def save_head(folder: str | Path, head: Eagle3Head, meta: dict | None = None,
              dtype: torch.dtype = torch.float16) -> None:
    """Write config.json + model.safetensors (floats in `dtype`) + our metadata."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head.cfg.write(folder)
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).cpu()
             .contiguous() for k, v in head.state_dict().items()}
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS)
    if meta is not None:
        (folder / META).write_text(json.dumps(meta, indent=2) + "\n")
