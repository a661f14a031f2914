"""Weight-only int8 linear layers (W8A32) on the few-row kernel: the int8 drafter's matmul.

Why: the int8 drafter used torch's dynamic quantisation, which also quantises each Linear's
*input* per call (per tensor). A few activation channels of SmolLM2 are huge outliers, so it
needed SmoothQuant smoothing first and still had to keep the 30 MLP down projections in fp32
(106 MB read a token), and agreed with the fp32 model ~90 % of the time. Here only the weights
are int8 (symmetric, one float32 scale per output channel); activations stay float32 and the
products are summed in float32 (`linear_w8` in few_rows.cpp: packed weights, AVX2/FMA, 1 row
as a prefetched stream, a few rows register-tiled). Activation outliers stop mattering, so
every Linear is int8, down projections and the LM head included, with no smoothing.

Where the kernel is not available (not built, not x86 AVX2/FMA, or `SPECBUS_MATMUL=torch`:
see few_rows.py) `available()` says why and callers keep torch's dynamic int8; a `W8Linear`
that exists anyway (or gets a float64 or grad-requiring input) dequantises its weights and
runs torch's matmul.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from nodes.backends import few_rows

log = logging.getLogger(__name__)

#: the int8 range used (symmetric: -127..127, so negation never overflows)
QMAX = 127


def available() -> str | None:
    """Why the weight-only int8 kernel cannot serve here, or None when it can."""
    why = few_rows.unavailable()
    if why:
        return why
    if few_rows.load() is None:
        return "the few-row kernel did not load (see the log)"
    return None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scale [N] float32), weight ~ q * s."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.contiguous()


def pack_w8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] in the kernel's layout [ceil(N/8), ceil(K/8), 8, 8]: groups of 8
    rows, each group's 8-column blocks one after another, a block the 8 rows' 8 bytes (zero
    padding to whole groups and blocks)."""
    n, k = q.shape
    padded = F.pad(q, (0, -k % 8, 0, -n % 8))
    groups, blocks = padded.shape[0] // 8, padded.shape[1] // 8
    return padded.view(groups, 8, blocks, 8).permute(0, 2, 1, 3).contiguous()


def unpack_w8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_w8`'s inverse: the int8 weights [n, k]."""
    groups, blocks = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(groups * 8, blocks * 8)[:n, :k]


class W8Linear(torch.nn.Module):
    """A Linear with int8 weights (per output channel scale) and float32 activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        q, scale = quantize_weight(weight)
        self.register_buffer("packed", pack_w8(q))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> W8Linear:
        return cls(linear.weight, linear.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights the int8 ones stand for: q * scale, [out, in]."""
        q = unpack_w8(self.packed, self.out_features, self.in_features)
        return q.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = few_rows.load()
        if (kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu"
                and not x.requires_grad and x.shape[-1] == self.in_features):
            rows = x.numel() // self.in_features if self.in_features else 0
            y = kernel.linear_w8(x.reshape(rows, self.in_features), self.packed, self.scale,
                                 self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        w = self.dequantized().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=int8 per channel")


def quantize_linears_w8(module: torch.nn.Module, skip: Iterable[str] = (), *,
                        force: bool = False) -> int:
    """Replace the float `nn.Linear` layers of `module` (in place) by `W8Linear`s, but those
    whose qualified name (as `named_modules` gives it) or last name part is in `skip`;
    returns how many. Converts nothing (returns 0; the log says why once) where the kernel is
    not available, so a caller can keep its own fallback; `force` converts anyway (tests)."""
    why = available()
    if why and not force:
        _say_unavailable(why)
        return 0
    skip = frozenset(skip)
    # `type(...) is`: a few-row-installed Linear qualifies (its class is kept), subclasses and
    # already quantised layers do not; the module itself cannot be replaced in place
    targets = [(name, child) for name, child in module.named_modules()
               if name and type(child) is torch.nn.Linear
               and name not in skip and name.rsplit(".", 1)[-1] not in skip
               and child.weight.device.type == "cpu" and child.weight.dtype.is_floating_point]
    for name, child in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, W8Linear.from_linear(child))
    return len(targets)


_said: set[str] = set()


def _say_unavailable(why: str) -> None:
    if why not in _said:
        _said.add(why)
        log.info("weight-only int8 kernel not available (%s): dynamic int8 instead", why)
