"""The monitor's text formatting (fast units; the live views are in test_monitor*.py)."""

from __future__ import annotations

from tools.monitor_view import rate_text


def test_rates_keep_their_width_and_say_their_magnitude():
    assert rate_text(0.0) == "     0.0"
    assert rate_text(20.74) == "    20.7"
    assert rate_text(999.94) == "   999.9"
    assert rate_text(354061.7) == "    354k"  # an n-gram drafter: matching takes microseconds
    assert rate_text(2_500_000.0) == "      2M"
    assert {len(rate_text(x)) for x in (0.0, 20.7, 1234.0, 354061.7, 9e8)} == {8}
