"""Per-kernel GPU time of the engine's captured decode step at a few batch sizes and context lengths
(one GPU).

`python -m bench.decode_profile --out DIR`: synthesizes the checkpoint, builds the engine, then
captures decode graphs with the fused decode kernels on and off and replays them over synthetic
contexts; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict

import torch

import engine.layers.skinny_gemm as skinny
from bench.checkpoint import CONFIGS, config_only_dir, synthesize
from bench.reference_decode import decode_step_seconds
from bench.roofline import copy_bandwidth
from engine import LLM, pdl
from engine.cuda_graphs import DecodeGraphs

SKINNY_ROWS = skinny.MAX_ROWS


def set_fused(runner, on: bool) -> None:
    """The decode fast path's kernels on (skinny GEMMs, merge inside attention, RoPE writing the
    cache) or off."""
    skinny.MAX_ROWS = SKINNY_ROWS if on else 0
    backend = runner.model.layers[0].self_attn.backend
    backend.fused_merge = on
    backend.accepts_written_kv = on


@torch.inference_mode()
def stage(graphs: DecodeGraphs, batch: int, context: int, num_blocks: int, block_size: int) -> int:
    """Stage `batch` sequences whose new token sits at position context - 1 (distinct blocks,
    wrapping around the cache when it is too small); returns the captured size that serves them."""
    per_seq = -(-context // block_size)
    tables = [[(i * per_seq + j) % num_blocks for j in range(per_seq)] for i in range(batch)]
    positions = [context - 1] * batch
    graphs.run([1000 + i for i in range(batch)], positions, positions, tables)
    return graphs.padded_size(batch)


def replay_seconds(graph: torch.cuda.CUDAGraph, calls: int = 20, repeats: int = 5) -> float:
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def kernel_tables(graph: torch.cuda.CUDAGraph, calls: int = 5) -> tuple[dict, dict]:
    """One profiler pass over `calls` replays: tables_from_trace's two tables."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as exported:
            trace = json.load(exported)
    return tables_from_trace(trace["traceEvents"], calls)


def tables_from_trace(events: list[dict], calls: int) -> tuple[dict, dict]:
    """From a chrome trace's kernel events over `calls` steps: kernel name -> {us per step,
    launches per step}, and kernel name with its launch grid -> {us per launch, launches per step}
    (one kernel's launches at different shapes, a layer's qkv, o_proj, gate_up and down GEMVs,
    apart); each sorted by time per step."""
    by_name: dict[str, list[float]] = defaultdict(list)
    by_grid: dict[str, list[float]] = defaultdict(list)
    for evt in events:
        if evt.get("cat") == "kernel":
            grid = "x".join(map(str, evt.get("args", {}).get("grid", [])))
            by_name[evt["name"]].append(evt["dur"])
            by_grid[f"{evt['name'][:60]} grid {grid}"].append(evt["dur"])
    kernels = {
        name: {"us": sum(durs) / calls, "launches": len(durs) / calls}
        for name, durs in by_name.items()
    }
    launches = {
        key: {"us": statistics.mean(durs), "launches": len(durs) / calls}
        for key, durs in by_grid.items()
    }
    return (
        dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])),
        dict(sorted(launches.items(), key=lambda kv: -kv[1]["us"] * kv[1]["launches"])),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument(
        "--cases",
        default="1:128,1:4096,64:1024,256:128,256:1024,256:2048",
        help="batch:context,...",
    )
    ap.add_argument("--profile-cases", default="1:128,256:1024")
    ap.add_argument(
        "--step-batches",
        default="1,64,256",
        help="host-inclusive decode step timings (engine.generate)",
    )
    ap.add_argument(
        "--variants", default="fused,unfused", help="which graphs to capture and replay"
    )
    ap.add_argument("--quantization", default=None, help="EngineArgs.quantization, e.g. fp8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="EngineArgs.kv_cache_dtype, e.g. fp8")
    ap.add_argument("--pdl", default="on", help="engine.pdl (programmatic dependent launch)")
    ap.add_argument(
        "--dummy", action="store_true", help="random weights made on the GPU (nothing written)"
    )
    args = ap.parse_args()
    pdl.ENABLED = args.pdl == "on"
    os.makedirs(args.out, exist_ok=True)
    if args.dummy:
        config = json.loads((CONFIGS / args.config).read_text())
        model_dir = config_only_dir(config, args.config.removesuffix(".json"), args.model_dir)
    else:
        model_dir = synthesize(
            args.config,
            os.path.join(args.model_dir, args.config.removesuffix(".json")),
            device="cuda",
        )
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    cases = [tuple(map(int, c.split(":"))) for c in args.cases.split(",")]
    profile_cases = {tuple(map(int, c.split(":"))) for c in args.profile_cases.split(",") if c}
    sizes = sorted({b for b, _ in cases})
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        cuda_graph_sizes=sizes,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format="dummy" if args.dummy else "auto",
    )
    runner = llm.engine.runner
    model = runner.model
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # the embedding table is only gathered
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv_bytes_per_token = (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * runner.kv_cache.element_size()
    )
    steps = {}
    for batch in map(int, filter(None, args.step_batches.split(","))):
        steps[batch] = decode_step_seconds(llm, batch, prompt_len=128, new_tokens=64)
        print(
            f"engine decode step b={batch}: {steps[batch] * 1e3:.2f} ms "
            f"({batch / steps[batch]:.0f} tok/s)",
            flush=True,
        )

    rows = []
    for fused in [name == "fused" for name in args.variants.split(",") if name]:
        set_fused(runner, fused)
        graphs = DecodeGraphs(
            model,
            runner.kv_cache,
            runner.stager,
            sizes,
            runner.max_model_len,
            runner.block_size,
            cfg.vocab_size,
        )
        graphs.capture()
        for batch, context in cases:
            size = stage(graphs, batch, context, runner.num_blocks, runner.block_size)
            seconds = replay_seconds(graphs.graphs[size])
            floor = (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth
            row = {
                "fused": fused,
                "batch": batch,
                "context": context,
                "graph_ms": seconds * 1e3,
                "floor_ms": floor * 1e3,
                "of_roofline": floor / seconds,
            }
            if (batch, context) in profile_cases:
                row["kernels"], row["launches"] = kernel_tables(graphs.graphs[size])
            rows.append(row)
            print(
                f"fused={fused} b={batch} ctx={context}: graph {seconds * 1e3:.3f} ms, "
                f"floor {floor * 1e3:.2f} ms ({row['of_roofline']:.0%})",
                flush=True,
            )
        del graphs
        torch.cuda.empty_cache()
    set_fused(runner, True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": args.config,
        "quantization": args.quantization,
        "pdl": pdl.ENABLED,
        "copy_bandwidth": bandwidth,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "engine_step_s": steps,
        "rows": rows,
    }
    with open(os.path.join(args.out, "decode_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    for row in rows:
        if "kernels" in row:
            print(
                f"\nkernels, fused={row['fused']} b={row['batch']} ctx={row['context']} "
                "(us per step, launches):"
            )
            for name, k in list(row["kernels"].items())[:14]:
                print(f"  {k['us']:9.1f} {k['launches']:6.0f}  {name[:90]}")
            print("  by launch shape (us per launch, launches per step):")
            for name, k in list(row["launches"].items())[:14]:
                print(f"  {k['us']:9.2f} {k['launches']:6.0f}  {name}")
    print(
        f"\n{result['device']}, {args.config}, {args.quantization or 'bf16'}, PDL {args.pdl}, "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
        f"weights read per step {weight_bytes / 1e9:.2f} GB"
    )
    print(
        "| batch | context | graph ms (fused) | graph ms (unfused) | floor ms "
        "| of roofline (fused) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for batch, context in cases:
        on = next(
            (r for r in rows if r["fused"] and (r["batch"], r["context"]) == (batch, context)), None
        )
        off = next(
            (r for r in rows if not r["fused"] and (r["batch"], r["context"]) == (batch, context)),
            None,
        )
        ref = on or off
        print(
            f"| {batch} | {context} | {on['graph_ms'] if on else float('nan'):.3f} | "
            f"{off['graph_ms'] if off else float('nan'):.3f} | {ref['floor_ms']:.2f} | "
            f"{ref['floor_ms'] / ref['graph_ms']:.0%} |"
        )
    for batch, seconds in steps.items():
        print(
            f"engine step (host included) b={batch}: {seconds * 1e3:.2f} ms, "
            f"{batch / seconds:.0f} tok/s"
        )


if __name__ == "__main__":
    main()
