"""Model backends: one interface (`nodes.backends.base.Backend`), torch and mlx implementations.

Implementations import their framework lazily; use `load_backend` to pick one by name.
"""

from nodes.backends.base import Backend, load_backend

__all__ = ["Backend", "load_backend"]
