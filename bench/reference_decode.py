"""Decode speed of the engine on a GPU: the fast path (Triton attention, fused layers, CUDA graphs)
or, with --enforce-eager, eager PyTorch, with async and sync scheduling; --profile adds a
torch.profiler table of batch-1 decode.

`python -m bench.reference_decode --config llama-3.1-8b.json --out DIR`: synthesizes the checkpoint,
measures the device-to-device bandwidth, then time per decode step at a few batch sizes; prints a
table, writes DIR/*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.checkpoint import synthesize
from bench.roofline import copy_bandwidth
from engine import LLM, SamplingParams


def decode_step_seconds(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Median-free estimate: (last token time - first token time) / (new_tokens - 1), all sequences
    in lockstep."""
    prompts = [[(1000 + 7 * i + j) % 30000 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    # Warm-up at the same batch: captures its CUDA graphs (lazily captured otherwise, inside the
    # timed window).
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    outs = llm.generate(prompts, params)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return (last - first) / (new_tokens - 1)


def graph_replay_seconds(llm: LLM, batch: int, repeats: int = 50) -> float | None:
    """GPU time of one captured decode step (model + logits, no host work), by CUDA events; None
    without graphs."""
    graphs = llm.engine.runner.graphs
    size = graphs.padded_size(batch) if graphs is not None else None
    if size is None:
        return None
    graph = graphs.graphs[size]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def profile_decode(llm: LLM, out_dir: str) -> str:
    """torch.profiler over a few batch-1 decode steps: the kernels by total CUDA time, written to
    profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    prompt = [[(1000 + j) % 30000 for j in range(128)]]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    with open(os.path.join(out_dir, "profile.txt"), "w") as f:
        f.write(table)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--batches", default="1,8,32,64,256")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--profile", action="store_true", help="write a torch.profiler table of batch-1 decode"
    )
    ap.add_argument(
        "--scheduling",
        default="async,sync",
        help="comma list of async (step N+1 launched before step N's tokens are read) and sync",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    t0 = time.perf_counter()
    model_dir = synthesize(
        args.config, os.path.join(args.model_dir, args.config.removesuffix(".json")), device="cuda"
    )
    synth_s = time.perf_counter() - t0
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        enforce_eager=args.enforce_eager,
    )
    init_s = time.perf_counter() - t0
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    embed_bytes = (
        runner.model.embed_tokens.weight.numel() * runner.model.embed_tokens.weight.element_size()
    )
    if runner.model.lm_head is None:  # tied: the table is also the lm_head, read in full every step
        embed_bytes = 0
    floor_s = (
        weight_bytes - embed_bytes
    ) / bandwidth  # the embedding table is only gathered, not read whole
    rows = []
    modes = [m.strip() for m in args.scheduling.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("async", "sync"):
            raise SystemExit(f"--scheduling: each entry must be async or sync, got {mode!r}")
        llm.engine.async_scheduling = mode == "async"
        for batch in [int(b) for b in args.batches.split(",")]:
            step = decode_step_seconds(llm, batch, prompt_len=128, new_tokens=args.new_tokens)
            replay = graph_replay_seconds(llm, batch)
            rows.append(
                {
                    "scheduling": mode,
                    "batch": batch,
                    "ms_per_step": step * 1e3,
                    "tok_s": batch / step,
                    "roofline_frac": floor_s / step,
                    "graph_replay_ms": None if replay is None else replay * 1e3,
                }
            )
    llm.engine.async_scheduling = modes[0] == "async"
    if args.profile:
        print(profile_decode(llm, args.out))
    graphs = llm.engine.runner.graphs
    result = {
        "config": args.config,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "mode": "eager" if graphs is None else "cuda graphs",
        "attention": llm.engine.runner.model.layers[0].self_attn.backend.name,
        "graph_capture_s": None if graphs is None else graphs.capture_seconds,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "weight_GB": weight_bytes / 1e9,
        "floor_ms": floor_s * 1e3,
        "synthesize_s": synth_s,
        "engine_init_s": init_s,
        "num_kv_blocks": llm.engine.num_kv_blocks,
        "rows": rows,
    }
    name = "reference_decode.json" if graphs is None else "fast_decode.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"{result['device']}, {args.config}, bf16, {result['mode']}, "
        f"{result['attention']} attention, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
        f"weights {weight_bytes / 1e9:.2f} GB, floor {floor_s * 1e3:.2f} ms/step, "
        f"init {init_s:.1f} s"
    )
    print(
        f"{'scheduling':>10} {'batch':>5} {'ms/step':>9} {'tok/s':>9} {'of roofline':>12} "
        f"{'graph replay ms':>16}"
    )
    for r in rows:
        replay = "-" if r["graph_replay_ms"] is None else f"{r['graph_replay_ms']:.2f}"
        print(
            f"{r['scheduling']:>10} {r['batch']:>5} {r['ms_per_step']:>9.2f} {r['tok_s']:>9.1f} "
            f"{r['roofline_frac']:>11.0%} {replay:>16}"
        )


if __name__ == "__main__":
    main()
