"""`python -m tools.random_llama OUT`: a randomly initialised Llama, bigger than the embedded
model, with the embedded model's tokenizer, saved as a model folder.

Why: the embedded SmolLM2-135M is smaller than what a process costs before any weight (torch,
transformers, the node), so it cannot show what sharding saves. `specbus bench shard --model OUT`
measures memory per stage on this one instead (its text is noise; the greedy tokens are still
compared with the unsharded verifier's). Defaults: hidden 1536, 24 layers, untied embeddings,
755M parameters, 3.0 GB in float32.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.random_llama", description=__doc__)
    parser.add_argument("out", type=Path, help="folder to create (must not exist)")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="2GB",
                        help="largest safetensors file (bigger models are split in several)")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists; pick a new folder")
    if args.hidden % args.heads or args.heads % args.kv_heads or min(
            args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads) < 1:
        parser.error("need positive sizes, hidden divisible by heads, heads by kv-heads")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nodes.models import resolve

    src = resolve(None).path
    cfg = LlamaConfig.from_pretrained(src)
    cfg.hidden_size, cfg.intermediate_size = args.hidden, args.intermediate
    cfg.num_hidden_layers, cfg.num_attention_heads = args.layers, args.heads
    cfg.num_key_value_heads, cfg.head_dim = args.kv_heads, args.hidden // args.heads
    cfg.tie_word_embeddings = False
    torch.manual_seed(args.seed)
    print(f"random_llama: building {args.layers} layers x {args.hidden} ...", file=sys.stderr,
          flush=True)
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    print(f"random_llama: {n / 1e6:.0f}M parameters, saving to {args.out} ...", file=sys.stderr,
          flush=True)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",
                                                         "generation_config.json"):
            shutil.copy(f, args.out / f.name)
    print(f"random_llama: done ({args.out})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
