"""The verifier's weight forms (`--weights`) and the default, declared once, importable
without torch (the CLI parses flags before it loads anything)."""

from __future__ import annotations

import os

#: fp32 is the reference mode (identical to Hugging Face generate); q8 / q4 quantize at load
#: (the embedded model's q4 is its shipped Q4_1 file); file serves a GGUF model's own blocks as
#: they are (nodes/backends/quant_forward.py)
WEIGHTS = ("fp32", "q8", "q4", "file")
#: the default: a GGUF model's own blocks on a CPU where the quantized forward serves it (the
#: embedded model's shipped Q4_1 file, a --model FILE.gguf), fp32 everywhere else (a folder
#: model keeps the reference mode: quantizing it is the user's choice, q8 / q4)
AUTO = "auto"
CHOICES = (*WEIGHTS, AUTO)
#: the environment's default for --weights (the test suite pins fp32: its cluster tests
#: compare with Hugging Face)
ENV = "SPECBUS_WEIGHTS"


def default_weights(bounded: bool = False) -> str:
    """`--weights` when not given: $SPECBUS_WEIGHTS, else auto; with a bounded K/V
    (`--kv-sink/--kv-window`), auto means fp32: the quantized forward does not serve a bound
    (it writes each position at its own cache row)."""
    chosen = os.environ.get(ENV, "").strip().lower() or AUTO
    return "fp32" if bounded and chosen == AUTO else chosen
