"""docs/protocol.md stays true: it names every message type and every error code."""

from pathlib import Path

from codec.errors import ERROR_CODES
from codec.schema import SCHEMAS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def test_every_message_type_is_documented():
    missing = [t for t in SCHEMAS if f"| `{t}` |" not in DOC]
    assert not missing, f"docs/protocol.md lacks rows for {missing}"


def test_every_error_code_is_documented():
    missing = [c for c in ERROR_CODES if f"| `{c}` |" not in DOC]
    assert not missing, f"docs/protocol.md lacks error codes {missing}"
