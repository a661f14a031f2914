"""The head's own KV cache: one decoder layer, a preallocated buffer, crop = a length.

The head holds one entry per committed position it has read (the verifier's feature there and
the next token) and, while drafting, the draft nodes after them; rolling back a draft is
cropping to the committed entries.
"""

from __future__ import annotations

import torch


class HeadCache:
    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256) -> None:
        self.k = torch.empty((kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [kv_heads, n, head_dim] keys/values; return all keys/values held."""
        n = k.shape[1]
        need = self.length + n
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            grown_k = self.k.new_empty((self.k.shape[0], cap, self.k.shape[2]))
            grown_v = torch.empty_like(grown_k)
            grown_k[:, : self.length] = self.k[:, : self.length]
            grown_v[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, self.length : need] = k
        self.v[:, self.length : need] = v
        self.length = need
        return self.k[:, :need], self.v[:, :need]

    def crop(self, length: int) -> None:
        """Forget entries from `length` on (draft nodes, or a rolled-back commit)."""
        self.length = max(0, min(self.length, length))
