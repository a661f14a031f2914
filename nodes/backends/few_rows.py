"""A float32 matmul for a few rows at a time: the shape of every speculative verify on a CPU.

Why: a verify forward feeds the verifier 2-17 tokens. On x86 CPUs torch runs `x @ W.T` for one
row as a fast matrix-vector product but for 2-16 rows as a packed matrix product that costs
1.7-3x as much (MKL's small-M path). On SmolLM2-135M a 2-token forward cost 1.72x a 1-token one
and a 3-token one 2.1x, so a drafter had to be right almost every time to pay, and none was on
open text. `few_rows.cpp` is a register-tiled AVX2/FMA kernel that streams each weight row once
for all the rows fed; with it a 2-token forward costs ~1.18x a 1-token one (docs/engine.md,
"Verify cost on CPUs").

Lossless: each output element is summed in one fixed order (8 lanes over k, then the lanes)
whatever the number of rows or their tiling, so a row's result never depends on which other
rows share the forward: verifying k drafted tokens gives each position the logits it gets fed
alone, and a batched sequence the logits it gets unbatched, as far as the linear layers go.

The same extension holds `linear_w8`, a weight-only int8 matmul (int8 weights packed in groups
of 8 rows with a float32 scale per row, float32 activations and sums) for the int8 drafter and
any module converted by nodes/backends/w8.py (which says why); it follows the same switch.

The kernel is a torch C++ extension built by `make` (`python -m nodes.backends.few_rows build`)
into the virtualenv, keyed by torch version and source; nothing compiles at run time. Where it
is not built, or the CPU lacks AVX2/FMA, or `SPECBUS_MATMUL=torch` is set, torch's own matmul
serves every shape (said once in the log).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("few_rows.cpp")
#: every source of the extension: the few-row matmuls and the quantized verifier's forward
SOURCES = (SOURCE, Path(__file__).with_name("quant_rows.cpp"))
#: files the sources include: part of the build's key, not compiled on their own
HEADERS = (Path(__file__).with_name("quant_tiles.h"),)
NAME = "specbus_few_rows"
#: rows served by the kernel; more rows (prefill chunks, big batches) go to torch, which packs
#: them well. Measured on SmolLM2-135M (`specbus bench forward`, one thread): the kernel leads
#: torch up to 24 rows (144 vs 149 ms a forward) and falls behind from 28 (164 vs 159 ms).
MAX_ROWS = 24
#: the environment switch that keeps torch's matmul everywhere (benchmarks compare both)
ENV = "SPECBUS_MATMUL"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c"]

_loaded: Any = None
_tried = False


def build_dir() -> Path:
    """Where this virtualenv's build lives: one per torch version and source text."""
    text = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(text + " ".join(_FLAGS).encode()).hexdigest()[:12]
    torch_version = torch.__version__.replace("+", "_")
    return Path(sys.prefix) / "share" / "specbus" / "kernels" / f"{NAME}-{torch_version}-{key}"


def _library(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def buildable() -> str | None:
    """Why the kernel cannot be used on this machine, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the few-row kernel is x86 AVX2 code; this is {platform.machine()}"
    return None


def build(verbose: bool = False) -> Path:
    """Compile the kernel into `build_dir()` (about 30 s; `make` does it once)."""
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    load(NAME, [str(path) for path in SOURCES], extra_cflags=_FLAGS, build_directory=str(directory),
         verbose=verbose)
    return _library(directory)


def load() -> Any:
    """The built kernel module, or None (why, said once in the log)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    why = unavailable()
    if why:
        log.info("verify matmul: torch's own (%s)", why)
        return None
    path = _library(build_dir())
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as exc:
        log.warning("verify matmul: torch's own (the few-row kernel at %s does not load: %s; "
                    "rebuild it with `make setup`)", path, exc)
        return None
    if not module.cpu_supported():
        log.info("verify matmul: torch's own (this CPU lacks AVX2/FMA)")
        return None
    _loaded = module
    log.info("verify matmul: few-row AVX2 kernel for 1-%d rows, torch's beyond", MAX_ROWS)
    return module


def unavailable() -> str | None:
    if os.environ.get(ENV, "").strip().lower() == "torch":
        return f"{ENV}=torch"
    why = buildable()
    if why:
        return why
    if not _library(build_dir()).exists():
        return "the few-row kernel is not built here: `make setup` builds it"
    return None


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward`, with 1..MAX_ROWS float32 rows sent to the kernel. The kernel has
    no backward: where autograd would record this product (grad mode on and the input or the
    weights requiring grad), torch's matmul serves, so training through the model still gets
    its gradients."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    graded = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
    if 0 < rows <= MAX_ROWS and x.dtype == torch.float32 and not graded:
        y = _loaded.linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return F.linear(x, self.weight, self.bias)


def installed(module: torch.nn.Module) -> bool:
    return getattr(module.forward, "__func__", None) is _forward


def install(model: torch.nn.Module) -> int:
    """Serve the model's float32 CPU linear layers with the kernel; returns how many (0 when
    the kernel is not available here).

    Each module keeps its class (`type(m) is nn.Linear` still holds, so copies quantize and
    convert as before: a deep copy carries the bound forward along); only its forward is
    rebound, on the instance."""
    if load() is None:
        return 0
    count = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
                and module.weight.device.type == "cpu"):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> int:
    """Give the model's linear layers torch's matmul back (benchmarks compare both)."""
    count = 0
    for module in model.modules():
        if installed(module):
            del module.forward
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nodes.backends.few_rows",
        description="Build the few-row verify matmul kernel into this virtualenv.")
    parser.add_argument("command", choices=["build", "where"])
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "where":
        print(_library(build_dir()))
        return 0
    why = buildable()
    if why:
        print(f"few-row kernel: not built ({why}); verify forwards use torch's matmul")
        return 0
    try:
        path = build(args.verbose)
    except Exception as exc:  # noqa: BLE001 - a failed optional build must not fail the setup
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"few-row kernel: NOT built ({first}); verify forwards use torch's matmul. "
              f"Rerun with -v to see the compiler's output.")
        return 0
    print(f"few-row kernel: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
