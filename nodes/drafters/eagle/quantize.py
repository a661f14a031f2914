"""int8 weights for a head drafting on a CPU: the same head at a quarter of the bytes.

A head step on one CPU core is memory bound (reading ~40 MB of fp32 weights, the draft
vocabulary's LM head half of it), so int8 weights make it several times faster.

Preferred: weight-only int8 (`nodes/backends/w8.py`: int8 weights with a float32 scale per
output channel, float32 activations and sums, the few-row kernel's `linear_w8`), for every
linear layer, `fc` included. Fallback, where that kernel is not available: torch's dynamic
quantization (fbgemm; activations quantized per call), all but `fc`: `fc` reads the
verifier's hidden states, whose outlier channels a per-tensor activation scale crushes
(quantized that way, the SmolLM2 head's top-1 fell from 0.34 to 0.10). Weight-only int8 never
quantizes activations, so `fc` is safe there. Output stays lossless whatever the head says:
the verifier decides, and sampled drafts carry the quantized head's own probabilities.
"""

from __future__ import annotations

import warnings

import torch

from nodes.backends.w8 import quantize_linears_w8
from nodes.drafters.eagle.head import Eagle3Head

#: linear layers the dynamic-int8 fallback keeps in fp32 (see the module docstring)
KEPT_FP32 = frozenset({"fc"})


def quantize_head(head: Eagle3Head) -> Eagle3Head:
    """`head` with int8 linear layers, in place (the shared embedding is not copied); CPU
    only. Weight-only int8 for all of them where the kernel serves, else dynamic int8 for all
    but `fc`."""
    if quantize_linears_w8(head):
        return head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        spec = {name: per_channel_dynamic_qconfig for name, module in head.named_modules()
                if isinstance(module, torch.nn.Linear) and name not in KEPT_FP32}
        return quantize_dynamic(head, spec, dtype=torch.qint8, inplace=True)
