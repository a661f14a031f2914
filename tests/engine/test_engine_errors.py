"""Bad input gives a typed error (and the CLI one line on stderr, exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nodes.engine import (
    BadRequestError,
    Engine,
    GenerationParams,
    ModelNotFoundError,
    SamplingParams,
    TokenizerMismatchError,
)


def test_unknown_model_names_what_was_looked_for():
    from nodes import models

    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        models.resolve("no-such-model")
    with pytest.raises(ModelNotFoundError, match="nobody/nothing"):
        models.resolve("nobody/nothing")


def test_broken_model_folder(tmp_path):
    from nodes.backends.torch_backend import TorchBackend

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=str(tmp_path)):
        TorchBackend.load(str(tmp_path))


def test_empty_prompt_and_bad_limits(tiny_torch):
    engine = Engine(tiny_torch)
    with pytest.raises(BadRequestError):
        engine.generate([], GenerationParams(max_tokens=4))
    for n in (0, -3):
        with pytest.raises(BadRequestError):
            engine.generate([1, 2], GenerationParams(max_tokens=n))
    with pytest.raises(BadRequestError):
        engine.generate([1, 2], GenerationParams(sampling=SamplingParams(top_p=0.0)))
    with pytest.raises(BadRequestError):
        engine.generate([10**9], GenerationParams(max_tokens=4))


def test_tokenizer_mismatch(tiny_torch, tiny_folder, tmp_path):
    """A drafter whose vocabulary differs (one extra token) is refused."""
    import shutil

    from transformers import AutoTokenizer

    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.model import ModelDrafter

    for f in tiny_folder.iterdir():
        shutil.copy(f, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tiny_folder))
    tok.add_tokens(["<specbus-extra>"])
    tok.save_pretrained(str(tmp_path))
    other = TorchBackend.load(str(tmp_path), device="cpu")
    assert other.fingerprint != tiny_torch.fingerprint
    with pytest.raises(TokenizerMismatchError):
        Engine(tiny_torch, ModelDrafter(other))


def test_unknown_drafter_and_backend(tiny_torch):
    from nodes.backends.registry import load_backend
    from nodes.drafters.registry import make_drafter

    with pytest.raises(BadRequestError):
        make_drafter("telepathy", tiny_torch)
    with pytest.raises(BadRequestError):
        load_backend("tpu", "x")


def _cli(*args):
    code = "import sys; from nodes.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--local", "--prompt", "hi", "--model", "no-such-model"], "no-such-model"),
        (["--local", "--prompt", "  "], "empty prompt"),
        (["--local", "--prompt", "hi", "--max-tokens", "0"], "max tokens"),
    ],
)
def test_cli_bad_input_one_line_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_json_local(tiny_folder):
    import json

    r = _cli(
        "--local",
        "--prompt",
        "Hello there",
        "--model",
        str(tiny_folder),
        "--max-tokens",
        "6",
        "--json",
        "--drafter",
        "ngram",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in (
        "text",
        "token_ids",
        "tokens",
        "elapsed_s",
        "tok_per_s",
        "acceptance",
        "mean_accepted_len",
    ):
        assert key in out
    assert len(out["token_ids"]) == len(out["tokens"]) <= 6
