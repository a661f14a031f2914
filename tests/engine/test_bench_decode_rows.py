"""Every torch row of `specbus bench decode --local` builds and decodes what plain greedy does.

The bench skips a row whose set-up raises (so one broken backend does not sink the table); this
test is what notices a row that would be skipped (the HF assistant row once was, when the int8
drafter stopped being an HF model).
"""

from __future__ import annotations

import argparse

from tools.bench_decode import _configs


def test_every_torch_row_of_the_local_decode_bench_runs_and_agrees(tiny_folder, prompt_ids):
    args = argparse.Namespace(model=str(tiny_folder), no_mlx=True, quick=False)
    outputs = {}
    for name, backend, factory in _configs(args):
        assert backend == "torch"
        outputs[name] = factory()(prompt_ids, 12).token_ids
    assert {"hf-plain", "hf-prompt-lookup", "hf-assisted-int8", "engine-int8-tree"} <= set(outputs)
    reference = outputs["hf-plain"]
    assert len(reference) == 12
    assert {name: out for name, out in outputs.items() if out != reference} == {}
