"""Model references and the one-time atomic export."""

from __future__ import annotations

import pytest

from nodes import models


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECBUS_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECBUS_CACHE")
    assert models.cache_dir() == tmp_path / "x" / "specbus"


def test_killed_build_leaves_no_half_folder(tmp_path):
    target = tmp_path / "m"

    def build(tmp):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed mid-export

    with pytest.raises(KeyboardInterrupt):
        models.atomic_build(target, build)
    assert list(tmp_path.iterdir()) == []


def test_build_once(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"")

    target = tmp_path / "m"
    assert models.atomic_build(target, build) == target
    assert models.atomic_build(target, build) == target
    assert len(calls) == 1


def test_default_alias_resolves_to_exported_folder(smollm2_folder):
    assert (smollm2_folder / "model.safetensors").is_file()
    import json

    cfg = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in cfg


def test_local_folder(tiny_folder):
    assert models.resolve(str(tiny_folder)).path == tiny_folder.resolve()
