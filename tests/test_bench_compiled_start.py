"""bench/compiled_start.py's summary: each mode's starts over the rounds, their medians against the
targets, and the token comparisons (on start records shaped as measure() writes them)."""

from __future__ import annotations

from bench.compiled_start import runs_of, summarize


def start(first: float, p99: float, pause: float, alone=("t1 t2",), burst=("x", "y")) -> dict:
    return {
        "first_token_s": first,
        "ttft_p99_s": p99,
        "median_longest_pause_s": pause,
        "first_text": "t9",
        "alone_texts": list(alone),
        "burst_texts": list(burst),
    }


def report(**runs: dict) -> dict:
    return {"runs": {"prime": start(40.0, 5.0, 2.0, alone=("other",)), **runs}}


def test_each_mode_gathers_its_rounds_and_d2_counts_as_d():
    r = report(
        a=start(12, 2, 4),
        b=start(7.0, 0.5, 0.1),
        **{"b#2": start(6.0, 0.4, 0.1)},
        d=start(6.0, 0.5, 0.1),
        d2=start(5.0, 0.5, 0.1),
        **{"d#3": start(6.2, 0.5, 0.1)},
    )
    assert [x["first_token_s"] for x in runs_of(r["runs"], "b")] == [7.0, 6.0]
    assert [x["first_token_s"] for x in runs_of(r["runs"], "d")] == [6.0, 5.0, 6.2]
    assert runs_of(r["runs"], "c") == []
    summarize(r)
    assert r["medians"]["b"]["first_token_s"] == 6.5
    assert r["medians"]["d"]["first_token_s"] == 6.0
    assert "c" not in r["medians"] and "c" not in r["targets"]


def test_targets_compare_medians_not_single_starts():
    slow_once = report(
        b=start(9.0, 0.5, 0.1),
        **{"b#2": start(6.1, 0.5, 0.1), "b#3": start(6.2, 0.5, 0.1)},
        c=start(6.0, 0.7, 0.1),
        d=start(6.0, 0.5, 0.1),
        d2=start(6.0, 0.5, 0.1),
    )
    summarize(slow_once)
    assert slow_once["targets"]["b"] == {
        "first_token_within_0.3s_of_d": True,
        "ttft_p99_within_1.2x": True,
        "pause_within_1.2x": True,
    }
    assert slow_once["targets"]["c"]["ttft_p99_within_1.2x"] is False  # 0.7 > 1.2 x 0.5


def test_tokens_sent_alone_must_agree_in_every_start_the_burst_is_counted():
    same = report(
        b=start(6, 0.5, 0.1), d=start(6, 0.5, 0.1), d2=start(6, 0.5, 0.1, burst=("x", "z"))
    )
    summarize(same)
    assert same["tokens"]["alone_requests_identical"] is True  # the first start's own are left out
    assert same["tokens"]["first_request_identical"] is True
    assert same["tokens"]["burst_streams_identical_to_d"] == {"b": 2, "d2": 1}
    differ = report(b=start(6, 0.5, 0.1, alone=("t1 t3",)), d=start(6, 0.5, 0.1))
    summarize(differ)
    assert differ["tokens"]["alone_requests_identical"] is False
