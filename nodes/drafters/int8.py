"""The verifier's own model, quantised to int8, as drafter.

No second model to ship. Two forms:

* **Weight-only int8** (W8A32; where the few-row kernel is built, nodes/backends/w8.py): every
  Linear, the MLP down projections and the LM head included, int8 weights with a float32 scale
  per output channel, float32 activations and sums. No smoothing: activations are never
  quantised, so their outlier channels do not matter. Measured on SmolLM2-135M (docs/engine.md,
  "The int8 drafter, weight-only"; 1 thread): greedy agreement with the fp32 model 0.977
  teacher-forced over 10 prompts (the dynamic form below: 0.900) at 15.7 ms a token (dynamic:
  27.9; the fp32 model: 51).
* **Dynamic int8** (the fallback where the kernel is not available: not built, not x86
  AVX2/FMA, or `SPECBUS_MATMUL=torch`; said once in the log). Plain dynamic int8 (every Linear,
  per-tensor weights) agreed with the fp32 model on only ~45% of greedy tokens of SmolLM2-135M:
  a few activation channels are huge outliers and per-tensor input quantisation flattens the
  rest. So, for Llama-family models: SmoothQuant-style smoothing first
  (nodes/drafters/smoothing.py), per-output-channel weights, and the MLP down projections
  (whose inputs, act(gate) * up, carry the worst outliers) kept in fp32 (fp16/bf16 copies of
  them were no faster here). Measured teacher-forced on 10 prompts (1 thread): ~90% agreement
  at ~0.6x the fp32 single-token cost (plain dynamic int8: 45-55%; smoothed with down_proj in
  int8 too: ~81%).

A plain Llama (the embedded model) drafts through a lean forward of the same weights
(nodes/backends/lean_llama.py); other models through their HF modules. torch backend only.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

from nodes.backends.base import Backend
from nodes.drafters.model import TREE_WIDTH, ModelDrafter
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
    """The verifier's model as an int8 drafting backend: weight-only int8 where the kernel is
    available, smoothed dynamic int8 otherwise; through the lean forward
    (nodes/backends/lean_llama.py) for a plain Llama, the HF modules otherwise."""
    from nodes.backends import w8
    from nodes.backends.lean_llama import LeanBackend, LeanLlama, lean_supported
    from nodes.backends.torch_backend import TorchBackend

    name = f"{verifier.model_name}-int8"
    why = w8.available()
    if why is None:
        clone = copy.deepcopy(verifier.model).to("cpu").eval()
        if lean_supported(clone):
            log.info("int8 drafter: weight-only int8 (every Linear), lean forward")
            return LeanBackend(LeanLlama(clone, weights="w8"), verifier.tokenizer, name)
        count = w8.quantize_linears_w8(clone)
        log.info("int8 drafter: weight-only int8 (%d Linears), HF modules (%s is not a plain "
                 "Llama)", count, getattr(clone.config, "model_type", "?"))
        return TorchBackend.from_model(clone, verifier.tokenizer, name)
    _say_fallback(why)
    clone, smoothed = _prepared_copy(verifier.model, calibration_batches(verifier.tokenizer))
    if smoothed and lean_supported(clone):
        return LeanBackend(LeanLlama(clone, weights="dynamic"), verifier.tokenizer, name)
    log.info("int8 drafter: %s is not a plain Llama, drafting through the HF modules",
             getattr(clone.config, "model_type", "?"))
    return TorchBackend.from_model(_quantize_modules(clone, smoothed), verifier.tokenizer, name)


_said: set[str] = set()


def _say_fallback(why: str) -> None:
    if why not in _said:
        _said.add(why)
        log.info("int8 drafter: dynamic int8 (smoothed, down projections fp32): the weight-only "
                 "int8 kernel is not available (%s)", why)


class Int8Drafter(ModelDrafter):
    @classmethod
    def from_verifier(cls, verifier: Backend) -> Int8Drafter:
        if verifier.name != "torch":
            raise BadRequestError(
                "the int8 drafter quantizes a torch model; "
                f"the verifier backend is {verifier.name!r}"
            )
        # Weight-only int8 agrees with the verifier on ~0.98 of greedy tokens, so its
        # likeliest chain is nearly always the one: trees only add drafter and verify rows
        # (in process, open-ended: chains 1.74x plain, trees 0.86x; docs/engine.md). Dynamic
        # int8 (~0.90) keeps its trees.
        from nodes.backends import w8

        width = 1 if w8.available() is None else TREE_WIDTH
        return cls(int8_backend(verifier), name="int8", tree_width=width)
