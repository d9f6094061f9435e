"""The simulator's experiment: every policy's knob swept per trace, speed and cold start, each
policy's best setting per case, and ours against each baseline's best.
"""

from __future__ import annotations

from scaling.sim.baselines import POLICIES
from scaling.sim.replay import simulate_run

P99_SAME_REL, P99_SAME_ABS = 0.05, 0.05  # "same P99": within 5 % or 50 ms of the baseline's
COST_SAME_REL = 0.02  # "equal cost": within 2 %; "cheaper": more than 2 % less


def sweep(
    traces, model, cold_starts, speeds, policies, max_workers, initial_workers=1, quick=False
):
    """One row of metrics per (trace, speed, cold start, policy, knob value)."""
    rows = []
    for trace in traces:
        for speed in speeds:
            scaled = trace if speed == 1.0 else trace.time_scaled(speed)
            for cold in cold_starts:
                for name in policies:
                    knob, default, values, make = POLICIES[name]
                    for value in (default,) if quick else values:
                        controller = make(value, max_workers)
                        res = simulate_run(scaled, model, controller, cold, initial_workers)
                        rows.append(
                            {
                                "trace": trace.name,
                                "speed": speed,
                                "cold_start_s": cold,
                                "policy": name,
                                "knob": knob,
                                "value": value,
                                **res.metrics(),
                            }
                        )
    return rows


def same_p99(ours: float, base: float) -> bool:
    return ours <= base + max(P99_SAME_REL * base, P99_SAME_ABS)


def best_setting(runs: list[dict]) -> dict:
    """A policy's best setting in one case: the cheapest of those whose P99 TTFT is the same as
    its lowest."""
    low = min(r["ttft_p99_s"] for r in runs)
    return min(
        (r for r in runs if same_p99(r["ttft_p99_s"], low)),
        key=lambda r: (r["gpu_s"], r["ttft_p99_s"]),
    )


def verdict(ours: list[dict], best: dict) -> tuple[dict | None, str]:
    """Ours' setting that answers a baseline's best setting, and how it compares."""
    same = [r for r in ours if same_p99(r["ttft_p99_s"], best["ttft_p99_s"])]
    match = min(same, key=lambda r: r["gpu_s"]) if same else None
    if match is not None and match["gpu_s"] < best["gpu_s"] * (1 - COST_SAME_REL):
        return match, "cheaper at same P99"
    equal_cost = [r for r in ours if r["gpu_s"] <= best["gpu_s"] * (1 + COST_SAME_REL)]
    lower = min(equal_cost, key=lambda r: r["ttft_p99_s"]) if equal_cost else None
    if lower is not None and lower["ttft_p99_s"] < best["ttft_p99_s"] - P99_SAME_ABS:
        return lower, "lower P99 at equal cost"
    if match is not None and match["gpu_s"] <= best["gpu_s"] * (1 + COST_SAME_REL):
        return match, "tie"
    return match, "baseline better"


def compare(rows):
    """Per (trace, speed, cold start, baseline): its best setting (`best_setting`) against ours'
    settings."""
    out = []
    keys = sorted({(r["trace"], r["speed"], r["cold_start_s"]) for r in rows})
    for key in keys:
        case = [r for r in rows if (r["trace"], r["speed"], r["cold_start_s"]) == key]
        ours = [r for r in case if r["policy"] == "ours"]
        for name in sorted({r["policy"] for r in case} - {"ours"}):
            best = best_setting([r for r in case if r["policy"] == name])
            match, said = verdict(ours, best)
            out.append(
                {
                    "trace": key[0],
                    "speed": key[1],
                    "cold_start_s": key[2],
                    "baseline": name,
                    "baseline_value": best["value"],
                    "baseline_gpu_s": best["gpu_s"],
                    "baseline_ttft_p99_s": best["ttft_p99_s"],
                    "ours_value": match["value"] if match else None,
                    "ours_gpu_s": match["gpu_s"] if match else None,
                    "ours_ttft_p99_s": match["ttft_p99_s"] if match else None,
                    "verdict": said,
                }
            )
    return out
