"""What a model is called on the cluster (issue 22): `--served-name`, else a clean name; and a
name from another machine's card never picks a folder of this one."""

from __future__ import annotations

import pytest

from nodes import models
from nodes.client_tokenizers import TokenizerCache


def test_served_names_are_names_not_paths(tmp_path, smollm2_folder, monkeypatch):
    assert models.served_name("smollm2-135m") == "smollm2-135m"
    assert models.served_name("org/some-repo") == "org/some-repo"
    folder = tmp_path / "my-smol"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert models.served_name("./my-smol") == "my-smol"
    assert models.served_name(str(folder)) == "my-smol"


def test_a_peers_model_name_never_resolves_to_a_local_folder(tmp_path, smollm2_folder,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-smol").symlink_to(smollm2_folder)  # a real model folder, by that name
    assert models.resolve("my-smol").path == smollm2_folder.resolve()  # `--model` on this host
    with pytest.raises(models.ModelNotFoundError, match="not looked up"):
        models.resolve("my-smol", paths=False)
    assert TokenizerCache().get("smollm2-135m", "x") is None  # the alias loads; wrong print
    assert TokenizerCache().get("my-smol", "anything") is None  # never read from this disk
