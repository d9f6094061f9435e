"""The trace simulator (`python -m scaling.simulate [--out DIR] [--quick]`): Azure LLM traces against every autoscaler.

Sweeps each policy's knob per trace, speed and cold start; prints one table; writes JSON and PNGs of cost vs P99 TTFT.
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from scaling.baselines import POLICIES
from scaling.sim_engine import simulate_run
from scaling.sim_worker import SERVING_JSON, load_worker_model
from scaling.traces import TRACE_NAMES, load_trace

COLD_STARTS_S = (5.0, 30.0, 120.0)
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0)
QUICK_SECONDS = 900.0  # --quick: the first 15 minutes of each trace, one knob value per policy, two cold starts
P99_SAME_REL, P99_SAME_ABS = 0.05, 0.05  # "same P99": within 5 % or 50 ms of the baseline's
COST_SAME_REL = 0.02  # "equal cost": within 2 %; "cheaper": more than 2 % less


def sweep(traces, model, cold_starts, speeds, policies, max_workers, initial_workers=1, quick=False):
    """One row of metrics per (trace, speed, cold start, policy, knob value)."""
    rows = []
    for trace in traces:
        for speed in speeds:
            scaled = trace if speed == 1.0 else trace.time_scaled(speed)
            for cold in cold_starts:
                for name in policies:
                    knob, default, values, make = POLICIES[name]
                    for value in ((default,) if quick else values):
                        res = simulate_run(scaled, model, make(value, max_workers), cold, initial_workers)
                        rows.append({"trace": trace.name, "speed": speed, "cold_start_s": cold, "policy": name,
                                     "knob": knob, "value": value, **res.metrics()})
    return rows


def _same_p99(ours: float, base: float) -> bool:
    return ours <= base + max(P99_SAME_REL * base, P99_SAME_ABS)


def best_setting(runs: list[dict]) -> dict:
    """A policy's best setting in one case: the cheapest of those whose P99 TTFT is the same as its lowest."""
    low = min(r["ttft_p99_s"] for r in runs)
    return min((r for r in runs if _same_p99(r["ttft_p99_s"], low)), key=lambda r: (r["gpu_s"], r["ttft_p99_s"]))


def compare(rows):
    """Per (trace, speed, cold start, baseline): its best setting (`best_setting`) against ours' settings."""
    out = []
    keys = sorted({(r["trace"], r["speed"], r["cold_start_s"]) for r in rows})
    for key in keys:
        case = [r for r in rows if (r["trace"], r["speed"], r["cold_start_s"]) == key]
        ours = [r for r in case if r["policy"] == "ours"]
        for name in sorted({r["policy"] for r in case} - {"ours"}):
            best = best_setting([r for r in case if r["policy"] == name])
            same = [r for r in ours if _same_p99(r["ttft_p99_s"], best["ttft_p99_s"])]
            match = min(same, key=lambda r: r["gpu_s"]) if same else None
            if match is not None and match["gpu_s"] < best["gpu_s"] * (1 - COST_SAME_REL):
                verdict = "cheaper at same P99"
            else:
                equal_cost = [r for r in ours if r["gpu_s"] <= best["gpu_s"] * (1 + COST_SAME_REL)]
                lower = min(equal_cost, key=lambda r: r["ttft_p99_s"]) if equal_cost else None
                if lower is not None and lower["ttft_p99_s"] < best["ttft_p99_s"] - P99_SAME_ABS:
                    match, verdict = lower, "lower P99 at equal cost"
                elif match is not None and match["gpu_s"] <= best["gpu_s"] * (1 + COST_SAME_REL):
                    verdict = "tie"
                else:
                    verdict = "baseline better"
            out.append({"trace": key[0], "speed": key[1], "cold_start_s": key[2], "baseline": name,
                        "baseline_value": best["value"], "baseline_gpu_s": best["gpu_s"],
                        "baseline_ttft_p99_s": best["ttft_p99_s"],
                        "ours_value": match["value"] if match else None,
                        "ours_gpu_s": match["gpu_s"] if match else None,
                        "ours_ttft_p99_s": match["ttft_p99_s"] if match else None, "verdict": verdict})
    return out


def knob_label(value) -> str:
    return "/".join(f"{v:g}" for v in value) if isinstance(value, (tuple, list)) else f"{value:g}"


TABLE_SPEEDS = (1.0, 4.0)  # the printed table: the traces as recorded and at four times the rate


def table(rows, comparisons) -> str:
    """Per trace, speed (1x, 4x) and cold start: every policy's best setting (`best_setting`); then the verdicts of
    ours against each baseline's best, counted over every case run."""
    head = (f"{'trace':8} {'cold':>5} {'policy':21} {'knob':>9} {'GPU-s':>7} {'boot':>6} {'idle':>6} "
            f"{'wait50':>6} {'wait99':>6} {'ttft50':>6} {'ttft99':>6} {'slo2':>5} {'slo5':>5} {'cold#':>5}")
    lines = [head, "-" * len(head)]
    cases = sorted({(r["trace"], r["speed"], r["cold_start_s"]) for r in rows if r["speed"] in TABLE_SPEEDS})
    for trace, speed, cold in cases:
        case = [r for r in rows if (r["trace"], r["speed"], r["cold_start_s"]) == (trace, speed, cold)]
        label = f"{trace}@{speed:g}x"
        for name in POLICIES:
            mine = [r for r in case if r["policy"] == name]
            if not mine:
                continue
            r = best_setting(mine)
            lines.append(
                f"{label:8} {cold:5.0f} {name:21} {knob_label(r['value']):>9} {r['gpu_s']:7.0f} {r['boot_s']:6.0f} "
                f"{r['idle_s']:6.0f} {r['queue_wait_p50_s']:6.2f} {r['queue_wait_p99_s']:6.2f} "
                f"{r['ttft_p50_s']:6.2f} {r['ttft_p99_s']:6.2f} {r['slo_2s']:5.3f} {r['slo_5s']:5.3f} "
                f"{r['cold_starts']:5d}")
    counts: dict[str, dict[str, int]] = {}
    for c in comparisons:
        speed = "1x" if c["speed"] == 1.0 else "scaled"
        counts.setdefault(speed, {}).setdefault(c["verdict"], 0)
        counts[speed][c["verdict"]] += 1
    lines.append("")
    for speed, verdicts in counts.items():
        lines.append(f"ours vs each baseline's best setting ({speed}): "
                     + ", ".join(f"{v}: {n}" for v, n in sorted(verdicts.items())))
    return "\n".join(lines)


def pareto(points):
    """The (p99, cost) points no other point beats on both, by rising P99."""
    front, best = [], float("inf")
    for p99, cost in sorted(points):
        if cost < best:
            front.append((p99, cost))
            best = cost
    return front


def plot(rows, path: Path, speed: float = 1.0) -> None:
    """GPU-seconds against P99 TTFT, one panel per trace and cold start: every setting of each policy as a dot, and
    the line through the settings no other setting of the same policy beats on both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    traces = sorted({r["trace"] for r in rows})
    colds = sorted({r["cold_start_s"] for r in rows})
    fig, axes = plt.subplots(len(traces), len(colds), figsize=(5 * len(colds), 4 * len(traces)), squeeze=False)
    for i, trace in enumerate(traces):
        for j, cold in enumerate(colds):
            ax = axes[i][j]
            for k, name in enumerate(POLICIES):
                pts = [(r["ttft_p99_s"], r["gpu_s"]) for r in rows if r["trace"] == trace
                       and r["cold_start_s"] == cold and r["policy"] == name and r["speed"] == speed]
                if not pts:
                    continue
                color, ours = f"C{k}", name == "ours"
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18 if ours else 8, color=color, alpha=0.5)
                front = pareto(pts)
                ax.plot([p[0] for p in front], [p[1] for p in front], color=color, lw=2.5 if ours else 1,
                        marker="o" if ours else None, ms=4, label=name)
            p99s = [r["ttft_p99_s"] for r in rows if r["trace"] == trace and r["cold_start_s"] == cold
                    and r["speed"] == speed]
            if p99s and max(p99s) > 10 * min(p99s):
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
                ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_title(f"{trace} @{speed:g}x, cold start {cold:g} s")
            ax.set_xlabel("P99 TTFT (s)")
            ax.set_ylabel("billed GPU-seconds")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def rounded(row: dict) -> dict:
    """Floats to 5 significant digits (the JSON stays small; the simulator is not that exact anyway)."""
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}


def columns(rows: list[dict]) -> dict:
    """Rows of equal keys as {"columns": [...], "rows": [[...], ...]}: a third of the size of a list of dicts."""
    keys = list(rows[0]) if rows else []
    return {"columns": keys, "rows": [[r[k] for k in keys] for r in rows]}


def load_results(path: Path) -> tuple[list[dict], list[dict]]:
    """The runs and the comparisons of a results.json as lists of dicts."""
    data = json.loads(Path(path).read_text())
    unpack = lambda t: [dict(zip(t["columns"], row)) for row in t["rows"]]  # noqa: E731
    return unpack(data["runs"]), unpack(data["comparisons"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scaling.simulate", description=__doc__)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/<date>-scaling-sim)")
    ap.add_argument("--quick", action="store_true", help="first 15 min of each trace, default knobs, 5 s and 30 s")
    ap.add_argument("--traces", default=",".join(TRACE_NAMES))
    ap.add_argument("--cold-starts", default=None, help="seconds, comma-separated (default 5,30,120)")
    ap.add_argument("--speeds", default=None, help="time scales, comma-separated (default 0.25,0.5,1,2,4)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--serving-json", type=Path, default=SERVING_JSON)
    ap.add_argument("--initial-workers", type=int, default=1,
                    help="workers ready at time 0 (the endpoint served before the sample starts); 0: from cold")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    stamp = datetime.now(timezone.utc)
    out = a.out or Path(__file__).resolve().parent.parent / "bench" / "results" / f"{stamp:%Y-%m-%d}-scaling-sim"
    names = [t for t in a.traces.split(",") if t]
    policies = [p for p in a.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: unknown {p!r}; one of {', '.join(POLICIES)}")
    if a.max_workers < 1:
        ap.error(f"--max-workers: must be >= 1, got {a.max_workers}")
    if not 0 <= a.initial_workers <= a.max_workers:
        ap.error(f"--initial-workers: must be in [0, --max-workers], got {a.initial_workers}")
    colds = tuple(float(x) for x in a.cold_starts.split(",")) if a.cold_starts else (
        COLD_STARTS_S[:2] if a.quick else COLD_STARTS_S)
    speeds = tuple(float(x) for x in a.speeds.split(",")) if a.speeds else ((1.0,) if a.quick else SPEEDS)
    if any(c < 0 for c in colds) or any(s <= 0 for s in speeds):
        ap.error("--cold-starts must be >= 0 and --speeds > 0")
    traces = [load_trace(n) for n in names]
    conv = traces[names.index("conv")] if "conv" in names else load_trace("conv")
    model = load_worker_model(a.serving_json, reference_contexts=conv.context_tokens)
    if a.quick:
        traces = [t.head(QUICK_SECONDS) for t in traces]
    rows = sweep(traces, model, colds, speeds, policies, a.max_workers, a.initial_workers, quick=a.quick)
    comparisons = compare(rows) if "ours" in policies else []
    report = table(rows, comparisons)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for speed in speeds:
        pngs.append(out / ("cost_vs_p99_ttft.png" if speed == 1.0 else f"cost_vs_p99_ttft_{speed:g}x.png"))
        plot(rows, pngs[-1], speed)
    elapsed = time.perf_counter() - t0
    meta = {
        "command": "python -m scaling.simulate " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "date": stamp.isoformat(timespec="seconds"), "wall_s": elapsed, "quick": a.quick,
        "worker": {"capacity": model.capacity, "reference_context": model.reference_context, "source": model.source,
                   "serving_json": str(a.serving_json)},
        "traces": {t.name: {"requests": len(t), "span_s": t.span_s} for t in traces},
        "cold_starts_s": colds, "speeds": speeds, "max_workers": a.max_workers, "initial_workers": a.initial_workers,
        "same_p99": f"within {P99_SAME_REL:.0%} or {P99_SAME_ABS} s", "equal_cost": f"within {COST_SAME_REL:.0%}",
        "knobs": {n: {"knob": POLICIES[n][0], "values": POLICIES[n][2]} for n in policies},
    }
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "runs": columns([rounded(r) for r in rows]),
         "comparisons": columns([rounded(c) for c in comparisons])}, separators=(",", ":")))
    (out / "table.txt").write_text(report + "\n")
    print(report)
    print(f"\n{len(rows)} runs in {elapsed:.1f} s; wrote {out}/results.json, table.txt, "
          + ", ".join(p.name for p in pngs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
