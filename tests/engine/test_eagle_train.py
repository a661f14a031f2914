"""`specbus train-drafter` on the tiny verifier: the data pipeline, the loss going down, a
checkpoint in the published layout that loads and stays lossless, and resuming."""

from __future__ import annotations

import json

import torch

from nodes.cli import main
from nodes.drafters.registry import make_drafter
from nodes.engine import Engine, GenerationParams
from nodes.training import data as D
from nodes.training import train as T
from tests.engine.conftest import hf_greedy

LAYERS = (0, 1, 1)


def test_training_lowers_the_loss(tiny_torch):
    seqs = D.make_responses(tiny_torch, D.PROMPTS[:4], max_new=16, batch=4,
                            temperatures=(0.0,))
    assert len(seqs.tokens) == 4 and all(len(s) > 16 for s in seqs.tokens)
    ids = D.draft_vocab(seqs, 256, tiny_torch.vocab_size)
    assert len(ids) == 256 and bool((ids[1:] > ids[:-1]).all())
    examples = D.teacher_force(tiny_torch, seqs, LAYERS, ids)
    assert examples[0].features.shape == (len(seqs.tokens[0]), 3, 64)
    head = T.new_head(tiny_torch, ids, LAYERS)
    batch = T.Batch.of(examples, "cpu")
    with torch.no_grad():
        before, _ = T.losses(head, batch, 2)
    T.train_loop(head, examples, examples[:1], steps=30, ttt=2, batch_size=4, lr=3e-3,
                 max_seconds=600, device="cpu", report=lambda line: None)
    with torch.no_grad():
        after, _ = T.losses(head, batch, 2)
    assert float(after) < 0.8 * float(before)


def test_the_command_writes_a_loadable_head_and_resumes(tiny_folder, tiny_torch, prompt_ids,
                                                         tmp_path, capsys):
    out = tmp_path / "head"
    common = ["train-drafter", "--model", str(tiny_folder), "--out", str(out), "--prompts", "3",
              "--max-new", "12", "--temperatures", "0", "--draft-vocab", "256", "--batch", "2",
              "--save-every", "2", "--ttt", "2"]
    assert main([*common, "--steps", "4"]) == 0
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    meta = json.loads((out / "specbus_head.json").read_text())
    assert meta["training"]["steps"] == 4
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 256

    assert main([*common, "--steps", "6"]) == 0
    err = capsys.readouterr().err
    assert "data: reusing" in err and "resuming at step 4" in err
    assert json.loads((out / "specbus_head.json").read_text())["training"]["steps"] == 6

    drafter = make_drafter(f"eagle:{out}", tiny_torch)
    params = GenerationParams(max_tokens=24, eos_token_ids=frozenset({2}))
    gen = Engine(tiny_torch, drafter, fixed_k=4).generate(prompt_ids, params)
    assert gen.token_ids == hf_greedy(tiny_torch, prompt_ids, 24, 2)


def test_init_starts_from_a_head_with_its_draft_vocabulary(tiny_folder, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["train-drafter", "--model", str(tiny_folder), "--max-new", "8", "--temperatures",
              "0", "--draft-vocab", "256", "--batch", "2", "--save-every", "2", "--ttt", "2",
              "--steps", "2"]
    assert main([*common, "--out", str(first), "--prompts", "3"]) == 0
    assert main([*common, "--out", str(second), "--chat-prompts", "4", "--cycle-temperatures",
                 "--init", str(first)]) == 0
    assert f"starting from the head in {first}" in capsys.readouterr().err
    meta = json.loads((second / "specbus_head.json").read_text())
    assert meta["training"]["init"] == str(first)
    a = torch.load(first / ".train" / "data.pt", weights_only=False)["draft_ids"]
    b = torch.load(second / ".train" / "data.pt", weights_only=False)["draft_ids"]
    assert torch.equal(a, b)


def test_generation_resumes_after_the_batches_an_interrupted_run_saved(tiny_folder, tmp_path,
                                                                       capsys):
    """Every generation batch (tokens, hidden states, labels) is saved as it is made; a run
    stopped after the first batch goes on after it and ends with the same data."""
    out = tmp_path / "head"
    common = ["train-drafter", "--model", str(tiny_folder), "--out", str(out), "--prompts", "4",
              "--gen-batch", "2", "--max-new", "8", "--temperatures", "0", "--draft-vocab",
              "256", "--batch", "2", "--ttt", "1", "--steps", "1"]
    assert main(common) == 0
    shards = sorted((out / ".train" / "responses").glob("*.pt"))
    assert [f.name for f in shards] == ["0000000.pt", "0000002.pt"]
    whole = torch.load(out / ".train" / "data.pt", weights_only=False)
    (out / ".train" / "data.pt").unlink()  # as if stopped after the first batch
    shards[1].unlink()
    (out / ".train" / "state.pt").unlink()
    capsys.readouterr()
    assert main(common) == 0
    assert "data: resuming after 2 responses" in capsys.readouterr().err
    again = torch.load(out / ".train" / "data.pt", weights_only=False)
    for part in ("train", "held"):
        assert [e.tokens.tolist() for e in again[part]] == [e.tokens.tolist()
                                                             for e in whole[part]]
        for a, b in zip(again[part], whole[part], strict=True):
            assert torch.equal(a.features, b.features) and torch.equal(a.top_ids, b.top_ids)


def test_a_model_that_never_ends_its_turn_writes_no_prompts_and_says_so(tiny_folder, tmp_path,
                                                                        capsys):
    """The random tiny model never ends a user turn: --self-prompts stops with a clear error
    after a bounded number of batches instead of sampling forever."""
    out = tmp_path / "head"
    assert main(["train-drafter", "--model", str(tiny_folder), "--out", str(out),
                 "--self-prompts", "2", "--gen-batch", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "wrote no usable prompt in 4 batches of 2" in err


def test_extra_data_adds_an_earlier_runs_sequences_with_the_same_vocabulary(tiny_folder,
                                                                          tmp_path, capsys):
    first, second, other = tmp_path / "first", tmp_path / "second", tmp_path / "other"
    common = ["train-drafter", "--model", str(tiny_folder), "--max-new", "8", "--temperatures",
              "0", "--draft-vocab", "256", "--batch", "2", "--ttt", "1", "--steps", "1"]
    assert main([*common, "--out", str(first), "--prompts", "3"]) == 0
    earlier = torch.load(first / ".train" / "data.pt", weights_only=False)
    capsys.readouterr()
    assert main([*common, "--out", str(second), "--prompts", "2", "--init", str(first),
                 "--extra-data", str(first / ".train" / "data.pt")]) == 0
    err = capsys.readouterr().err
    assert (f"data: + {len(earlier['train'])} + {len(earlier['held'])} sequences from "
            f"{first / '.train' / 'data.pt'}") in err
    own = torch.load(second / ".train" / "data.pt", weights_only=False)
    total = len(own["train"]) + len(earlier["train"])
    assert json.loads((second / "specbus_head.json").read_text())["training"]["sequences"] == total
    # a run with another draft vocabulary refuses it
    assert main([*common, "--out", str(other), "--prompts", "2", "--draft-vocab", "128",
                 "--extra-data", str(first / ".train" / "data.pt")]) == 2
    assert "another draft vocabulary than this run's" in capsys.readouterr().err
