"""The verifier's own model, dynamically quantised to int8 on its Linear layers, as drafter.

No second model to ship: on CPU the int8 copy runs ~3x faster than fp32 and agrees with it on
50-80% of tokens. torch backend only (dynamic quantisation is a CPU torch feature).
"""

from __future__ import annotations

import copy
import logging
import warnings

from nodes.backends.base import Backend
from nodes.drafters.model import ModelDrafter
from nodes.engine.errors import BadRequestError

log = logging.getLogger(__name__)


def quantize_int8(model):
    """A dynamic-int8 copy of a torch model (Linear layers only); the original is untouched."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        from torch.ao.quantization import quantize_dynamic

        clone = copy.deepcopy(model).to("cpu")
        return quantize_dynamic(clone, {torch.nn.Linear}, dtype=torch.qint8)


class Int8Drafter(ModelDrafter):
    @classmethod
    def from_verifier(cls, verifier: Backend) -> Int8Drafter:
        if verifier.name != "torch":
            raise BadRequestError(
                "the int8 drafter quantizes a torch model; "
                f"the verifier backend is {verifier.name!r}"
            )
        from nodes.backends.torch_backend import TorchBackend

        q = quantize_int8(verifier.model)
        backend = TorchBackend.from_model(q, verifier.tokenizer, f"{verifier.model_name}-int8")
        return cls(backend, name="int8")
