"""The simulator's figure: billed GPU-seconds against P99 TTFT, one panel per trace and cold start,
every setting of every policy as a dot and each policy's Pareto front as a line (matplotlib).
"""

from __future__ import annotations

from pathlib import Path

from scaling.sim.baselines import POLICIES


def pareto(points):
    """The (p99, cost) points no other point beats on both, by rising P99."""
    front, best = [], float("inf")
    for p99, cost in sorted(points):
        if cost < best:
            front.append((p99, cost))
            best = cost
    return front


def plot(rows, path: Path, speed: float = 1.0) -> None:
    """GPU-seconds against P99 TTFT, one panel per trace and cold start: every setting of each
    policy as a dot, and the line through the settings no other setting of the same policy beats
    on both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    traces = sorted({r["trace"] for r in rows})
    colds = sorted({r["cold_start_s"] for r in rows})
    fig, axes = plt.subplots(
        len(traces), len(colds), figsize=(5 * len(colds), 4 * len(traces)), squeeze=False
    )
    for i, trace in enumerate(traces):
        for j, cold in enumerate(colds):
            ax = axes[i][j]
            here = [
                r
                for r in rows
                if r["trace"] == trace and r["cold_start_s"] == cold and r["speed"] == speed
            ]
            for k, name in enumerate(POLICIES):
                pts = [(r["ttft_p99_s"], r["gpu_s"]) for r in here if r["policy"] == name]
                if not pts:
                    continue
                color, ours = f"C{k}", name == "ours"
                ax.scatter(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    s=18 if ours else 8,
                    color=color,
                    alpha=0.5,
                )
                front = pareto(pts)
                ax.plot(
                    [p[0] for p in front],
                    [p[1] for p in front],
                    color=color,
                    lw=2.5 if ours else 1,
                    marker="o" if ours else None,
                    ms=4,
                    label=name,
                )
            p99s = [r["ttft_p99_s"] for r in here]
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
