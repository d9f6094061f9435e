"""Microbenchmark of the decoder's projections on one GPU (Llama-3.1-8B shapes, bf16): cuBLAS vs the
skinny GEMM.

`python -m bench.gemm_micro --out DIR`: GPU time inside CUDA graphs per (shape, rows), weights
rotated past the L2, as weight bytes per second over the measured copy bandwidth and TFLOP/s; a
sweep of the skinny tiles; writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from bench.attention_micro import time_call
from bench.roofline import copy_bandwidth
from bench.tiled_gemm import tiled_gemm
from engine.layers.skinny_gemm import MAX_ROWS, default_config, skinny_gemm

# (name, N, K): the fused qkv, o_proj, fused gate_up, down_proj, lm_head
SHAPES = [
    ("qkv", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
]


def candidates(n: int, k: int) -> list[tuple[int, int, int, int]]:
    """Skinny tiles to sweep (BLOCK_N, BLOCK_K, num_warps, num_stages), the default first."""
    grid = itertools.product((16, 32, 64), (128, 256, 512), ((4, 3), (4, 4), (8, 3)))
    configs = [(bn, bk, w, s) for bn, bk, (w, s) in grid]
    first = default_config(n, k)
    return [first] + [c for c in configs if c != first]


class Rotating:
    """Copies of one weight, more bytes than L2 holds, handed out in turn: each call reads its
    weight from HBM, as every layer of a model does (one weight called back to back would be served
    from the 50 MB L2)."""

    def __init__(self, n: int, k: int, min_bytes: int = 256 << 20) -> None:
        copies = max(2, -(-min_bytes // (n * k * 2)))
        self.weights = [
            (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16) for _ in range(copies)
        ]
        self.turn = 0

    def next(self) -> torch.Tensor:
        self.turn += 1
        return self.weights[self.turn % len(self.weights)]


def tiled_candidates() -> list[tuple[int, int, int, int, int, int]]:
    """Tiled-GEMM configs to sweep (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)."""
    grid = itertools.product((64, 128), (64, 128, 256), (1, 2, 4), ((4, 4), (8, 3)))
    return [(bm, bn, 64, sk, w, s) for bm, bn, sk, (w, s) in grid]


def measure(
    name: str, n: int, k: int, rows: int, sweep: bool, bandwidth: float, tiled_rows=()
) -> dict:
    weights = Rotating(n, k)
    w = weights.weights[0]
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    logits = torch.empty(rows, n, dtype=torch.float32, device="cuda") if name == "lm_head" else None

    # What the layers did before: cuBLAS, and a copy of the lm_head's logits into the fp32 buffer.
    def cublas():
        y = F.linear(x, weights.next())
        if logits is not None:
            logits.copy_(y)

    row = {
        "shape": name,
        "n": n,
        "k": k,
        "rows": rows,
        "weight_bytes": n * k * 2,
        "flops": 2 * rows * n * k,
        "cublas_s": time_call(cublas, graph=True),
    }
    if rows <= MAX_ROWS:
        ref = F.linear(x, w).float()
        tried = {}
        for config in candidates(n, k) if sweep else [default_config(n, k)]:

            def skinny(config=config, weight=None):
                return skinny_gemm(
                    x, weight if weight is not None else weights.next(), out=logits, config=config
                )

            try:
                err = (skinny(weight=w).float() - ref).abs().max().item()
                tried[":".join(map(str, config))] = {
                    "s": time_call(skinny, graph=True),
                    "max_abs_err": err,
                }
            except Exception as exc:  # a tile that does not fit shared memory: recorded, skipped
                tried[":".join(map(str, config))] = {"s": float("inf"), "error": str(exc)[:200]}
        best = min(tried, key=lambda c: tried[c]["s"])
        row.update(
            skinny_default_s=next(iter(tried.values()))["s"],
            skinny_best=best,
            skinny_best_s=tried[best]["s"],
            sweep=tried,
        )
    if rows in tiled_rows:
        ref = F.linear(x, w).float()
        # cuBLAS with the operands swapped (y^T = W x^T), then made row-major again
        row["cublas_swapped_s"] = time_call(
            lambda: torch.mm(weights.next(), x.t()).t().contiguous(), graph=True
        )
        tried = {}
        for config in tiled_candidates():

            def tiled(config=config, weight=None):
                return tiled_gemm(x, weight if weight is not None else weights.next(), config)

            try:
                err = (tiled(weight=w).float() - ref).abs().max().item()
                tried[":".join(map(str, config))] = {
                    "s": time_call(tiled, graph=True),
                    "max_abs_err": err,
                }
            except Exception as exc:  # a tile that does not fit shared memory: recorded, skipped
                tried[":".join(map(str, config))] = {"s": float("inf"), "error": str(exc)[:200]}
        best = min(tried, key=lambda c: tried[c]["s"])
        row.update(tiled_best=best, tiled_best_s=tried[best]["s"], tiled_sweep=tried)
    for key in (
        "cublas_s",
        "skinny_default_s",
        "skinny_best_s",
        "cublas_swapped_s",
        "tiled_best_s",
    ):
        if key in row:
            row[key.replace("_s", "_of_bw")] = row["weight_bytes"] / row[key] / bandwidth
            row[key.replace("_s", "_tflops")] = row["flops"] / row[key] / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument(
        "--sweep-rows", default="1,16", help="row counts at which the skinny tiles are swept"
    )
    ap.add_argument(
        "--tiled-rows", default="64,256", help="row counts at which the tiled GEMM is swept"
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    tiled_rows = {int(r) for r in args.tiled_rows.split(",") if r}
    rows = []
    for (name, n, k), m in itertools.product(SHAPES, map(int, args.rows.split(","))):
        rows.append(measure(name, n, k, m, m in sweep_rows, bandwidth, tiled_rows))
        r = rows[-1]
        extra = ""
        if "skinny_default_s" in r:
            extra = (
                f" skinny {r['skinny_default_s'] * 1e6:.1f} us ({r['skinny_default_of_bw']:.0%}), "
                f"best {r['skinny_best']} {r['skinny_best_s'] * 1e6:.1f} us"
            )
        if "tiled_best_s" in r:
            extra += (
                f" cublas swapped {r['cublas_swapped_s'] * 1e6:.1f} us, "
                f"tiled best {r['tiled_best']} {r['tiled_best_s'] * 1e6:.1f} us "
                f"({r['tiled_best_tflops']:.0f} TFLOP/s)"
            )
        print(
            f"{name} M={m}: cublas {r['cublas_s'] * 1e6:.1f} us ({r['cublas_of_bw']:.0%} bw, "
            f"{r['cublas_tflops']:.0f} TFLOP/s){extra}",
            flush=True,
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth": bandwidth,
        "rows": rows,
    }
    with open(os.path.join(args.out, "gemm_micro.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"\n{result['device']}, bf16, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
        "GPU time per call in CUDA graphs"
    )
    print(
        "| shape | N x K | rows | cuBLAS us | of bw | TFLOP/s | skinny us (default) "
        "| skinny best us (tiles) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        default = f"{r['skinny_default_s'] * 1e6:.1f}" if "skinny_default_s" in r else "-"
        best = (
            f"{r['skinny_best_s'] * 1e6:.1f} ({r['skinny_best']})" if "skinny_best_s" in r else "-"
        )
        print(
            f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['cublas_s'] * 1e6:.1f} | "
            f"{r['cublas_of_bw']:.0%} | {r['cublas_tflops']:.0f} | {default} | {best} |"
        )


if __name__ == "__main__":
    main()
