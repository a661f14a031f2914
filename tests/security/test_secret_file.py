"""The cluster secret file: keygen writes 0600 and never overwrites; every bad file (missing,
too open, not a file, malformed, unreadable) and missing CURVE support is a clear error, at the
library and at `specbus node` start (before any model is loaded)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from bus import security
from bus.security import SecretError, Security, read_secret_file, write_secret_file

ROOT = Path(__file__).resolve().parents[2]


def keygen(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodes.cli", "keygen", "--out", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_keygen_writes_a_fresh_0600_secret_and_never_overwrites(tmp_path):
    a, b = tmp_path / "a.key", tmp_path / "b.key"
    old = os.umask(0)  # even with a permissive umask
    try:
        assert keygen(a).returncode == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(a.stat().st_mode) == 0o600
    write_secret_file(b)
    assert read_secret_file(a) != read_secret_file(b)  # fresh each time
    before = a.read_bytes()
    again = keygen(a)
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr
    assert a.read_bytes() == before


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_secret_readable_by_group_or_others_is_refused(tmp_path, mode):
    p = write_secret_file(tmp_path / "s.key")
    p.chmod(mode)
    with pytest.raises(SecretError, match=r"readable by group or others.*chmod 600"):
        read_secret_file(p)


def test_missing_directory_and_malformed_secrets_are_refused(tmp_path):
    with pytest.raises(SecretError, match="does not exist.*specbus keygen"):
        read_secret_file(tmp_path / "nope.key")
    with pytest.raises(SecretError, match="not a regular file"):
        read_secret_file(tmp_path)
    bad = tmp_path / "bad.key"
    for text, match in (("hello\n", "not a specbus secret"),
                        ("specbus-secret-v1:zz\n", "not hexadecimal"),
                        ("specbus-secret-v1:abcd\n", "has 2 bytes")):
        bad.write_text(text)
        bad.chmod(0o600)
        with pytest.raises(SecretError, match=match):
            read_secret_file(bad)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_secret_is_refused(tmp_path):
    p = write_secret_file(tmp_path / "s.key")
    p.chmod(0o000)
    with pytest.raises(SecretError, match="not readable"):
        read_secret_file(p)


def test_missing_curve_support_is_a_clear_error(tmp_path, monkeypatch):
    p = write_secret_file(tmp_path / "s.key")
    monkeypatch.setattr(zmq, "has", lambda what: False)
    with pytest.raises(SecretError, match="no CURVE support"):
        Security.from_file(p)


def test_derived_keys_are_distinct_and_stable(tmp_path):
    p = write_secret_file(tmp_path / "s.key")
    a, b = Security.from_file(p), Security.from_file(p)
    assert a == b
    assert len({a.server_public, a.client_public, a.server_secret, a.client_secret}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert security.hkdf_sha256(b"k", b"x") != security.hkdf_sha256(b"k", b"y")


@pytest.mark.parametrize("setup, match", [
    ("missing", "does not exist"),
    ("open", "readable by group or others"),
    ("malformed", "not a specbus secret"),
])
def test_specbus_node_refuses_a_bad_secret_at_start(tmp_path, setup, match):
    p = tmp_path / "s.key"
    if setup != "missing":
        write_secret_file(p)
    if setup == "open":
        p.chmod(0o644)
    if setup == "malformed":
        p.write_text("garbage\n")
    env = {**os.environ, "SPECBUS_SECRET_FILE": str(p)}  # the variable works like the flag
    out = subprocess.run([sys.executable, "-m", "nodes", "--role", "proposer", "--no-mdns",
                          "--drafter", "ngram"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=env)
    assert out.returncode == 2
    assert match in out.stderr and "Traceback" not in out.stderr
