"""Every Backend op through a real 2-process gloo pipeline equals the whole model's, on a tiny
random Llama with the real tokenizer: forward, last-row forward, token-tree forward, compact
and crop apply on both stages in step."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tools.local_cluster import ROOT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nodes import models

    ref = models.resolve(None)
    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ref.path / name).read_bytes())
    return folder


def test_ops_match_whole_model(tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    import os

    cmd = [sys.executable, "-m", "tests.shard.pipeline_worker", str(tiny)]
    procs = [subprocess.Popen([*cmd, str(r), str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert json.loads(outs[0][0].strip().splitlines()[-1]) == {"equal": [True] * 6}
