"""`specbus generate` answers bad values with the field's name and exit status 2: the CLI's own
checks (the same typed parse as the wire) and the verifier's answer through a real node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodes.engine.core import Engine
from nodes.node import Node, NodeConfig
from nodes.verifier.role import VerifierRole

ROOT = Path(__file__).resolve().parents[2]


def specbus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nodes.cli", "generate", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, field", [
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.01"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--top-k", "-2"], "top_k"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--seed", "-1"], "seed"),
    (["--stop", ""], "stop[0]"),
    (["--force-draft"], "proposers"),
])
@pytest.mark.parametrize("mode", [["--cluster", "nowhere", "--no-mdns", "--wait", "0.1"],
                                  ["--local"]], ids=["cluster", "local"])
def test_bad_values_exit_2_naming_the_field_before_any_work(flags, field, mode):
    out = specbus("--prompt", "hello", *mode, *flags)
    assert out.returncode == 2, out.stderr
    assert "bad_request" in out.stderr and field in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.fixture
def verifier_node(tmp_path, tiny_backend):
    node = Node(NodeConfig(cluster="wire-cli", roles=("verifier",), interface="127.0.0.1",
                           mdns=False, state_dir=tmp_path, name="tiny-verifier"))
    role = VerifierRole(Engine(tiny_backend, None, max_draft=4))
    node.start()
    role.attach(node)
    yield node
    role.close()
    node.stop()


def test_the_verifiers_refusal_reaches_the_cli_and_the_next_request_is_served(verifier_node):
    seed = ["--cluster", "wire-cli", "--peer", verifier_node.server.endpoint, "--no-mdns",
            "--wait", "30"]
    out = specbus("--prompt", "word " * 2000, "--no-chat", "--max-tokens", "4", *seed)
    assert out.returncode == 2, out.stderr
    assert "too_long" in out.stderr and "prompt" in out.stderr
    # --system travels as chat messages, rendered by the verifier's chat template
    out = specbus("--prompt", "Hello there", "--system", "Be brief.", "--max-tokens", "4",
                  "--json", *seed)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 4 and result["prompt_tokens"] > 5


@pytest.mark.parametrize("flags", [["--model", "/nope"], ["--drafter", "int8"],
                                   ["--backend", "mlx"], ["--max-draft", "4"]])
def test_local_only_flags_in_cluster_mode_are_an_error(flags):
    out = specbus("--prompt", "hello", "--cluster", "nowhere", "--no-mdns", "--wait", "0.1",
                  *flags)
    assert out.returncode == 2, out.stderr
    assert f"{flags[0]} only apply with --local" in out.stderr and "Traceback" not in out.stderr


def test_messages_file_is_checked_and_sent_as_a_conversation(tmp_path, verifier_node,
                                                             tiny_backend):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "wizard", "content": "hi"}]))
    out = specbus("--messages", str(bad), "--cluster", "nowhere", "--no-mdns")
    assert out.returncode == 2 and "role" in out.stderr and "Traceback" not in out.stderr
    chat = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"}]
    good = tmp_path / "chat.json"
    good.write_text(json.dumps(chat))
    out = specbus("--messages", str(good), "--cluster", "wire-cli", "--no-mdns", "--peer",
                  verifier_node.server.endpoint, "--wait", "30", "--max-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # the whole conversation went, rendered by the verifier's chat template
    assert result["prompt_tokens"] == len(tiny_backend.tokenizer.encode_messages(chat))
    assert len(result["token_ids"]) == 4


def test_a_node_checks_its_addresses_before_loading_a_model():
    """A bad --interface or a taken --port is refused first: with a model that does not exist,
    the error is still about the address (the model was never looked at)."""
    import socket

    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def node(*flags):
        return subprocess.run([sys.executable, "-m", "nodes.cli", "node", "--role", "verifier",
                               "--no-mdns", "--model", "/no/such/model", *flags], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)

    out = node("--interface", "no-such-if0")
    assert out.returncode == 2 and "no such interface" in out.stderr, out.stderr
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        out = node("--port", str(taken.getsockname()[1]))
    finally:
        taken.close()
    assert out.returncode == 2 and "cannot use port" in out.stderr, out.stderr
    assert "/no/such/model" not in out.stderr
