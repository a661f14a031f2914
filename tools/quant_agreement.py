"""`python -m tools.quant_agreement`: how often the quantized verifier's greedy token is fp32's.

Issue 43 asks the quantized forward's agreement with the fp32 reference to be reported. For
each of tools/prompts.py's first 6 prompts, fp32 greedy decodes `--tokens` tokens (the
engine's plain decoding, EOS ignored); each quantized form then reads prompt + that
continuation teacher-forced in one forward (rows are independent: the same logits as decoding
them one by one), and its argmax at every position is compared with fp32's token. Prints the
share that agree and, per prompt, how many leading tokens its own greedy decoding would share
with fp32's (the first disagreement).
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--weights", default="q4,q8", help="quantized forms, comma-separated")
    args = parser.parse_args(argv)
    import torch

    from nodes.backends.torch_backend import TorchBackend
    from nodes.engine import Engine, GenerationParams
    from tools.prompts import PROMPTS

    torch.set_num_threads(1)
    ref = TorchBackend.load(None, device="cpu", weights="fp32")
    engine = Engine(ref, None)
    params = GenerationParams(max_tokens=args.tokens, eos_token_ids=frozenset())
    runs = []
    for _, text in PROMPTS[:6]:
        ids = ref.tokenizer.encode(text)
        runs.append((ids, engine.generate(ids, params).token_ids))
    for form in args.weights.split(","):
        b = TorchBackend.load(None, device="cpu", weights=form)
        agree = total = 0
        prefixes = []
        for ids, out in runs:
            cache = b.new_cache()
            b.forward(cache, ids[:-1])
            rows = np.asarray(b.forward(cache, [ids[-1], *out[:-1]]))
            same = rows.argmax(-1) == np.asarray(out)
            agree, total = agree + int(same.sum()), total + len(out)
            prefixes.append(int(np.argmin(same)) if not same.all() else len(out))
        print(f"{form}: agreement {agree / total:.3f} over {total} tokens; identical greedy "
              f"prefixes {prefixes} of {args.tokens}")


if __name__ == "__main__":
    main()
