"""Batch-1 decode of a Llama-3.1-8B-shaped model, FP8 W8A8 (EngineArgs.quantization "fp8") beside
bf16 in the same run, each against the roofline of the bytes its token reads (bench/moe_decode.py's
count: every parameter at its stored size but the gathered embedding table, plus the KV cache), with
random weights made on the GPU (load_format "dummy"), CUDA graphs on.

`python -m bench.fp8_decode --out DIR` writes DIR/fp8_decode.json and prints a table. --paths
measures FP8 once per decode kernel choice (engine/quant/fp8_kernels.py: ONE_ROW_PATH, and
SKINNY_VARIANT for "skinny:<variant>"); --tiles takes bench/fp8_gemm.py's JSON and uses its swept
best tiles. --prologues off,on measures bf16 with engine/layers/row_gemv.py's fused norm and
activation prologues off, then on (--row-tiles: bench/row_gemv.py's JSON, its best tiles); FP8
linears take none.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench import family_decode
from bench.roofline import copy_bandwidth
from bench.row_gemv import apply_best_tiles
from engine import pdl
from engine.attention import triton_attn
from engine.layers import fused_linears as fl, row_gemv as rg
from engine.quant import fp8_kernels as fk


def decode_row(
    name: str, root: str, quantization: str | None, bandwidth: float, prompt_len: int, new: int
) -> dict:
    measured = family_decode.decode_row(name, root, bandwidth, prompt_len, new, quantization)
    step = measured["ms_per_step"] / 1e3
    floor = measured["floor_ms"] / 1e3
    row = {
        "config": name,
        "quantization": quantization or "none (bf16)",
        **{k: v for k, v in measured.items() if k != "config"},
        "tokens_per_s": 1 / step,
        "roofline_tokens_per_s": 1 / floor,
    }
    print(
        f"{name} {row['quantization']}: {step * 1e3:.2f} ms/step ({1 / step:.0f} tok/s), "
        f"{row['of_roofline']:.0%} of the {floor * 1e3:.2f} ms floor "
        f"({row['gb_per_token']:.2f} GB/token), graph replay {row['graph_replay_ms']} ms",
        flush=True,
    )
    return row


def fp8_rows(paths: str, measure) -> list[dict]:
    """FP8 rows, one per decode kernel choice in `paths` (default: as is)."""
    rows = []
    for path in [p for p in paths.split(",") if p] or [""]:
        if path:
            fk.ONE_ROW_PATH, _, variant = path.partition(":")
            fk.SKINNY_VARIANT = variant or fk.SKINNY_VARIANT
        try:
            row = measure("fp8")
        except Exception as exc:  # a kernel choice that fails to build: recorded, the rest run
            print(f"fp8 {path}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append({"fp8_path": path, "error": str(exc)[:500]})
            continue
        row["fp8_one_row_path"] = fk.ONE_ROW_PATH
        row["fp8_skinny_variant"] = fk.SKINNY_VARIANT
        row["quantization"] = f"fp8 ({fk.ONE_ROW_PATH}, {fk.SKINNY_VARIANT})"
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--paths", default="", help="e.g. skinny:w8a16,gemv,scaled_mm (default: as is)")
    ap.add_argument("--tiles", default="", help="fp8_gemm.json whose best_tiles to use")
    ap.add_argument("--prologues", default="on", help="off,on: row_gemv's fusion off, then on")
    ap.add_argument("--row-tiles", default="", help="row_gemv.json whose best_tiles to use")
    ap.add_argument(
        "--pdl",
        default="on",
        help="off,on: engine.pdl (programmatic dependent launch) off, then on",
    )
    ap.add_argument(
        "--min-split-tiles", default="", help="e.g. 1,2,4: triton_attn.MIN_SPLIT_TILES each"
    )
    ap.add_argument(
        "--fp8-prologues", default="off", help="off,on: FP8 linears take row_gemv's prologues"
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.tiles:
        best = json.loads(Path(args.tiles).read_text())["best_tiles"]
        for key, tiles in best.items():
            variant, n, k = key.split(":")
            fk.TILE_OVERRIDES[(variant, int(n), int(k))] = tuple(map(int, tiles.split(":")))
    if args.row_tiles:
        apply_best_tiles(args.row_tiles)
    bandwidth = copy_bandwidth("cuda", 2 << 30)

    def measure(q):
        return decode_row(
            args.config, args.model_dir, q, bandwidth, args.prompt_len, args.new_tokens
        )

    rows = []
    settings = [
        (p, int(t) if t else triton_attn.MIN_SPLIT_TILES)
        for p in args.pdl.split(",")
        for t in (args.min_split_tiles.split(",") if args.min_split_tiles else [""])
    ]
    for pdl_setting, min_tiles in settings:
        pdl.ENABLED = pdl_setting == "on"
        triton_attn.MIN_SPLIT_TILES = min_tiles
        print(f"programmatic dependent launch: {pdl_setting}, min split tiles {min_tiles}")
        for setting in args.prologues.split(","):  # bf16 only: FP8 linears take no prologue
            fl.FUSE = setting == "on"
            rows.append(
                dict(measure(None), fused_prologues=fl.FUSE, pdl=pdl.ENABLED, min_tiles=min_tiles)
            )
        fl.FUSE = True
        for setting in args.fp8_prologues.split(","):
            fl.FUSE_FP8 = setting == "on"
            rows += [
                dict(row, fused_prologues=fl.FUSE_FP8, pdl=pdl.ENABLED, min_tiles=min_tiles)
                for row in fp8_rows(args.paths, measure)
            ]
        fl.FUSE_FP8 = False
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth": bandwidth,
        "batch": 1,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "tile_overrides": {":".join(map(str, k)): v for k, v in fk.TILE_OVERRIDES.items()},
        "row_tile_overrides": {":".join(map(str, k)): v for k, v in rg.TILE_OVERRIDES.items()},
        "rows": rows,
    }
    with open(os.path.join(args.out, "fp8_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, batch 1, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(
        "| weights | prologues fused | PDL | min split tiles | GB per token | ms/step | tok/s "
        "| floor ms | of roofline |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            continue
        print(
            f"| {r['quantization']} | {r['fused_prologues']} | {r.get('pdl', False)} "
            f"| {r.get('min_tiles', 1)} "
            f"| {r['gb_per_token']:.2f} "
            f"| {r['ms_per_step']:.2f} "
            f"| {r['tokens_per_s']:.0f} | {r['floor_ms']:.2f} | {r['of_roofline']:.0%} |"
        )


if __name__ == "__main__":
    main()
