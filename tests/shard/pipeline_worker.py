"""One rank of a 2-stage pipeline over a tiny random Llama (run by test_pipeline_ops.py).

Rank 0 drives forward, tree forward, compact and crop through `ShardedBackend` and the same
calls on the whole model (`TorchBackend`), and prints whether every logits array is equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    folder, rank, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    from nodes.shard.layout import split_layers
    from nodes.shard.pipeline import Link, ShardedBackend, close_group, follow, init_group
    from nodes.shard.stage import StageModel

    stage = StageModel(folder, split_layers(4, 2, rank))
    init_group("127.0.0.1", port, rank, 2, 30)
    try:
        if rank == 1:
            follow(stage, Link(30, stage.full_config.hidden_size, stage.full_config.vocab_size))
            return
        from transformers import AutoModelForCausalLM

        from nodes.backends.tokenizer import Tokenizer
        from nodes.backends.torch_backend import TorchBackend

        tok = Tokenizer(folder)
        whole = TorchBackend.from_model(
            AutoModelForCausalLM.from_pretrained(str(folder)), tok, "tiny")
        sharded = ShardedBackend(stage, tok, "tiny", timeout_s=30)
        checks = []
        for b in (whole, sharded):
            c = b.new_cache()
            out = [b.forward_last(c, [5, 6, 7, 8, 9])[None], b.forward(c, [10, 11])]
            base = b.cache_length(c)
            out.append(b.forward_tree(c, [12, 13, 14, 15], [-1, 0, 0, 2]))
            b.compact(c, base, [0, 2, 3])
            out.append(b.forward(c, [16]))
            b.crop(c, base + 1)
            out.append(b.forward(c, [17, 18]))
            out.append(np.array([b.cache_length(c)], dtype=np.float32))
            checks.append(out)
        equal = [bool(np.array_equal(a, s)) for a, s in zip(*checks, strict=True)]
        sharded.close()
        print(json.dumps({"equal": equal}))
    finally:
        close_group()


if __name__ == "__main__":
    main()
