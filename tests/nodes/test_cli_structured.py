"""`specbus generate --json-schema FILE | --grammar FILE | --regex PATTERN`: a bad file or a
constraint that does not compile is refused before any model loads or anything is sent (exit 2,
the file and the reason named); a good one constrains the output, --local (tiny random Llama)
and through a cluster's verifier (the `generate_req.grammar` field), with the same tokens."""

from __future__ import annotations

import json
import re

import pytest

from tests.nodes.test_cli_generate import specbus, verifier_node  # noqa: F401 - fixture

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
LARK = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/\n'
CLUSTER_NOWHERE = ["--cluster", "nowhere", "--no-mdns", "--wait", "0.1"]


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "pet"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert obj["pet"] in ("cat", "dog")


@pytest.fixture
def files(tmp_path):
    def put(name: str, text: str | bytes | None) -> str:
        """A file `name` in tmp holding `text` (None: no such file)."""
        p = tmp_path / name
        if text is not None:
            (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
        return str(p)

    return put


@pytest.mark.parametrize("mode", [["--local"], CLUSTER_NOWHERE], ids=["local", "cluster"])
@pytest.mark.parametrize("flag, name, text, says", [
    ("--json-schema", "missing.json", None, "cannot read {path}: No such file"),
    ("--json-schema", "broken.json", "{nope", "{path} is not valid JSON"),
    ("--json-schema", "list.json", "[1, 2]", "{path}: a JSON schema is an object"),
    ("--json-schema", "typo.json", '{"type": "objectx"}',
     "{path}: json_schema does not compile: Invalid type: objectx"),
    ("--json-schema", "huge.json", json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(10_000)}}), "{path}: json_schema is"),
    ("--json-schema", "latin1.json", b'{"title": "caf\xe9"}', "{path} is not UTF-8"),
    ("--grammar", "bad.lark", "start: foo", '{path}: lark does not compile: at 1(8): unknown '
                                            'name: "foo"'),
    ("--grammar", "empty.lark", "  \n", "{path}: empty lark"),
    ("--regex", None, "(unclosed", "regex does not compile"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("--") else (
    v.split(".")[0] if isinstance(v, str) and "." in v else ""))
def test_bad_constraints_exit_2_naming_the_file_and_why(files, mode, flag, name, text, says):
    arg = text if name is None else files(name, text)
    out = specbus("--prompt", "hello", *mode, flag, arg, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"argument {flag}: " in out.stderr
    assert says.format(path=arg) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_one_constraint_at_a_time(files):
    out = specbus("--prompt", "hello", "--local", "--json-schema", files("s.json", "{}"),
                  "--regex", "a+", timeout=60)
    assert out.returncode == 2 and "not allowed with argument" in out.stderr


def _run(*flags: str) -> dict:
    out = specbus("--prompt", "Describe a person and their pet.", "--max-tokens", "48",
                  "--json", *flags, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_constrained_local_and_cluster_agree(files, tiny_folder, verifier_node):  # noqa: F811
    """The tiny model's output under each constraint is valid, and a cluster's verifier (same
    model, plain decoding) commits the same tokens as --local with ngram drafts."""
    seed = ["--cluster", "wire-cli", "--peer", verifier_node.server.endpoint, "--no-mdns",
            "--wait", "30"]
    local = ["--local", "--model", str(tiny_folder), "--weights", "fp32"]
    cases = [("--json-schema", files("person.json", json.dumps(SCHEMA)), check_person),
             ("--grammar", files("nums.lark", LARK),
              lambda t: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", t) or pytest.fail(t)),
             ("--regex", r"(yes|no), [0-9]{2,4} items?\.",
              lambda t: re.fullmatch(r"(yes|no), [0-9]{2,4} items?\.", t) or pytest.fail(t))]
    for flag, arg, check in cases:
        here = _run(*local, flag, arg)
        assert here["finish_reason"] == "eos", here
        check(here["text"])
        there = _run(*seed, flag, arg)
        assert there["token_ids"] == here["token_ids"], (flag, here["text"], there["text"])
    free = _run(*local)
    assert free["token_ids"] != here["token_ids"]  # the constraint did something


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from nodes import models
    from tests.engine.conftest import build_tiny

    folder = tmp_path_factory.mktemp("tiny_cli_structured")
    build_tiny(folder, models.resolve(models.DEFAULT_MODEL).path, seed=0)
    return folder
