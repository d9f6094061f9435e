"""Batch-1 decode of a mixture-of-experts model on one GPU against the roofline of the bytes a token
actually reads (the dense part plus the top_k selected experts of every sparse layer), with the
fused Triton MoE (engine/layers/fused_moe.py and fused_moe_decode.py) and with a per-expert loop of
plain matmuls (the torch reference); then the MoE layer alone at a few batch sizes, and a sweep of
the experts' tiles at decode batches, for both of fused_experts' paths (sorted by expert, and the
decode path).

`python -m bench.moe_decode --out DIR` (default: the Qwen3-30B-A3B shape, random bf16 weights made
on the GPU, nothing downloaded or written but DIR/moe_decode.json); prints a table.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import time
from pathlib import Path

import torch

import engine.layers.experts as experts_layer
import engine.layers.moe as moe_layer
import engine.layers.row_gemv as row_gemv
from bench.attention_micro import time_call
from bench.checkpoint import config_only_dir
from bench.reference_decode import decode_step_seconds, graph_replay_seconds
from bench.roofline import copy_bandwidth
from bench.row_gemv import apply_best_tiles
from bench.serving import config_path
from engine import LLM
from engine.config import ModelConfig
from engine.layers.fused_moe import MoeTiles, fused_experts, moe_tiles
from engine.layers.fused_moe_decode import DecodeTiles, GemvTile, decode_tiles, uses_decode_path
from engine.layers.moe import SparseMoeBlock, route_reference
from engine.layers.norm import RMSNorm

# Sorted-path tiles the sweep tries at decode batches: (BLOCK_N, BLOCK_K) of both GEMMs x
# (num_warps, stages).
SWEEP_TILES = list(
    itertools.product(
        [(16, 256), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256)], [(4, 2), (4, 3), (8, 3)]
    )
)
# Decode-path tiles the sweep tries, each kernel's alone (the other at its default): BLOCK_N (per
# kernel) x BLOCK_K x num_warps, kept to tiles of 16 to 64 float32 partial sums per thread (fewer
# leave too few bytes in flight per program, more spill registers).
DECODE_SWEEP_ROWS = {"gate_up": [4, 8, 16, 32], "down": [1, 2, 4, 8, 16, 32]}
DECODE_SWEEP_K = [128, 256, 512]
DECODE_SWEEP_WARPS = [4, 8]


def bytes_per_token(model, context: int) -> dict:
    """Bytes one batch-1 decode step reads: every parameter but the embedding table (gathered) and
    the experts, top_k / E of each layer's experts (the selected ones), and the KV cache of
    `context` tokens."""
    cfg = model.config
    experts_all = experts_read = dense = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.startswith("embed_tokens.") and model.lm_head is not None:
            continue
        if ".experts." in name:
            experts_all += nbytes
            experts_read += nbytes * cfg.moe.top_k // cfg.moe.num_experts
        else:
            dense += nbytes
    kv = context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    return {
        "dense": dense,
        "experts_selected": experts_read,
        "experts_all": experts_all,
        "kv": kv,
        "total": dense + experts_read + kv,
    }


def engine_rows(
    llm: LLM, bandwidth: float, prompt_len: int, new_tokens: int
) -> tuple[list[dict], dict]:
    """Batch-1 decode through the engine: fused MoE in CUDA graphs, then eager (graphs dropped)
    with the fused MoE and with the per-expert loop; and the bytes a step reads."""
    model = llm.engine.runner.model
    read = bytes_per_token(model, prompt_len + new_tokens // 2)
    floor_s = read["total"] / bandwidth
    rows = []
    variants = [("fused", True), ("fused", False), ("loop", False)]
    for impl, graphs in variants:
        if not graphs:
            llm.engine.runner.graphs = None  # decode steps run eager from here on
        experts_layer.EXPERTS_IMPL = "auto" if impl == "fused" else "loop"
        step = decode_step_seconds(llm, 1, prompt_len=prompt_len, new_tokens=new_tokens)
        replay = graph_replay_seconds(llm, 1) if graphs else None
        row = {
            "experts": impl,
            "cuda_graphs": graphs,
            "ms_per_step": step * 1e3,
            "tok_s": 1 / step,
            "floor_ms": floor_s * 1e3,
            "of_roofline": floor_s / step,
            "graph_replay_ms": None if replay is None else replay * 1e3,
            "graph_of_roofline": None if replay is None else floor_s / replay,
        }
        rows.append(row)
        print(
            f"engine b=1 experts={impl} graphs={graphs}: {step * 1e3:.2f} ms/step "
            f"({row['of_roofline']:.0%} of the {floor_s * 1e3:.2f} ms floor)"
            + (f", graph replay {replay * 1e3:.2f} ms" if replay else ""),
            flush=True,
        )
    experts_layer.EXPERTS_IMPL = "auto"
    return rows, read


def layer_rows(cfg: ModelConfig, bandwidth: float, batches: list[int], copies: int) -> list[dict]:
    """One sparse MLP alone as the decoder runs it (SparseMoeBlock.norm_forward: the norm before
    it, the router, the experts; `copies` layers cycled so the experts come from HBM, not L2):
    fused eager and in a CUDA graph, and the per-expert loop; bytes of the experts each batch
    selects over the time."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = []
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.bfloat16, "cuda")
    norm.weight.data.fill_(1.0)
    for _ in range(copies):
        block = SparseMoeBlock(cfg, torch.bfloat16, "cuda")
        for p in block.parameters():
            p.data.normal_(0.0, 0.02, generator=gen)
        blocks.append(block)
    per_expert = 3 * cfg.moe.expert_intermediate_size * cfg.hidden_size * 2
    rows = []
    for batch in batches:
        x = torch.randn(batch, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        residual = torch.randn(batch, cfg.hidden_size, device="cuda", generator=gen).to(x.dtype)
        with torch.inference_mode():
            normed = norm(x, residual)[0]
            selected = [int(b.route(normed)[1].unique().numel()) for b in blocks]
        nbytes = sum(selected) / copies * per_expert + cfg.moe.num_experts * cfg.hidden_size * 2
        row = {
            "batch": batch,
            "path": "decode" if uses_decode_path(batch) else "sorted",
            "experts_selected": sum(selected) / copies,
            "bytes": nbytes,
        }
        for impl, graph in [("fused", False), ("fused", True), ("loop", False)]:
            if graph and batch > 256:
                continue
            experts_layer.EXPERTS_IMPL = "auto" if impl == "fused" else "loop"
            turn = itertools.cycle(blocks)
            key = f"{impl}{'_graph' if graph else ''}"
            try:
                with torch.inference_mode():
                    seconds = time_call(
                        lambda: next(turn).norm_forward(norm, x, residual)[0],
                        graph,
                        calls=4 * copies,
                    )
            except RuntimeError as e:  # a capture that fails is a finding, not the end of the run
                row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"layer b={batch} {key}: {row[f'{key}_error']}", flush=True)
                continue
            row[f"{key}_us"] = seconds * 1e6
            row[f"{key}_of_roofline"] = nbytes / bandwidth / seconds
        experts_layer.EXPERTS_IMPL = "auto"
        rows.append(row)
        print(
            f"layer b={batch} ({row['path']} path): {row['experts_selected']:.0f} experts, "
            + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_us")),
            flush=True,
        )
    del blocks
    torch.cuda.empty_cache()
    return rows


def _normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """N(0, 0.02) bf16 weights on the GPU."""
    return (0.02 * torch.randn(shape, device="cuda", generator=gen)).to(torch.bfloat16)


def decode_sweep(top_k: int) -> list[tuple[str, DecodeTiles]]:
    """(which kernel the entry varies, tiles) of the decode path: the default first, then each
    gate_up tile with the default down tile, then each down tile with the default gate_up tile."""
    default = decode_tiles(top_k)
    slots = 1 << (top_k - 1).bit_length()  # the down kernel's tile holds every slot's rows
    entries = [("default", default)]
    for kernel, rows_per_step in (("gate_up", 2), ("down", slots)):
        sizes = itertools.product(DECODE_SWEEP_ROWS[kernel], DECODE_SWEEP_K, DECODE_SWEEP_WARPS)
        for n, k, warps in sizes:
            tile = GemvTile(n, k, warps)
            per_thread = rows_per_step * n * k // (32 * warps)
            if not 16 <= per_thread <= 64 or tile == getattr(default, kernel):
                continue
            entries.append((kernel, default._replace(**{kernel: tile})))
    return entries


def _time_experts(layers, x, weights, ids, tiles, copies: int) -> float:
    """Seconds per fused_experts call with these tiles in a CUDA graph, the layers cycled."""
    turn = itertools.cycle(layers)
    return time_call(
        lambda: fused_experts(x, *next(turn), weights, ids, tiles=tiles), True, calls=4 * copies
    )


def sweep_rows(cfg: ModelConfig, bandwidth: float, batches: list[int], copies: int) -> list[dict]:
    """The experts alone (fused_experts, routing fixed) in a CUDA graph: the sorted path for each
    of SWEEP_TILES at BLOCK_M 16 (its default first), and the decode path for each tile of
    decode_sweep; `copies` layers' experts cycled so they come from HBM."""
    moe, hidden = cfg.moe, cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    inter = moe.expert_intermediate_size
    layers = [
        (
            _normal((moe.num_experts, 2 * inter, hidden), gen),
            _normal((moe.num_experts, hidden, inter), gen),
        )
        for _ in range(copies)
    ]
    per_expert = 3 * moe.expert_intermediate_size * hidden * 2
    rows = []
    for batch in batches:
        x = torch.randn(batch, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(batch, moe.num_experts, device="cuda", generator=gen)
        weights, ids = route_reference(logits, moe.top_k, moe.norm_topk_prob)
        nbytes = int(ids.unique().numel()) * per_expert
        default = moe_tiles(batch, moe.num_experts, moe.top_k)
        swept = [MoeTiles(16, tile, tile, warps, stages) for tile, (warps, stages) in SWEEP_TILES]
        candidates = [("sorted", "default", default)]
        candidates += [("sorted", "both", tiles) for tiles in swept if tiles != default]
        candidates += [("decode", varied, tiles) for varied, tiles in decode_sweep(moe.top_k)]
        chosen = "decode" if uses_decode_path(batch) else "sorted"
        for path, varied, tiles in candidates:
            row = {
                "batch": batch,
                "path": path,
                "varied": varied,
                "tiles": [list(t) if isinstance(t, tuple) else t for t in tiles],
                "default": varied == "default" and path == chosen,
            }
            try:
                seconds = _time_experts(layers, x, weights, ids, tiles, copies)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is a finding
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                continue
            row.update(us=seconds * 1e6, of_roofline=nbytes / bandwidth / seconds)
            rows.append(row)
        _print_sweep(batch, [r for r in rows if r["batch"] == batch and "us" in r])
    del layers
    torch.cuda.empty_cache()
    return rows


def _print_sweep(batch: int, done: list[dict]) -> None:
    """Each path's default and best tiles at one batch; the decode path's best tile per kernel."""

    def show(r: dict) -> str:
        return f"{r['tiles']} {r['us']:.1f} us ({r['of_roofline']:.0%})"

    for path in ("sorted", "decode"):
        mine = [r for r in done if r["path"] == path]
        if not mine:
            continue
        first = next((r for r in mine if r["varied"] == "default"), None)
        best = min(mine, key=lambda r: r["us"])
        line = f"sweep b={batch} {path}: default {show(first) if first else '-'}, best {show(best)}"
        if path == "decode":
            for kernel in ("gate_up", "down"):
                tried = [r for r in mine if r["varied"] in (kernel, "default")]
                pick = min(tried, key=lambda r: r["us"])
                line += f"; best {kernel} {pick['tiles'][0 if kernel == 'gate_up' else 1]}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="qwen3-30b-a3b.json")
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layer-batches", default="1,2,4,8,16,32,64,256,1024,4096")
    ap.add_argument("--layer-copies", type=int, default=4)
    ap.add_argument("--sweep-batches", default="1,8", help="tile sweep of the experts alone")
    ap.add_argument("--skip-engine", action="store_true", help="only the layer microbenchmarks")
    ap.add_argument(
        "--route-in-kernel",
        default="on",
        help="engine.layers.moe.ROUTE_IN_KERNEL: decode batches route inside the experts' kernel",
    )
    ap.add_argument(
        "--pdl-prologues",
        default="off",
        help="engine.layers.row_gemv.PDL_PROLOGUES: the norm-prologue GEMVs launch early too",
    )
    ap.add_argument("--row-tiles", default="", help="a bench.row_gemv row_gemv.json's best tiles")
    args = ap.parse_args()
    if args.row_tiles:
        apply_best_tiles(args.row_tiles)
    moe_layer.ROUTE_IN_KERNEL = args.route_in_kernel == "on"
    row_gemv.PDL_PROLOGUES = args.pdl_prologues == "on"
    os.makedirs(args.out, exist_ok=True)
    config = json.loads(config_path(args.config).read_text())
    cfg = ModelConfig.from_dict(config)
    if cfg.moe is None:
        raise SystemExit(f"--config: {args.config} has no experts")
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": args.config,
        "dtype": "bfloat16",
        "copy_bandwidth": bandwidth,
        "route_in_kernel": moe_layer.ROUTE_IN_KERNEL,
        "pdl_prologues": row_gemv.PDL_PROLOGUES,
        "row_tile_overrides": {
            ":".join(map(str, k)): v for k, v in row_gemv.TILE_OVERRIDES.items()
        },
    }
    batches = [int(b) for b in args.layer_batches.split(",") if b]
    result["layer"] = layer_rows(cfg, bandwidth, batches, args.layer_copies)
    sweep = [int(b) for b in args.sweep_batches.split(",") if b]
    result["tile_sweep"] = sweep_rows(cfg, bandwidth, sweep, args.layer_copies)
    if not args.skip_engine:
        t0 = time.perf_counter()
        llm = LLM(
            model=config_only_dir(config, Path(args.config).stem, args.model_dir),
            load_format="dummy",
            dtype="bfloat16",
            device="cuda",
            max_model_len=4096,
            max_num_seqs=8,
            cuda_graph_sizes=[1],
        )
        result["engine_init_s"] = time.perf_counter() - t0
        result["engine"], result["bytes_per_token"] = engine_rows(
            llm, bandwidth, args.prompt_len, args.new_tokens
        )
        llm.shutdown()
        del llm
        gc.unfreeze()
        gc.collect()
    with open(os.path.join(args.out, "moe_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, {args.config}, bf16, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if "engine" in result:
        read = result["bytes_per_token"]
        print(
            f"bytes per token: dense {read['dense'] / 1e9:.2f} GB + selected experts "
            f"{read['experts_selected'] / 1e9:.2f} GB + KV {read['kv'] / 1e9:.3f} GB "
            f"(all experts {read['experts_all'] / 1e9:.1f} GB)"
        )
        print("| experts | CUDA graphs | ms/step | of roofline | graph replay ms |")
        print("| --- | --- | --- | --- | --- |")
        for r in result["engine"]:
            replay = "" if r["graph_replay_ms"] is None else f"{r['graph_replay_ms']:.2f}"
            print(
                f"| {r['experts']} | {r['cuda_graphs']} | {r['ms_per_step']:.2f} "
                f"| {r['of_roofline']:.0%} | {replay} |"
            )
    print(
        "\n| batch | fused path | experts read | fused us | fused graph us | loop us "
        "| fused of roofline |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in result["layer"]:
        cells = [
            f"{r[k]:.1f}" if k in r else "-" for k in ("fused_us", "fused_graph_us", "loop_us")
        ]
        best = max(r.get("fused_of_roofline", 0.0), r.get("fused_graph_of_roofline", 0.0))
        print(
            f"| {r['batch']} | {r['path']} | {r['experts_selected']:.0f} | {' | '.join(cells)} "
            f"| {best:.0%} |"
        )


if __name__ == "__main__":
    main()
