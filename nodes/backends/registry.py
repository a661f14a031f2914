"""`load_backend`: a backend by name. Each implementation, and its framework, is imported only
when asked for (kept apart from `base`, which every implementation imports)."""

from __future__ import annotations

from typing import Any

from nodes.backends.base import BACKENDS, Backend
from nodes.engine.errors import BadRequestError


def load_backend(name: str, model_ref: str | None = None, **kwargs: Any) -> Backend:
    """Load `model_ref` (alias, folder or cached HF repo id) on backend `name`."""
    if name == "torch":
        from nodes.backends.torch_backend import TorchBackend

        return TorchBackend.load(model_ref, **kwargs)
    if name == "mlx":
        from nodes.backends.mlx_backend import MlxBackend

        if kwargs.pop("weights", "fp32") != "fp32":
            raise BadRequestError("--weights q8|q4 is the torch backend's CPU forward; the mlx "
                                  "backend takes the model's own weights")
        return MlxBackend.load(model_ref, **kwargs)
    raise BadRequestError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
