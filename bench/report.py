"""The serving benchmark's results file: merge the parts of a split run, derive ratios, print the
summary table and draw the concurrency plot (output tok/s and TTFT p99 vs concurrency).
"""

from __future__ import annotations

import json
import os

SECTIONS = ("decode", "offline", "online", "hf")


def merge(base: dict, new: dict) -> dict:
    """new's sections replace base's; the meta of every call is kept; KV figures are kept per
    part."""
    out = {k: v for k, v in base.items()}
    for key in SECTIONS:
        if key in new:
            out[key] = (
                new[key] if key != "offline" else {**base.get("offline", {}), **new["offline"]}
            )
    out["kv"] = {**base.get("kv", {}), **new.get("kv", {})}
    meta = dict(new.get("meta") or base.get("meta") or {})
    meta["calls"] = list((base.get("meta") or {}).get("calls", [])) + list(
        (new.get("meta") or {}).get("calls", [])
    )
    out["meta"] = meta
    out["ratios"] = ratios(out)
    return out


def ratios(res: dict) -> dict:
    """Ours / HF's best mode on matching workloads (the same conv-trace subset; batch-1 decode)."""
    out: dict = {}
    hf = res.get("hf") or {}
    modes = {
        k: hf[k]["output_tok_s"]
        for k in ("generate", "generate_batch")
        if isinstance(hf.get(k), dict)
    }
    if modes and isinstance(hf.get("ours"), dict):
        best = max(modes, key=modes.get)
        out["hf_best_mode"] = best
        out["conv_subset_output_tok_s"] = hf["ours"]["output_tok_s"] / modes[best]
        conv = (res.get("offline") or {}).get("conv")
        if conv:  # not the same workload size: our 1000-request run against HF's best on its subset
            out["conv_full_vs_hf_subset_output_tok_s"] = conv["output_tok_s"] / modes[best]
    if hf.get("decode_b1") and res.get("decode"):
        out["decode_b1_tok_s"] = res["decode"]["tok_s"] / hf["decode_b1"]["tok_s"]
    return out


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save(res: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _lat(d: dict) -> str:
    return f"{_f(d.get('p50'))} / {_f(d.get('p99'))}"


def table(res: dict) -> str:
    meta = res.get("meta", {})
    calls = meta.get("calls", [])
    bw = ", ".join(f"{c['bandwidth_GBps']:.0f}" for c in calls if c.get("bandwidth_GBps"))
    lines = [
        f"coldbrew serving benchmark: {meta.get('device', '?')}, {meta.get('config', '?')}, "
        f"{meta.get('dtype', '?')}, copy bandwidth {bw or '?'} GB/s (per call)",
        f"{'workload':<30} {'out tok/s':>10} {'total tok/s':>12} {'TTFT p50/p99 ms':>18} "
        f"{'ITL p50/p99 ms':>16}",
    ]

    def row(name: str, d: dict, total: bool = True) -> None:
        lines.append(
            f"{name:<30} {_f(d.get('output_tok_s')):>10} "
            f"{_f(d.get('total_tok_s')) if total else '-':>12} "
            f"{_lat(d.get('ttft_ms', {})):>18} {_lat(d.get('itl_ms', {})):>16}"
        )

    off = res.get("offline") or {}
    for key, label in (("conv", "offline conv"), ("fixed", "offline fixed")):
        if key in off:
            d = off[key]
            mean_prompt = d["prompt_tokens"] // max(d["num_requests"], 1)
            row(f"{label} x{d['num_requests']} ({mean_prompt} in avg)", d)
    for lvl in (res.get("online") or {}).get("levels", []):
        row(f"online c={lvl['concurrency']} ({lvl['requests_finished']} done)", lvl, total=False)
    hf = res.get("hf") or {}
    for key, label in (
        ("ours", "ours, HF subset"),
        ("generate", "HF generate"),
        ("generate_batch", "HF generate_batch"),
    ):
        if isinstance(hf.get(key), dict):
            row(f"{label} x{hf[key]['num_requests']}", hf[key])
        elif isinstance(hf.get(key), str):
            lines.append(f"{label}: {hf[key][:100]}")
    dec = res.get("decode")
    if dec:
        lines.append(
            f"decode batch 1: {dec['ms_per_token']:.2f} ms/token, {dec['tok_s']:.1f} tok/s, "
            f"{dec['roofline_frac']:.0%} of the roofline ({dec['floor_ms']:.2f} ms: "
            f"{dec['decode_weights_GB']:.2f} GB at {dec['bandwidth_GBps']:.0f} GB/s)"
        )
    win = (off.get("fixed") or {}).get("decode_window")
    if win:
        if win.get("valid"):
            lines.append(
                f"offline fixed, decode steps: {win['step_ms']:.2f} ms at batch "
                f"{win['mean_batch']:.0f}, floor {win['floor_ms']:.2f} ms "
                f"(weights {win['weights_GB_per_step']:.1f} GB + KV {win['kv_GB_per_step']:.1f} GB "
                f"per step): {win['roofline_frac']:.0%} of the roofline"
            )
        else:
            lines.append(f"offline fixed, decode steps: {win.get('reason')}")
    rat = res.get("ratios") or {}
    if rat:
        parts = [f"{k} {v:.2f}x" for k, v in rat.items() if isinstance(v, float)]
        lines.append(f"ours / HF ({rat.get('hf_best_mode', '-')} best): " + ", ".join(parts))
    for part, kv in (res.get("kv") or {}).items():
        lines.append(
            f"KV ({part}): {kv['num_kv_blocks']} blocks allocated, "
            f"peak used {kv['peak_used_blocks']} "
            f"({kv['waste_frac']:.0%} never used), {kv['preemptions']} preemptions"
        )
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    """Output tok/s and TTFT p99 against concurrency; False when there is no online section."""
    levels = (res.get("online") or {}).get("levels", [])
    if not levels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [lvl["concurrency"] for lvl in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(conc, [lvl["output_tok_s"] for lvl in levels], "o-")
    ax1.set(
        xscale="log", xlabel="concurrent clients", ylabel="output tokens / s", title="throughput"
    )
    ax2.plot(conc, [lvl["ttft_ms"]["p99"] or float("nan") for lvl in levels], "o-", color="tab:red")
    ax2.set(xscale="log", xlabel="concurrent clients", ylabel="ms", title="TTFT p99")
    for ax in (ax1, ax2):
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.grid(True, alpha=0.3)
    meta = res.get("meta", {})
    fig.suptitle(f"coldbrew online serving: {meta.get('config', '')}, {meta.get('device', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
