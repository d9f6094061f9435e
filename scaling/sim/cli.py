"""The trace simulator (`python -m scaling.simulate [--out DIR] [--quick]`): Azure LLM traces
against every autoscaler.

Sweeps each policy's knob per trace, speed and cold start; prints one table; writes JSON and PNGs of
cost vs P99 TTFT.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from scaling.sim.baselines import POLICIES
from scaling.sim.plot import plot
from scaling.sim.report import results_json, table
from scaling.sim.sweep import COST_SAME_REL, P99_SAME_ABS, P99_SAME_REL, compare, sweep
from scaling.sim.traces import TRACE_NAMES, load_trace
from scaling.sim.worker_model import RESULTS_DIR, SERVING_JSON, load_worker_model

COLD_STARTS_S = (5.0, 30.0, 120.0)
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0)
QUICK_SECONDS = 900.0  # --quick: the first 15 minutes of each trace, one knob value per policy


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scaling.simulate", description=__doc__)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default bench/results/<date>-scaling-sim)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="first 15 min of each trace, default knobs, 5 s and 30 s",
    )
    ap.add_argument("--traces", default=",".join(TRACE_NAMES))
    ap.add_argument(
        "--cold-starts", default=None, help="seconds, comma-separated (default 5,30,120)"
    )
    ap.add_argument(
        "--speeds", default=None, help="time scales, comma-separated (default 0.25,0.5,1,2,4)"
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--serving-json", type=Path, default=SERVING_JSON)
    ap.add_argument(
        "--initial-workers",
        type=int,
        default=1,
        help="workers ready at time 0 (the endpoint served before the sample starts); 0: from cold",
    )
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    stamp = datetime.now(timezone.utc)
    out = a.out or RESULTS_DIR / f"{stamp:%Y-%m-%d}-scaling-sim"
    names = [t for t in a.traces.split(",") if t]
    policies = [p for p in a.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: unknown {p!r}; one of {', '.join(POLICIES)}")
    if a.max_workers < 1:
        ap.error(f"--max-workers: must be >= 1, got {a.max_workers}")
    if not 0 <= a.initial_workers <= a.max_workers:
        ap.error(f"--initial-workers: must be in [0, --max-workers], got {a.initial_workers}")
    colds = (
        tuple(float(x) for x in a.cold_starts.split(","))
        if a.cold_starts
        else (COLD_STARTS_S[:2] if a.quick else COLD_STARTS_S)
    )
    speeds = (
        tuple(float(x) for x in a.speeds.split(","))
        if a.speeds
        else ((1.0,) if a.quick else SPEEDS)
    )
    if any(c < 0 for c in colds) or any(s <= 0 for s in speeds):
        ap.error("--cold-starts must be >= 0 and --speeds > 0")
    traces = [load_trace(n) for n in names]
    conv = traces[names.index("conv")] if "conv" in names else load_trace("conv")
    model = load_worker_model(a.serving_json, reference_contexts=conv.context_tokens)
    if a.quick:
        traces = [t.head(QUICK_SECONDS) for t in traces]
    rows = sweep(
        traces, model, colds, speeds, policies, a.max_workers, a.initial_workers, quick=a.quick
    )
    comparisons = compare(rows) if "ours" in policies else []
    report = table(rows, comparisons)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for speed in speeds:
        name = "cost_vs_p99_ttft.png" if speed == 1.0 else f"cost_vs_p99_ttft_{speed:g}x.png"
        pngs.append(out / name)
        plot(rows, pngs[-1], speed)
    elapsed = time.perf_counter() - t0
    meta = {
        "command": "python -m scaling.simulate "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": stamp.isoformat(timespec="seconds"),
        "wall_s": elapsed,
        "quick": a.quick,
        "worker": {
            "capacity": model.capacity,
            "reference_context": model.reference_context,
            "source": model.source,
            "serving_json": str(a.serving_json),
        },
        "traces": {t.name: {"requests": len(t), "span_s": t.span_s} for t in traces},
        "cold_starts_s": colds,
        "speeds": speeds,
        "max_workers": a.max_workers,
        "initial_workers": a.initial_workers,
        "same_p99": f"within {P99_SAME_REL:.0%} or {P99_SAME_ABS} s",
        "equal_cost": f"within {COST_SAME_REL:.0%}",
        "knobs": {n: {"knob": POLICIES[n][0], "values": POLICIES[n][2]} for n in policies},
    }
    (out / "results.json").write_text(results_json(meta, rows, comparisons))
    (out / "table.txt").write_text(report + "\n")
    print(report)
    print(
        f"\n{len(rows)} runs in {elapsed:.1f} s; wrote {out}/results.json, table.txt, "
        + ", ".join(p.name for p in pngs)
    )
    return 0
