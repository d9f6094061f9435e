"""FP8 GEMM sweep on one GPU at Llama-3.1-8B's linear shapes, every row count the engine runs:
the FP8 skinny kernel (weights widened to bf16, or activations quantized in the kernel for an fp8
dot), per-token quantization + torch._scaled_mm row-wise, _scaled_mm per-tensor (alone, and
with unit scales into fp32 followed by the engine's scaling kernel), against bf16
cuBLAS and the bf16 skinny kernel, each beside the byte floor of its weights at the measured copy
bandwidth (bench/roofline.py's measure).

`python -m bench.fp8_gemm --out DIR`: GPU time per call inside CUDA graphs, weights rotated past
the L2; a tile sweep of the FP8 skinny kernel at --sweep-rows; the error of each path against an
fp64 product of the same quantized operands; the layers' sum per row count; writes
DIR/fp8_gemm.json and prints tables.
`--config llama-3.1-70b.json`: another architecture's layer linears (bench/configs/; default
Llama-3.1-8B's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from bench.attention_micro import time_call
from bench.checkpoint import CONFIGS
from bench.gemm_micro import Rotating
from bench.layer_shapes import layer_linears
from bench.roofline import copy_bandwidth
from engine.config import ModelConfig
from engine.layers.skinny_gemm import skinny_gemm
from engine.quant import fp8_kernels as fk

ROWS = "1,2,4,8,16,32,64,128,256,512,2048,8192"
UNIT_SCALES_ROWS_MAX = 512  # _scaled_mm with unit scales + the scaling kernel is timed up to here
GEMV_ROWS_MAX = 1  # the one-row GEMV (bench/results/.../fp8_gemm_few_row_gemv.json tried up to 8)
SKINNY_ROWS_MAX = (
    64  # the skinny kernel is timed up to here (the engine runs it only as ONE_ROW_PATH "skinny")
)


class RotatingFp8:
    """Copies of one FP8 weight (and its scales) past the L2, handed out in turn."""

    def __init__(self, n: int, k: int, min_bytes: int = 256 << 20) -> None:
        copies = max(2, -(-min_bytes // (n * k)))
        self.weights = []
        for _ in range(copies):
            q, s = fk.quantize_rows_reference(0.02 * torch.randn(n, k, device="cuda"))
            self.weights.append((q, s.view(-1).contiguous()))
        self.turn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.turn += 1
        return self.weights[self.turn % len(self.weights)]


def skinny_candidates(variant: str) -> list[tuple[int, int, int, int]]:
    """Tiles to sweep per variant (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if variant == "gemv":
        grid = itertools.product(
            (4, 8, 16, 32), (256, 512, 1024, 2048), ((4, 2), (8, 3), (8, 4), (16, 3))
        )
    else:
        grid = itertools.product((16, 32, 64), (512, 1024), ((4, 3), (4, 4), (8, 4)))
    return [(bn, bk, w, s) for bn, bk, (w, s) in grid]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def measure(
    name: str, n: int, k: int, m: int, sweep: bool, bandwidth: float, only: tuple = ()
) -> dict:
    """One shape at m rows; `only`: the skinny variants to time (default all)."""
    fp8 = RotatingFp8(n, k)
    w, ws = fp8.weights[0]
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    xq, xs = fk.quantize_per_token(x)
    # higher precision reference: the same quantized operands multiplied in fp64
    ref_w8a8 = (xq.double() * xs.double()) @ (w.double() * ws.double()[:, None]).t()
    ref_w8a16 = x.double() @ (w.double() * ws.double()[:, None]).t()
    row = {"shape": name, "n": n, "k": k, "rows": m, "fp8_weight_bytes": n * k + 4 * n}
    row["floor_fp8_s"] = row["fp8_weight_bytes"] / bandwidth
    row["floor_bf16_s"] = 2 * n * k / bandwidth
    times, errors = {}, {}

    bf16 = Rotating(n, k)
    times["bf16_cublas"] = time_call(lambda: F.linear(x, bf16.next()), graph=True)
    if m <= 16:
        times["bf16_skinny"] = time_call(lambda: skinny_gemm(x, bf16.next()), graph=True)

    def rowwise():
        q, s = fk.quantize_per_token(x)
        wq, wsc = fp8.next()
        return fk.scaled_mm_rowwise(q, s, wq, wsc, torch.bfloat16)

    times["scaled_mm_rowwise+quant"] = time_call(rowwise, graph=True)
    errors["scaled_mm_rowwise+quant"] = rel_err(
        fk.scaled_mm_rowwise(xq, xs, w, ws, torch.bfloat16), ref_w8a8
    )
    times["scaled_mm_rowwise"] = time_call(
        lambda: fk.scaled_mm_rowwise(xq, xs, *fp8.next(), torch.bfloat16), graph=True
    )
    one = torch.ones((), device="cuda")
    times["scaled_mm_per_tensor"] = time_call(
        lambda: torch._scaled_mm(
            xq, fp8.next()[0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        ),
        graph=True,
    )
    times["quant_only"] = time_call(lambda: fk.quantize_per_token(x), graph=True)
    if m <= UNIT_SCALES_ROWS_MAX:
        times["scaled_mm_unit_scales"] = time_call(
            lambda: fk.scaled_mm_unit_scales(xq, xs, *fp8.next(), None, torch.bfloat16), graph=True
        )
        errors["scaled_mm_unit_scales"] = rel_err(
            fk.scaled_mm_unit_scales(xq, xs, w, ws, None, torch.bfloat16), ref_w8a8
        )
    if m == 1:
        times["scaled_mm_one_row"] = time_call(
            lambda: fk.scaled_mm_one_row(x, *fp8.next()), graph=True
        )
        errors["scaled_mm_one_row"] = rel_err(fk.scaled_mm_one_row(x, w, ws), ref_w8a8)
    if m <= SKINNY_ROWS_MAX:
        variants = [*fk.SKINNY_VARIANTS, "gemv"] if m <= GEMV_ROWS_MAX else fk.SKINNY_VARIANTS
        variants = [v for v in variants if not only or v in only]
        for variant in variants:
            label = f"skinny_{variant}"
            ref = ref_w8a8 if variant.endswith("w8a8") else ref_w8a16
            default = fk.default_skinny_config(n, k, variant)
            configs = [default]
            if sweep:
                configs += [c for c in skinny_candidates(variant) if c != default]
            tried = {}
            for config in configs:

                def skinny(config=config, variant=variant):
                    wq, wsc = fp8.next()
                    return fk.fp8_skinny_gemm(x, wq, wsc, variant=variant, config=config)

                key = ":".join(map(str, config))
                try:
                    y = fk.fp8_skinny_gemm(x, w, ws, variant=variant, config=config)
                    tried[key] = {"s": time_call(skinny, graph=True), "rel_err": rel_err(y, ref)}
                except Exception as exc:  # a tile that does not fit: recorded, skipped
                    tried[key] = {"s": float("inf"), "error": str(exc)[:200]}
            dkey = ":".join(map(str, default))
            times[label] = tried[dkey]["s"]
            errors[label] = tried[dkey].get("rel_err")
            if sweep:
                best = min(tried, key=lambda c: tried[c]["s"])
                row[f"{label}_best"] = best
                row[f"{label}_best_s"] = tried[best]["s"]
                row[f"{label}_best_rel_err"] = tried[best].get("rel_err")
                row[f"{label}_sweep"] = tried

    def engine():
        wq, wsc = fp8.next()
        return fk.fp8_linear(x, wq, wsc)

    times["engine_fp8_linear"] = time_call(engine, graph=True)
    path = fk.cuda_path(m, x.dtype)
    row["engine_path"] = path
    errors["engine_fp8_linear"] = rel_err(
        fk.fp8_linear(x, w, ws), ref_w8a8 if fk.quantizes_activations(path) else ref_w8a16
    )
    row["times_s"] = times
    row["rel_err_vs_fp64"] = errors
    row["of_fp8_floor"] = {key: row["floor_fp8_s"] / t for key, t in times.items() if t > 0}
    fp8_paths = [
        p
        for p in times
        if p.startswith(("skinny_", "scaled_mm_rowwise+", "scaled_mm_one_row", "scaled_mm_unit"))
    ]
    row["fastest_fp8"] = min(fp8_paths, key=lambda p: times[p])
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--sweep-rows", default="1,4", help="rows at which skinny tiles are swept")
    ap.add_argument("--variants", default="", help="skinny variants to time (default all)")
    ap.add_argument("--config", default="llama-3.1-8b.json", help="bench/configs/ file")
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / args.config).read_text()))
    shapes, num_layers = layer_linears(cfg), cfg.num_layers
    only = tuple(v for v in args.variants.split(",") if v)
    os.makedirs(args.out, exist_ok=True)
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    row_counts = [int(r) for r in args.rows.split(",") if r]
    rows = []
    for (name, n, k), m in itertools.product(shapes, row_counts):
        r = measure(name, n, k, m, m in sweep_rows, bandwidth, only)
        rows.append(r)
        t = r["times_s"]
        print(
            f"{name} M={m}: "
            + ", ".join(f"{p} {s * 1e6:.1f}us" for p, s in t.items())
            + f" | floor {r['floor_fp8_s'] * 1e6:.1f}us | fastest {r['fastest_fp8']}"
            + "".join(
                f" | {lbl} best {r[lbl + '_best']} {r[lbl + '_best_s'] * 1e6:.1f}us"
                for lbl in [f"skinny_{v}" for v in (*fk.SKINNY_VARIANTS, "gemv")]
                if lbl + "_best" in r
            ),
            flush=True,
        )
    # the layers' linears, per row count
    totals = []
    for m in row_counts:
        per = [r for r in rows if r["rows"] == m]
        paths = set.intersection(*(set(r["times_s"]) for r in per))
        total = {p: num_layers * sum(r["times_s"][p] for r in per) for p in sorted(paths)}
        totals.append(
            {
                "rows": m,
                "layers_s": total,
                "floor_fp8_s": num_layers * sum(r["floor_fp8_s"] for r in per),
                "floor_bf16_s": num_layers * sum(r["floor_bf16_s"] for r in per),
            }
        )
    # the sweep's best tiles per (variant, N, K): bench/fp8_decode.py --tiles installs them
    best_tiles = {}
    for r in rows:
        for v in (*fk.SKINNY_VARIANTS, "gemv"):
            if f"skinny_{v}_best" in r and r["rows"] == 1:
                best_tiles[f"{v}:{r['n']}:{r['k']}"] = r[f"skinny_{v}_best"]
    for t in totals:
        t["layers_best_tiles_s"] = {
            v: num_layers * sum(r[f"skinny_{v}_best_s"] for r in rows if r["rows"] == t["rows"])
            for v in (*fk.SKINNY_VARIANTS, "gemv")
            if all(f"skinny_{v}_best_s" in r for r in rows if r["rows"] == t["rows"])
        }
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth": bandwidth,
        "engine_skinny_variant": fk.SKINNY_VARIANT,
        "engine_one_row_path": fk.ONE_ROW_PATH,
        "engine_unit_scales_max_rows": fk.UNIT_SCALES_MAX_ROWS,
        "config": args.config,
        "num_layers": num_layers,
        "best_tiles": best_tiles,
        "rows": rows,
        "layer_totals": totals,
    }
    with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{num_layers} layers' qkv+o+gate_up+down, ms per step (GPU time in CUDA graphs)")
    cols = [
        "bf16_cublas",
        "bf16_skinny",
        "scaled_mm_per_tensor",
        "scaled_mm_rowwise",
        "scaled_mm_rowwise+quant",
        "scaled_mm_one_row",
        *[f"skinny_{v}" for v in (*fk.SKINNY_VARIANTS, "gemv")],
        "scaled_mm_unit_scales",
        "engine_fp8_linear",
    ]
    print("| rows | " + " | ".join(cols) + " | fp8 floor | bf16 floor |")
    print("|" + " --- |" * (len(cols) + 3))
    for t in totals:
        cells = [f"{t['layers_s'][c] * 1e3:.2f}" if c in t["layers_s"] else "-" for c in cols]
        print(
            f"| {t['rows']} | "
            + " | ".join(cells)
            + f" | {t['floor_fp8_s'] * 1e3:.2f} | {t['floor_bf16_s'] * 1e3:.2f} |"
        )
    for t in totals:
        if t["layers_best_tiles_s"]:
            best = ", ".join(f"{v} {s * 1e3:.2f}" for v, s in t["layers_best_tiles_s"].items())
            print(f"rows {t['rows']}, each shape at its best tiles (ms per step): {best}")


if __name__ == "__main__":
    main()
