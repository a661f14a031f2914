"""The decode benchmark's own bookkeeping: repeated passes reduce to the median run, and a bad
--repeat is refused with a clear message before anything starts."""

from __future__ import annotations

import argparse

import pytest

from tools.bench_decode import add_arguments
from tools.bench_decode_bus import median_run


def test_the_median_run_is_kept_whole():
    runs = [{"tok_per_s": 9.0, "acceptance": 0.9}, {"tok_per_s": 3.0, "acceptance": 0.3},
            {"tok_per_s": 5.0, "acceptance": 0.5}]
    assert median_run(runs) == {"tok_per_s": 5.0, "acceptance": 0.5, "passes": 3}
    # an even count: the lower middle (never a run faster than half of them)
    assert median_run(runs[:2])["tok_per_s"] == 3.0
    assert median_run(runs[:1])["tok_per_s"] == 9.0
    with pytest.raises(ValueError):
        median_run([])


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_a_bad_repeat_is_refused(bad, capsys):
    parser = argparse.ArgumentParser(prog="specbus bench decode")
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--repeat", bad])
    assert "--repeat" in capsys.readouterr().err
    assert parser.parse_args(["--repeat", "3"]).repeat == 3
