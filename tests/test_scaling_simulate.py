"""The trace simulator on short slices of the Azure traces: every request served exactly once, FIFO,
never more requests on a worker than its capacity, billing adds up, and scale-down saves idle time;
the CLI's --quick run.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from scaling import simulate
from scaling.policy import PolicyConfig
from scaling.sim.baselines import POLICIES, FixedKeepAlive, Ours
from scaling.sim.replay import simulate_run
from scaling.sim.traces import load_trace, trace_path
from scaling.sim.worker_model import SERVING_JSON, load_worker_model


@pytest.fixture(scope="module")
def traces():
    return {name: load_trace(name) for name in ("code", "conv")}


@pytest.fixture(scope="module")
def model(traces):
    return load_worker_model(reference_contexts=traces["conv"].context_tokens)


def test_traces_match_the_csv_files(traces):
    for name, trace in traces.items():
        with open(trace_path(name), newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(trace) == len(rows)
        assert trace.arrival_s[0] == 0 and np.all(np.diff(trace.arrival_s) >= 0)
        assert sorted(trace.generated_tokens.tolist()) == sorted(
            int(r["GeneratedTokens"]) for r in rows
        )
        fast = trace.time_scaled(4.0)
        assert fast.span_s == pytest.approx(trace.span_s / 4)
    with pytest.raises(ValueError, match="trace"):
        trace_path("chat")


def test_worker_model_reads_the_benchmark_json(model):
    data = json.loads(SERVING_JSON.read_text())
    levels = data["online"]["levels"]
    assert model.capacity == max(lv["concurrency"] for lv in levels)
    # at every measured level the model gives back the measured per-request rate and TTFT
    for lv in levels:
        c = lv["concurrency"]
        assert model.decode_tok_s[c] == pytest.approx(lv["output_tok_s"] / c)
        assert model.ttft_s[c] == pytest.approx(lv["ttft_ms"]["p50"] / 1000)


def interval_overlap_max(starts: np.ndarray, ends: np.ndarray) -> int:
    times = np.concatenate([starts, ends])
    delta = np.concatenate([np.ones(len(starts)), -np.ones(len(ends))])
    order = np.lexsort((delta, times))  # at equal times, leave before entering
    return int(np.cumsum(delta[order]).max()) if len(times) else 0


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("trace_name,cold", [("code", 30.0), ("conv", 5.0)])
def test_every_request_is_served_once_in_order_within_capacity(
    traces, model, name, trace_name, cold
):
    trace = traces[trace_name].head(600.0)
    knob, default, _, make = POLICIES[name]
    res = simulate_run(trace, model, make(default, 8), cold, initial_workers=0)
    assert np.all(res.completions == 1)
    assert np.all(res.dispatch_s >= trace.arrival_s - 1e-9)
    assert np.all(np.diff(res.dispatch_s) >= -1e-9)  # one FIFO queue
    assert np.all(res.finish_s > res.dispatch_s)
    assert np.all(res.ttft_s >= res.queue_wait_s)
    # from cold, the first request waits for a worker to boot
    assert res.queue_wait_s[0] >= cold - 1e-9
    for w in np.unique(res.worker):
        mine = res.worker == w
        assert interval_overlap_max(res.dispatch_s[mine], res.finish_s[mine]) <= model.capacity
    # billed = boot + busy + idle, each tracked on its own
    assert res.billed_s == pytest.approx(res.boot_s + res.busy_s + res.idle_s, rel=1e-9, abs=1e-6)
    assert res.boot_s <= res.cold_starts * cold + 1e-9
    # a worker is busy at least as long as its longest request keeps it
    assert res.busy_s >= (res.finish_s - res.dispatch_s).max() - 1e-9


def test_an_empty_trace_bills_nothing(traces, model):
    res = simulate_run(traces["code"].head(-1.0), model, Ours(), 30.0, initial_workers=1)
    assert len(res.ttft_s) == 0 and res.billed_s == 0 and res.cold_starts == 0


def test_never_scaling_down_bills_more_idle_than_scaling_down(traces, model):
    trace = traces["code"].head(1200.0)
    forever = simulate_run(trace, model, FixedKeepAlive(keep_alive_s=1e9), 5.0, initial_workers=1)
    brief = simulate_run(trace, model, FixedKeepAlive(keep_alive_s=5.0), 5.0, initial_workers=1)
    ours = simulate_run(
        trace, model, Ours(PolicyConfig(wait_cost_weight=0.0)), 5.0, initial_workers=1
    )
    assert forever.cold_starts == 0
    assert forever.idle_s > brief.idle_s and forever.idle_s > ours.idle_s
    assert forever.billed_s > brief.billed_s
    # scaling down is paid for in cold starts and in the wait of whoever arrives into a cold
    # endpoint
    assert brief.cold_starts > 0 and brief.queue_wait_s.max() > forever.queue_wait_s.max()


def test_a_longer_cold_start_costs_latency_and_ours_answers_with_longer_keep_warm(traces, model):
    trace = traces["code"].head(900.0)
    fixed = [
        simulate_run(trace, model, FixedKeepAlive(keep_alive_s=30.0), c).metrics()
        for c in (5.0, 120.0)
    ]
    assert (
        fixed[1]["ttft_p99_s"] > fixed[0]["ttft_p99_s"] and fixed[1]["slo_5s"] < fixed[0]["slo_5s"]
    )
    ours = [simulate_run(trace, model, Ours(), c) for c in (5.0, 120.0)]
    assert ours[1].idle_s > ours[0].idle_s  # a dearer cold start is worth more warm idle time
    assert ours[1].cold_starts < ours[0].cold_starts


def test_quick_cli_writes_table_json_and_plot(tmp_path, capsys):
    assert simulate.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU-s" in out and "ours vs each baseline" in out
    rows, comparisons = simulate.load_results(tmp_path / "results.json")
    assert {r["policy"] for r in rows} == set(POLICIES)
    assert {r["cold_start_s"] for r in rows} == {5.0, 30.0}
    for r in rows:
        # 5 digits kept
        assert r["gpu_s"] == pytest.approx(r["boot_s"] + r["busy_s"] + r["idle_s"], rel=1e-4)
        assert 0 <= r["slo_2s"] <= r["slo_5s"] <= 1
        assert r["queue_wait_p50_s"] <= r["queue_wait_p99_s"] and r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert comparisons and all(c["verdict"] for c in comparisons)
    png = (tmp_path / "cost_vs_p99_ttft.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "table.txt").read_text().startswith("trace")


def test_cli_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        simulate.main(["--quick", "--out", str(tmp_path), "--policies", "nope"])
    with pytest.raises(SystemExit):
        simulate.main(["--quick", "--out", str(tmp_path), "--max-workers", "0"])
