"""The verifier's own model, dynamically quantised to int8, as drafter.

No second model to ship. Plain dynamic int8 (every Linear, per-tensor weights) agreed with the
fp32 model on only ~45% of greedy tokens of SmolLM2-135M: a few activation channels are huge
outliers and per-tensor input quantisation flattens the rest. So, for Llama-family models:
SmoothQuant-style smoothing first (nodes/drafters/smoothing.py), per-output-channel weights,
and the MLP down projections (whose inputs, act(gate) * up, carry the worst outliers) kept in
fp32 (fp16/bf16 copies of them were no faster here: 30 of them took 11/11/14.5 ms a token).
Measured teacher-forced on 10 prompts (1 thread, this CPU): ~90% agreement at ~0.6x the fp32
single-token cost (plain dynamic int8: 45-55%; smoothed with down_proj in int8 too: ~81%).
A plain Llama (the embedded model) then drafts through a lean forward of the same weights
(nodes/drafters/lean_llama.py: ~0.75x the HF int8 copy's token time, same logits).
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
    """An int8 copy of a torch model (HF modules); the original is untouched.

    With `calibration` token batches and a Llama-family model, the copy is smoothed first and
    its down projections stay fp32; otherwise every Linear is quantised as it is.
    """
    clone, smoothed = _prepared_copy(model, calibration)
    return _quantize_modules(clone, smoothed)


def calibration_batches(tokenizer) -> list[list[int]]:
    """The built-in calibration texts as the chat-formatted token batches smoothing reads."""
    return [tokenizer.encode(t, chat=True) for t in CALIBRATION_TEXTS]


def _prepared_copy(model: Any, calibration: list[list[int]] | None) -> tuple[Any, bool]:
    """An fp32 CPU copy, smoothed when it can be; whether it was."""
    clone = copy.deepcopy(model).to("cpu").eval()
    smoothed = bool(calibration) and is_llama_like(clone)
    if smoothed:
        groups = smooth_(clone, input_absmax(clone, calibration))
        log.info("int8 drafter: smoothed %d activation groups before quantising", groups)
    return clone, smoothed


def _quantize_modules(clone: Any, smoothed: bool) -> Any:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        spec = {
            name: per_channel_dynamic_qconfig
            for name, module in clone.named_modules()
            if isinstance(module, torch.nn.Linear)
            and not (smoothed and name.endswith("." + KEPT_FP32))
        }
        return quantize_dynamic(clone, spec, dtype=torch.qint8)


def int8_backend(verifier: Backend) -> Backend:
    """The verifier's model as an int8 drafting backend: the lean forward
    (nodes/drafters/lean_llama.py) for a plain smoothed Llama, the HF modules otherwise."""
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.lean_llama import LeanBackend, LeanLlama, lean_supported

    clone, smoothed = _prepared_copy(verifier.model, calibration_batches(verifier.tokenizer))
    name = f"{verifier.model_name}-int8"
    if smoothed and lean_supported(clone):
        return LeanBackend(LeanLlama(clone), verifier.tokenizer, name)
    log.info("int8 drafter: %s is not a plain Llama, drafting through the HF modules",
             getattr(clone.config, "model_type", "?"))
    return TorchBackend.from_model(_quantize_modules(clone, smoothed), verifier.tokenizer, name)


class Int8Drafter(ModelDrafter):
    @classmethod
    def from_verifier(cls, verifier: Backend) -> Int8Drafter:
        if verifier.name != "torch":
            raise BadRequestError(
                "the int8 drafter quantizes a torch model; "
                f"the verifier backend is {verifier.name!r}"
            )
        return cls(int8_backend(verifier), name="int8")
