"""One decode run's result, and Hugging Face `generate` as a runner beside ours.

Shared by the in-process decode bench (tools/bench_decode.py) and the bus one
(tools/bench_decode_bus.py), which measure HF greedy and HF prompt lookup on the same prompts
and token counts as their own rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Run:
    token_ids: list[int]
    elapsed_s: float
    acceptance: float | None = None
    mean_accepted_len: float | None = None


def hf_runner(backend, **gen_kwargs) -> Callable[[list[int], int], Run]:
    import torch

    model = backend.model

    def run(ids: list[int], n: int) -> Run:
        x = torch.tensor([ids], device=backend.device)  # prompt lookup builds on its device
        t0 = time.perf_counter()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=backend.tokenizer.hf.eos_token_id,
            pad_token_id=backend.tokenizer.hf.eos_token_id,
            top_k=None,
            top_p=None,
            temperature=None,
            **gen_kwargs,
        )
        dt = time.perf_counter() - t0
        return Run(out[0, len(ids) :].tolist(), dt)

    return run
