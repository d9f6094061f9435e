"""The simulator's outputs in text: the printed table of best settings and verdict counts, and the
compact results.json (written by the CLI, read back by `load_results`).
"""

from __future__ import annotations

import json
from pathlib import Path

from scaling.sim.baselines import POLICIES
from scaling.sim.sweep import best_setting

TABLE_SPEEDS = (1.0, 4.0)  # the printed table: the traces as recorded and at four times the rate


def knob_label(value) -> str:
    return "/".join(f"{v:g}" for v in value) if isinstance(value, (tuple, list)) else f"{value:g}"


def table(rows, comparisons) -> str:
    """Per trace, speed (1x, 4x) and cold start: every policy's best setting (`best_setting`); then
    the verdicts of ours against each baseline's best, counted over every case run."""
    head = (
        f"{'trace':8} {'cold':>5} {'policy':21} {'knob':>9} {'GPU-s':>7} {'boot':>6} "
        f"{'idle':>6} {'wait50':>6} {'wait99':>6} {'ttft50':>6} {'ttft99':>6} {'slo2':>5} "
        f"{'slo5':>5} {'cold#':>5}"
    )
    lines = [head, "-" * len(head)]
    cases = sorted(
        {(r["trace"], r["speed"], r["cold_start_s"]) for r in rows if r["speed"] in TABLE_SPEEDS}
    )
    for trace, speed, cold in cases:
        case = [
            r for r in rows if (r["trace"], r["speed"], r["cold_start_s"]) == (trace, speed, cold)
        ]
        label = f"{trace}@{speed:g}x"
        for name in POLICIES:
            mine = [r for r in case if r["policy"] == name]
            if not mine:
                continue
            r = best_setting(mine)
            lines.append(
                f"{label:8} {cold:5.0f} {name:21} {knob_label(r['value']):>9} {r['gpu_s']:7.0f} "
                f"{r['boot_s']:6.0f} {r['idle_s']:6.0f} {r['queue_wait_p50_s']:6.2f} "
                f"{r['queue_wait_p99_s']:6.2f} {r['ttft_p50_s']:6.2f} {r['ttft_p99_s']:6.2f} "
                f"{r['slo_2s']:5.3f} {r['slo_5s']:5.3f} {r['cold_starts']:5d}"
            )
    counts: dict[str, dict[str, int]] = {}
    for c in comparisons:
        speed = "1x" if c["speed"] == 1.0 else "scaled"
        counts.setdefault(speed, {}).setdefault(c["verdict"], 0)
        counts[speed][c["verdict"]] += 1
    lines.append("")
    for speed, verdicts in counts.items():
        lines.append(
            f"ours vs each baseline's best setting ({speed}): "
            + ", ".join(f"{v}: {n}" for v, n in sorted(verdicts.items()))
        )
    return "\n".join(lines)


def rounded(row: dict) -> dict:
    """Floats to 5 significant digits (the JSON stays small; the simulator is not that exact)."""
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}


def columns(rows: list[dict]) -> dict:
    """Rows of equal keys as {"columns": [...], "rows": [[...], ...]}: a third of the size of a
    list of dicts."""
    keys = list(rows[0]) if rows else []
    return {"columns": keys, "rows": [[r[k] for k in keys] for r in rows]}


def results_json(meta: dict, rows: list[dict], comparisons: list[dict]) -> str:
    """The results.json text: the run's meta, every run and every comparison, rounded."""
    return json.dumps(
        {
            "meta": meta,
            "runs": columns([rounded(r) for r in rows]),
            "comparisons": columns([rounded(c) for c in comparisons]),
        },
        separators=(",", ":"),
    )


def load_results(path: Path) -> tuple[list[dict], list[dict]]:
    """The runs and the comparisons of a results.json as lists of dicts."""
    data = json.loads(Path(path).read_text())

    def unpack(t: dict) -> list[dict]:
        return [dict(zip(t["columns"], row)) for row in t["rows"]]

    return unpack(data["runs"]), unpack(data["comparisons"])
