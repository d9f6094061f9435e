"""Batch-1 decode's linears with their prologue fused (engine/layers/row_gemv.py) against the
engine's unfused pair (the residual-add + RMSNorm or SiLU-and-mul kernel, then the linear's own
one-row kernel), at one model's shapes (Llama-3.1-8B's by default), bf16 and FP8 weights, with a
tile sweep of the fused kernel; o_proj (no prologue) is the linear's own kernel against row_gemv's.
A mixture-of-experts config gives the router instead of the MLP's linears.

`python -m bench.row_gemv --out DIR [--config NAME] [--weights bf16,fp8]`: GPU time per call inside
CUDA graphs, weights rotated past the L2 (bench/gemm_micro.py, bench/fp8_gemm.py), each beside the
byte floor of its weights at the measured copy bandwidth; the layers' sum per weight type; writes
DIR/row_gemv.json (its `best_tiles` feed bench/fp8_decode.py --row-tiles) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

import engine.layers.fused_linears as fl
import engine.layers.row_gemv as rg
from bench.attention_micro import time_call
from bench.checkpoint import CONFIGS
from bench.fp8_gemm import RotatingFp8
from bench.gemm_micro import Rotating
from bench.layer_shapes import layer_linears
from bench.roofline import copy_bandwidth
from engine.config import ModelConfig
from engine.layers import Linear, RMSNorm
from engine.quant.fp8 import Fp8Linear

# the prologue each linear's one-row kernel runs: the norm before qkv, gate_up and a router, the
# gate activation before down
PROLOGUES = {"qkv": rg.NORM, "o_proj": rg.PLAIN, "gate_up": rg.NORM, "down": rg.SILU_MUL,
             "router": rg.NORM}  # fmt: skip


def shapes(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, N, K, prologue) of a layer's one-row linears (bench.layer_shapes.layer_linears)."""
    return [(name, n, k, PROLOGUES[name]) for name, n, k in layer_linears(cfg)]


def candidates(fp8: bool, n: int) -> list[tuple[int, int, int, int]]:
    """Tiles to sweep (BLOCK_N, BLOCK_K, num_warps, num_stages); a few rows (a router) also take
    one or two rows per program and the whole row in one step."""
    block_ks = (256, 512, 1024) if fp8 else (128, 256, 512)
    block_ns = (4, 8, 16, 32)
    if n <= 256:
        block_ns, block_ks = (1, 2) + block_ns, block_ks + (1024, 2048)
    grid = itertools.product(block_ns, block_ks, ((4, 2), (4, 3), (8, 3)))
    return [(bn, bk, w, s) for bn, bk, (w, s) in grid]


def linear_of(weight: torch.Tensor, scale: torch.Tensor | None):
    """A Linear / Fp8Linear around one rotated weight (parameters replaced, not copied)."""
    n, k = weight.shape
    if scale is None:
        lin = Linear(k, n, False, torch.bfloat16, "meta")
        lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    else:
        lin = Fp8Linear(k, n, False, torch.bfloat16, "meta")
        lin.weight = torch.nn.Parameter(weight, requires_grad=False)
        lin.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    return lin


def measure(name: str, n: int, k: int, prologue: int, fp8: bool, bandwidth: float) -> dict:
    """The unfused pair, the fused kernel with default tiles, and the sweep, for one shape."""
    weights = RotatingFp8(n, k) if fp8 else Rotating(n, k)

    def next_linear():
        w = weights.next()
        return linear_of(*w) if fp8 else linear_of(w, None)

    norm = RMSNorm(k, 1e-5, torch.bfloat16, "cuda")
    norm.weight.data = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    x = torch.randn(1, 2 * k if prologue == rg.SILU_MUL else k, device="cuda")
    x, res = x.to(torch.bfloat16), torch.randn(1, k, device="cuda").to(torch.bfloat16)

    def unfused(lin=None):
        """The engine's pair: the norm (or SiLU-and-mul) kernel, then the linear's own kernel."""
        lin = lin or next_linear()
        if prologue == rg.PLAIN:
            return lin(x)
        if prologue == rg.SILU_MUL:
            return fl.act_linear(lin, x, "silu")
        return fl.norm_linear(norm, lin, x, res)[0]

    def fused(tiles=None, lin=None):
        """The one kernel (tiles None: default_config's), called as norm_linear and act_linear
        call it, here for FP8 weights too."""
        lin = lin or next_linear()
        scale = lin.weight_scale if fp8 else None
        if prologue in (rg.PLAIN, rg.SILU_MUL):
            return rg.row_gemv(x, lin.weight, scale, None, prologue, config=tiles)[0]
        return rg.row_gemv(
            x, lin.weight, scale, None, rg.NORM, norm.weight, norm.eps, res, config=tiles
        )[0]

    first = next_linear()  # the one the fused and unfused outputs are compared on
    fl.FUSE = False
    try:
        unfused_s = time_call(unfused, graph=True)
        reference = unfused(first).float()
    finally:
        fl.FUSE = True
    default = time_call(fused, graph=True)
    y = fused(lin=first).float()
    sweep = {}
    for tiles in candidates(fp8, n):
        key = ":".join(map(str, tiles))
        try:
            sweep[key] = time_call(lambda tiles=tiles: fused(tiles), graph=True)
        except Exception as exc:  # a tile that does not build on this GPU: recorded
            sweep[key] = f"{type(exc).__name__}: {str(exc)[:120]}"
    timed = {t: s for t, s in sweep.items() if isinstance(s, float)}
    best = min(timed, key=timed.get)
    floor = n * k * (1 if fp8 else 2) / bandwidth
    return {
        "name": name,
        "n": n,
        "k": k,
        "weights": "fp8" if fp8 else "bf16",
        "prologue": prologue,
        "unfused_s": unfused_s,
        "fused_default_s": default,
        "default_tiles": ":".join(map(str, rg.default_config(prologue, weights_dtype(fp8), n, k))),
        "best_tiles": best,
        "fused_best_s": timed[best],
        "floor_s": floor,
        "max_abs_diff_vs_unfused": (y - reference).abs().max().item(),
        "max_abs_unfused": reference.abs().max().item(),
        "sweep": sweep,
    }


def apply_best_tiles(path: str) -> None:
    """Make a row_gemv.json's best tiles the kernel's (engine.layers.row_gemv.TILE_OVERRIDES)."""
    with open(path) as f:
        best = json.load(f)["best_tiles"]
    for key, tiles in best.items():
        prologue, dtype, n, k = key.split(":")
        rg.TILE_OVERRIDES[(int(prologue), dtype, int(n), int(k))] = tuple(
            map(int, tiles.split(":"))
        )


def weights_dtype(fp8: bool) -> torch.dtype:
    return torch.float8_e4m3fn if fp8 else torch.bfloat16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--config", default="llama-3.1-8b.json", help="a file of bench/configs")
    ap.add_argument("--weights", default="bf16,fp8")
    ap.add_argument("--shapes", default="", help="only these linears, e.g. router,qkv")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / args.config).read_text()))
    num_layers = cfg.num_layers
    weight_types = args.weights.split(",")
    wanted = set(filter(None, args.shapes.split(",")))
    chosen = [shape for shape in shapes(cfg) if not wanted or shape[0] in wanted]
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    rows = []
    for fp8 in [w == "fp8" for w in weight_types]:
        for name, n, k, prologue in chosen:
            row = measure(name, n, k, prologue, fp8, bandwidth)
            rows.append(row)
            print(
                f"{row['weights']} {name}: unfused {row['unfused_s'] * 1e6:.1f} us, fused "
                f"{row['fused_default_s'] * 1e6:.1f} us (default {row['default_tiles']}), best "
                f"{row['fused_best_s'] * 1e6:.1f} us ({row['best_tiles']}), floor "
                f"{row['floor_s'] * 1e6:.1f} us, max diff {row['max_abs_diff_vs_unfused']:.3g} "
                f"of {row['max_abs_unfused']:.3g}",
                flush=True,
            )
    totals = {}
    for weights in weight_types:
        mine = [r for r in rows if r["weights"] == weights]
        totals[weights] = {
            key: num_layers * sum(r[key] for r in mine) * 1e3
            for key in ("unfused_s", "fused_default_s", "fused_best_s", "floor_s")
        }
    result = {
        "device": torch.cuda.get_device_name(),
        "config": args.config,
        "torch": torch.__version__,
        "copy_bandwidth": bandwidth,
        "rows": rows,
        "layers_ms": totals,
        "best_tiles": {
            f"{r['prologue']}:{'float8_e4m3fn' if r['weights'] == 'fp8' else 'bfloat16'}:"
            f"{r['n']}:{r['k']}": r["best_tiles"]
            for r in rows
        },
    }
    with open(os.path.join(args.out, "row_gemv.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, one row, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    names = " + ".join(name for name, *_ in chosen)
    print(f"{num_layers} layers' {names} of {args.config}, ms per step (GPU, CUDA graphs)")
    print("| weights | unfused | fused (default tiles) | fused (best tiles) | byte floor |")
    print("| --- | --- | --- | --- | --- |")
    for weights, t in totals.items():
        print(
            f"| {weights} | {t['unfused_s']:.3f} | {t['fused_default_s']:.3f} "
            f"| {t['fused_best_s']:.3f} | {t['floor_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
