"""The verifier's own model, dynamically quantised to int8, as drafter.

No second model to ship. Plain dynamic int8 (every Linear, per-tensor weights) agreed with the
fp32 model on only ~45% of greedy tokens of SmolLM2-135M: a few activation channels are huge
outliers and per-tensor input quantisation flattens the rest. So, for Llama-family models:
SmoothQuant-style smoothing first (nodes/drafters/smoothing.py), per-output-channel weights,
and the MLP down projections (whose inputs, act(gate) * up, carry the worst outliers) kept in
fp32 (fp16/bf16 copies of them were no faster here: 30 of them took 11/11/14.5 ms a token).
Measured teacher-forced on 10 prompts (1 thread, this CPU): ~90% agreement at ~0.6x the fp32
single-token cost (plain dynamic int8: 45-55%; smoothed with down_proj in int8 too: ~81%).
torch backend only (dynamic quantisation is a CPU torch feature).
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

from nodes.backends.base import Backend
from nodes.drafters.model import ModelDrafter
from nodes.drafters.smoothing import CALIBRATION_TEXTS, input_absmax, is_llama_like, smooth_
from nodes.engine.errors import BadRequestError

log = logging.getLogger(__name__)

KEPT_FP32 = "down_proj"  # the Linears a smoothed model keeps in fp32


def quantize_int8(model: Any, calibration: list[list[int]] | None = None):
    """An int8 copy of a torch model; the original is untouched.

    With `calibration` token batches and a Llama-family model, the copy is smoothed first and
    its down projections stay fp32; otherwise every Linear is quantised as it is.
    """
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        clone = copy.deepcopy(model).to("cpu").eval()
        smoothed = bool(calibration) and is_llama_like(clone)
        if smoothed:
            groups = smooth_(clone, input_absmax(clone, calibration))
            log.info("int8 drafter: smoothed %d activation groups before quantising", groups)
        spec = {
            name: per_channel_dynamic_qconfig
            for name, module in clone.named_modules()
            if isinstance(module, torch.nn.Linear)
            and not (smoothed and name.endswith("." + KEPT_FP32))
        }
        return quantize_dynamic(clone, spec, dtype=torch.qint8)


class Int8Drafter(ModelDrafter):
    @classmethod
    def from_verifier(cls, verifier: Backend) -> Int8Drafter:
        if verifier.name != "torch":
            raise BadRequestError(
                "the int8 drafter quantizes a torch model; "
                f"the verifier backend is {verifier.name!r}"
            )
        from nodes.backends.torch_backend import TorchBackend

        calibration = [verifier.tokenizer.encode(t, chat=True) for t in CALIBRATION_TEXTS]
        q = quantize_int8(verifier.model, calibration)
        backend = TorchBackend.from_model(q, verifier.tokenizer, f"{verifier.model_name}-int8")
        return cls(backend, name="int8")
