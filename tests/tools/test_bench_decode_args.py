"""The decode benchmark's own bookkeeping: repeated passes reduce to the median run, and a bad
--repeat or --delays is refused with a clear message before anything starts."""

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


def test_a_bus_row_is_judged_against_its_own_pass():
    """The VM slows and speeds up over minutes: a run 20 % slower in a pass whose plain runs
    were 20 % slower too is level with plain, and the median pass is taken by that ratio."""
    from tools.bench_decode_bus import _rows

    def run(tok_s, in_pass):
        return {"class": "open-ended", "token_ids": [1], "tok_per_s": tok_s,
                "acceptance": 0.0, "accepted": 0, "drafted": 0, "blocks": 1,
                "in_pass": in_pass}

    passes = [run(100.0, 0.96), run(80.0, 1.0), run(120.0, 0.9)]  # tok/s ranks another way
    assert median_run(passes)["in_pass"] == 0.96
    results = {"bus-plain": [run(100.0, 1.0)], "bus-plain-again": [run(50.0, 1.0)],
               "bus-ngram+50ms": [run(80.0, 1.0)]}
    row = next(r for r in _rows(results) if r["name"] == "bus-ngram+50ms")
    assert row["speedup"] == 1.0 and row["per_prompt"] == [{"prompt": 0, "speedup": 1.0}]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specbus bench decode")
    add_arguments(parser)
    return parser


@pytest.mark.parametrize(("flag", "bad"), [("--repeat", "0"), ("--repeat", "-2"),
                                           ("--repeat", "two"), ("--delays", "30"),
                                           ("--delays", "50,x"), ("--delays", ""),
                                           ("--delays", "-5")])
def test_a_bad_repeat_or_delay_is_refused(flag, bad, capsys):
    """--delays: only the delays the bench has a proxy phase for."""
    with pytest.raises(SystemExit):
        _parser().parse_args([flag, bad])
    assert flag in capsys.readouterr().err


def test_good_values_parse():
    parser = _parser()
    assert parser.parse_args(["--repeat", "3"]).repeat == 3
    assert parser.parse_args(["--delays", "50,0,50"]).delays == (0, 50)  # the bench's order
    assert parser.parse_args([]).delays is None


def test_each_row_is_judged_identical_against_its_own_baseline():
    """Bus rows against the verifier's plain decoding, HF rows against HF greedy: an HF row
    compared with the quantized verifier's plain output would read "not identical" wherever
    fp32 and q4 tip a token differently, which says nothing about HF's prompt lookup."""
    from tools.bench_decode_bus import _rows

    def run(ids, cls="open-ended"):
        return {"class": cls, "token_ids": ids, "tok_per_s": 10.0, "acceptance": 0.0,
                "accepted": 0, "drafted": 0, "blocks": 1}

    results = {"bus-plain": [run([1, 2])], "bus-plain-again": [run([1, 2])],
               "inproc-ngram": [run([1, 2])], "bus-ngram+0ms": [run([1, 2])],
               "bus-int8+0ms": [run([1, 9])],  # a bus row that differs: said so
               "hf-plain": [run([1, 3])], "hf-prompt-lookup": [run([1, 3])]}
    same = {r["name"]: r["identical_to_plain"] for r in _rows(results)}
    assert same == {"bus-plain": True, "bus-plain-again": True, "inproc-ngram": True,
                    "bus-ngram+0ms": True, "bus-int8+0ms": False, "hf-plain": True,
                    "hf-prompt-lookup": True}
    results["hf-prompt-lookup"] = [run([1, 4])]
    assert not next(r for r in _rows(results) if r["name"] == "hf-prompt-lookup")[
        "identical_to_plain"]
