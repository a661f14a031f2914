"""tools.random_llama builds a model folder that loads as a whole model and as pipeline stages
(from several safetensors files), with the embedded model's tokenizer."""

from __future__ import annotations

import json

import pytest


def test_random_llama_loads_whole_and_as_stages(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nodes import models
    from nodes.shard.layout import split_layers
    from nodes.shard.stage import StageModel
    from tools.random_llama import main

    out = tmp_path / "rand"
    assert main([str(out), "--hidden", "64", "--intermediate", "128", "--layers", "4",
                 "--heads", "4", "--kv-heads", "2", "--max-shard-size", "5MB"]) == 0
    assert len(list(out.glob("*.safetensors"))) >= 2  # the stage loader reads every file
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["tie_word_embeddings"]) == (
        64, 4, False)
    ref = models.resolve(None)
    assert models.resolve(str(out)).path == out.resolve()
    text = "Copy this: the meeting is on Tuesday."
    assert (AutoTokenizer.from_pretrained(out)(text).input_ids
            == AutoTokenizer.from_pretrained(ref.path)(text).input_ids)

    whole = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = [1, 42, 7, 900, 3]
    with torch.inference_mode():
        want = whole(torch.tensor([ids])).logits[0]
    first = StageModel(out, split_layers(4, 2, 0))
    last = StageModel(out, split_layers(4, 2, 1))
    assert first.param_bytes + last.param_bytes == sum(
        p.numel() * 4 for p in whole.parameters())  # untied: nothing held twice
    hidden = first.layers(first.embed(ids), first.new_cache())
    got = last.head(last.layers(hidden, last.new_cache()), last_only=False)
    assert torch.allclose(got.reshape(want.shape), want, atol=1e-4)


def test_random_llama_refuses_an_existing_folder(tmp_path, capsys):
    from tools.random_llama import main

    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path)])
    assert exc.value.code == 2
    assert "exists" in capsys.readouterr().err
