"""docs/protocol.md stays true: it names every message type, codec error code and node code."""

from pathlib import Path

from codec.errors import ERROR_CODES
from codec.messages import SCHEMAS
from codec.structs import STRUCTS
from nodes.engine.errors import NODE_ERROR_CODES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def test_every_message_type_is_documented():
    missing = [t for t in SCHEMAS if f"| `{t}` |" not in DOC]
    assert not missing, f"docs/protocol.md lacks rows for {missing}"


def test_every_error_code_is_documented():
    missing = [c for c in ERROR_CODES if f"| `{c}` |" not in DOC]
    assert not missing, f"docs/protocol.md lacks error codes {missing}"


def test_every_node_error_code_is_documented():
    missing = [c for c in NODE_ERROR_CODES if f"| `{c}` |" not in DOC]
    assert not missing, f"docs/protocol.md lacks node error codes {missing}"


def test_every_typed_struct_is_a_documented_message_type():
    assert set(STRUCTS) <= set(SCHEMAS)
    missing = [cls.__name__ for cls in STRUCTS.values() if f"`{cls.__name__}`" not in DOC]
    assert not missing, f"docs/protocol.md does not mention structs {missing}"


def _documented_fields(cell: str) -> set[str]:
    return set() if cell == "—" else set(cell.split(", "))


def test_every_types_documented_fields_are_its_schemas():
    """The table's required and optional columns are what the declarations derive."""
    for type_, schema in SCHEMAS.items():
        row = next(line for line in DOC.splitlines() if line.startswith(f"| `{type_}` |"))
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        for cell, fields in ((cells[2], schema.required), (cells[3], schema.optional)):
            assert _documented_fields(cell) == {f"`{k}` {v}" for k, v in fields.items()}, type_
