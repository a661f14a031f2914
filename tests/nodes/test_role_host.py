"""Roles talk to the node through `RoleHost` (nodes/node_common/host.py) only (issue 44)."""

import ast
from pathlib import Path

from nodes.node import Node, NodeConfig
from nodes.node_common.host import HOST_MEMBERS, HostConfig

ROOT = Path(__file__).resolve().parents[2]
#: the role packages, and the balancer the gateway hands its node to
ROLE_CODE = [p for pkg in ("verifier", "proposer", "gateway", "node_common")
             for p in sorted((ROOT / "nodes" / pkg).glob("*.py"))]
ROLE_CODE.append(ROOT / "nodes/cluster_client/choice.py")


def _is_node(expr: ast.expr) -> bool:
    """`node`, `self.node` or `self._node`: how role code names the node it was given."""
    if isinstance(expr, ast.Name):
        return expr.id == "node"
    return (isinstance(expr, ast.Attribute) and expr.attr in ("node", "_node")
            and isinstance(expr.value, ast.Name) and expr.value.id == "self")


def used_members() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for path in ROLE_CODE:
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.Attribute) and _is_node(n.value):
                used.setdefault(n.attr, set()).add(f"{path.relative_to(ROOT)}:{n.lineno}")
    return used


def test_roles_use_only_what_role_host_declares():
    used = used_members()
    assert {"register_request", "loop", "membership", "node_id"} <= set(used)  # the walk sees
    outside = {name: sorted(where) for name, where in used.items() if name not in HOST_MEMBERS}
    assert not outside, f"roles read these off the node without RoleHost declaring them: {outside}"


def test_the_node_provides_every_role_host_member():
    init = next(f for f in ast.parse(Path(ROOT / "nodes/node.py").read_text()).body
                if isinstance(f, ast.ClassDef) and f.name == "Node")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    missing = {m for m in HOST_MEMBERS if m not in assigned and not hasattr(Node, m)}
    assert not missing
    assert set(HostConfig.__annotations__) <= set(NodeConfig.__dataclass_fields__)
