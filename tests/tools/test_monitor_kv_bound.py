"""Issue 45, item 4: the monitor's members table shows a verifier's bounded K/V from its card
(`extras.kv_bound`, and where the sinks sit: `extras.kv_positions`), beside the model; a
malformed value shows nothing."""

from __future__ import annotations

from tests.tools.test_monitor_labels import _member
from tools.monitor_view import MEMBER_COLUMNS, ClusterView, member_rows


def test_the_bound_is_beside_the_model():
    view = ClusterView()
    view.refresh([_member("a" * 12, "bounded", ("verifier",), {"kv_bound": [4, 64]}),
                  _member("b" * 12, "full", ("verifier",)),
                  _member("c" * 12, "odd", ("verifier",), {"kv_bound": ["x", True]}),
                  _member("d" * 12, "moded", ("verifier",),
                          {"kv_bound": [4, 64], "kv_positions": "reindexed"}),
                  _member("e" * 12, "oddmode", ("verifier",),
                          {"kv_bound": [4, 64], "kv_positions": ["no"]})])
    rows = {r[0]: dict(zip(MEMBER_COLUMNS, r, strict=True)) for r in member_rows(view)}
    assert rows["bounded"]["model"].endswith("kv 4+64")
    assert rows["moded"]["model"].endswith("kv 4+64 reindexed")
    assert rows["oddmode"]["model"].endswith("kv 4+64")
    assert "kv" not in rows["full"]["model"] and "kv" not in rows["odd"]["model"]
