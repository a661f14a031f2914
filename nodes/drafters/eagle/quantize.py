"""int8 weights for a head drafting on a CPU: the same head at a quarter of the bytes.

A head step on one CPU core is memory bound (reading ~40 MB of fp32 weights, the draft
vocabulary's LM head half of it), so int8 weights (per output channel, activations quantized
per call: torch's dynamic quantization, fbgemm kernels that also stay fast for the few rows of
a tree level) make it ~4x faster. `fc` stays fp32: it reads the verifier's hidden states,
whose outlier channels a per-tensor activation scale would crush (quantized, the SmolLM2
head's top-1 fell from 0.34 to 0.10; without `fc` it is unchanged). Output stays lossless
whatever the head says: the verifier decides, and sampled drafts carry the quantized head's
own probabilities.
"""

from __future__ import annotations

import warnings

import torch

from nodes.drafters.eagle.head import Eagle3Head

#: linear layers kept in fp32 (see the module docstring)
KEPT_FP32 = frozenset({"fc"})


def quantize_head(head: Eagle3Head) -> Eagle3Head:
    """`head` with int8 linear layers but `fc`, in place (the shared embedding is not
    copied); CPU only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        spec = {name: per_channel_dynamic_qconfig for name, module in head.named_modules()
                if isinstance(module, torch.nn.Linear) and name not in KEPT_FP32}
        return quantize_dynamic(head, spec, dtype=torch.qint8, inplace=True)
