"""`bench serve` with several drafters: ratios pair each round's runs, never across rounds."""

from __future__ import annotations

import argparse

from tools import bench_serve


def _row(drafter, path, conc, rnd, tok_s):
    return {"drafter": drafter, "path": path, "concurrency": conc, "verifiers": 1,
            "max_batch": 8, "round": rnd, "tok_s": tok_s, "requests": 4, "ttft_p50_ms": 90.0,
            "ttft_p99_ms": 99.0, "request_tok_s_p50": tok_s, "failed": 0,
            "gateway_cpu_s": 0.1}


def test_each_round_is_divided_by_the_same_rounds_baseline():
    rows = [_row("none", "bus", 1, 0, 20.0), _row("eagle", "bus", 1, 0, 19.0),
            _row("eagle", "bus", 1, 1, 12.5), _row("none", "bus", 1, 1, 10.0),
            _row("none", "bus", 4, 0, 40.0)]  # no eagle run at c = 4: no ratio
    got = bench_serve.drafter_ratios(rows, ["none", "eagle"])
    assert got == {"eagle": {"bus c=1 v=1 b=8": {"ratios": [0.95, 1.25], "median": 1.1,
                                                  "worst": 0.95}}}
    summary = bench_serve._summary(rows, ["none", "eagle"])
    assert summary["vs_none"] == got
    text = bench_serve.render(rows, summary, [0])
    assert "eagle over none" in text and "0.95 1.25" in text and "median 1.10  worst 0.95" in text


def test_bad_drafter_lists_and_rounds_are_refused(capsys):
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    for argv in (["--drafter", "none,none"], ["--drafter", ","], ["--rounds", "0"]):
        assert bench_serve.run(parser.parse_args(argv)) == 2
    assert "distinct" in capsys.readouterr().err


def test_bad_prefill_chunk_lists_are_refused_and_variants_are_named(capsys):
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    for argv in (["--prefill-chunk", "0,0"], ["--prefill-chunk", "-1"],
                 ["--prefill-chunk", "x"], ["--prefill-chunk", ","]):
        assert bench_serve.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert "--prefill-chunk takes distinct integers >= 0" in err and "take integers" in err
    assert bench_serve.variant_name("none", 0) == "none"
    assert bench_serve.variant_name("ngram", 256) == "ngram/pc256"
