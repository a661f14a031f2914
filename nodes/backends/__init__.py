"""Model backends: one interface (`nodes.backends.base.Backend`), torch and mlx implementations.

Implementations import their framework lazily; use `load_backend` to pick one by name.
"""

from nodes.backends.base import Backend
from nodes.backends.registry import load_backend

__all__ = ["Backend", "load_backend"]
