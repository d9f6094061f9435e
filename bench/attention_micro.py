"""Microbenchmark of the Triton paged attention backend on one GPU, Llama-3.1-8B-shaped (32 q / 8 kv
heads, D 128).

`python -m bench.attention_micro --out DIR`: decode KV bytes read per step / time against the
measured copy bandwidth, prefill TFLOP/s against torch SDPA on the same (dense) shapes, GPU time
inside CUDA graphs (eager decode too, which adds the host's launch cost), split merge inside the
kernel vs a second launch; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench.roofline import copy_bandwidth
from bench.trace import running_contexts
from engine.attention import AttentionMetadata, kv_cache_shape
from engine.attention.kv_quant import KV_CACHE_DTYPES, quantize, resolve_kv_cache_dtype
from engine.attention.torch_ref import TorchAttentionBackend
from engine.attention.triton_attn import TritonAttentionBackend


def make_step(
    batch: int,
    context: int | list[int],
    query_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
):
    """Random q/k/v, a one-layer cache (in kv_dtype, default dtype) and metadata: `batch` sequences
    of `context` tokens (one figure, or one per sequence), the last query_len of each new."""
    contexts = [context] * batch if isinstance(context, int) else list(context)
    seq_blocks = [-(-c // block_size) for c in contexts]
    num_blocks = sum(seq_blocks)
    cache = torch.randn(
        kv_cache_shape(1, num_blocks, block_size, kv_heads, head_dim), dtype=dtype, device="cuda"
    )[0]
    if kv_dtype is not None and kv_dtype != dtype:
        cache = quantize(cache, 1.0, kv_dtype)
    # each sequence's pages scattered over the cache, its table row padded with page 0
    pages = torch.randperm(num_blocks, device="cuda").to(torch.int32).split(seq_blocks)
    tables = torch.zeros(batch, max(seq_blocks), dtype=torch.int32, device="cuda")
    slots = []
    for row, (seq_pages, c) in enumerate(zip(pages, contexts)):
        tables[row, : len(seq_pages)] = seq_pages
        pos = torch.arange(c - query_len, c, device="cuda")
        slots.append(seq_pages[pos // block_size].long() * block_size + pos % block_size)
    tokens = batch * query_len
    starts = list(range(0, tokens + 1, query_len))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(contexts, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        max_query_len=query_len,
        max_seq_len=max(contexts),
        query_start_loc_cpu=starts,
        seq_lens_cpu=contexts,
        block_size=block_size,
    )
    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device="cuda")
    v = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device="cuda")
    return q, k, v, cache, meta


def time_call(
    fn, graph: bool, calls: int = 20, repeats: int = 7, capture_error_mode: str = "global"
) -> float:
    """Median seconds per call: `calls` back-to-back calls, captured in one CUDA graph when
    `graph`."""
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode=capture_error_mode):
            for _ in range(calls):
                fn()
        run = g.replay
    else:

        def run():
            for _ in range(calls):
                fn()

    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def decode_rows(args, bandwidth: float, dtype: torch.dtype, kv_name: str) -> list[dict]:
    rows = []
    decode_configs = [None] + [
        tuple(map(int, c.split(":"))) for c in args.decode_sweep.split(",") if c
    ]
    for batch in map(int, args.batches.split(",")):
        for context_name in args.contexts.split(","):
            context = (
                running_contexts(batch, seed=0) if context_name == "conv" else int(context_name)
            )
            kv_dtype = resolve_kv_cache_dtype(kv_name, dtype)
            q, k, v, cache, meta = make_step(
                batch,
                context,
                1,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.block_size,
                dtype,
                kv_dtype,
            )
            kv_tokens = int(meta.seq_lens.sum())
            kv_bytes = kv_tokens * args.kv_heads * args.head_dim * 2 * cache.element_size()
            scale = args.head_dim**-0.5
            results = {}
            # each split target: programs per SM, or splits per (sequence, kv head) at this batch
            targets = [f"pps={pps}" for pps in args.programs_per_sm.split(",")] + [
                f"splits={n}" for n in args.decode_splits.split(",") if n
            ]
            for target in targets:
                kind, _, count = target.partition("=")
                for tiles in decode_configs:
                    for fused in map(int, args.fused_merge.split(",")):
                        backend = TritonAttentionBackend(
                            "cuda",
                            programs_per_sm=int(count) if kind == "pps" else 1,
                            decode_tiles=tiles,
                            fused_merge=bool(fused),
                        )
                        if kind == "splits":
                            backend.target_programs = int(count) * batch * args.kv_heads
                        seconds = time_call(
                            lambda: backend.forward(q, k, v, cache, meta, scale), graph=True
                        )
                        results[f"{target} tiles={tiles} fused_merge={fused}"] = seconds
            default = TritonAttentionBackend("cuda")
            eager = time_call(lambda: default.forward(q, k, v, cache, meta, scale), graph=False)
            ref = TorchAttentionBackend()
            reference = (
                time_call(
                    lambda: ref.forward(q, k, v, cache, meta, scale),
                    graph=False,
                    calls=3,
                    repeats=3,
                )
                if args.reference
                else None
            )
            best_name = min(results, key=results.get)
            first = next(iter(results))
            rows.append(
                {
                    "kind": "decode",
                    "kv_dtype": kv_name,
                    "batch": batch,
                    "context": context_name,
                    "kv_tokens": kv_tokens,
                    "kv_bytes": kv_bytes,
                    "graph_s": results[first],
                    "eager_s": eager,
                    "reference_s": reference,
                    "of_bandwidth": kv_bytes / results[first] / bandwidth,
                    "best": best_name,
                    "best_of_bandwidth": kv_bytes / results[best_name] / bandwidth,
                    "sweep": results,
                }
            )
            print(
                f"decode kv={kv_name} b={batch} ctx={context_name}: {results[first] * 1e6:.1f} us "
                f"({rows[-1]['of_bandwidth']:.0%} of copy bw), "
                f"best {best_name} {rows[-1]['best_of_bandwidth']:.0%}",
                flush=True,
            )
            # Drop this step's tensors before the next one is made (the lambdas above are done).
            q = k = v = cache = meta = None
            torch.cuda.empty_cache()
    return rows


def prefill_cases(spec: str, prefill: int) -> list[tuple[int, int, int]]:
    """(sequences, context, new tokens) from "SEQS:CONTEXT:NEW,..."; empty: a fresh prompt of
    `prefill` tokens, a batch of 8 short prompts, a chunk of a quarter after a cached prefix."""
    if not spec:
        return [(1, prefill, prefill), (8, 512, 512), (1, prefill, prefill // 4)]
    cases = []
    for case in spec.split(","):
        seqs, context, new = (int(x) for x in case.split(":"))
        if not 0 < new <= context or seqs < 1:
            raise SystemExit(f"--prefill-cases: {case!r} needs SEQS >= 1 and 0 < NEW <= CONTEXT")
        cases.append((seqs, context, new))
    return cases


def prefill_rows(args, dtype: torch.dtype, kv_name: str) -> list[dict]:
    rows = []
    prefill_configs = [None] + [
        tuple(map(int, c.split(":"))) for c in args.prefill_sweep.split(",") if c
    ]
    group = args.heads // args.kv_heads
    for batch, context, new in prefill_cases(args.prefill_cases, args.prefill):
        q, k, v, cache, meta = make_step(
            batch,
            context,
            new,
            args.heads,
            args.kv_heads,
            args.head_dim,
            args.block_size,
            dtype,
            resolve_kv_cache_dtype(kv_name, dtype),
        )
        # (query, key) pairs under the causal mask
        visible = batch * sum(context - new + i + 1 for i in range(new))
        flops = 4 * args.heads * args.head_dim * visible
        scale = args.head_dim**-0.5
        results = {}
        for tiles in prefill_configs:
            backend = TritonAttentionBackend("cuda", prefill_tiles=tiles)
            results[f"tiles={tiles}"] = time_call(
                lambda: backend.forward(q, k, v, cache, meta, scale), graph=True, calls=5
            )
        # Baseline: torch SDPA (flash) on dense, contiguous [batch, heads, S, D] tensors, K/V
        # repeated for GQA.
        qd = q.view(batch, new, args.heads, args.head_dim).transpose(1, 2)
        kd = torch.randn(batch, args.heads, context, args.head_dim, dtype=dtype, device="cuda")
        vd = torch.randn_like(kd)
        sdpa = None
        if new == context and args.sdpa:
            sdpa = time_call(
                lambda: torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True
                ),
                graph=True,
                calls=5,
            )
        best_name = min(results, key=results.get)
        first = next(iter(results))
        rows.append(
            {
                "kind": "prefill",
                "kv_dtype": kv_name,
                "batch": batch,
                "context": context,
                "new_tokens": new,
                "flops": flops,
                "seconds": results[first],
                "tflops": flops / results[first] / 1e12,
                "best": best_name,
                "best_tflops": flops / results[best_name] / 1e12,
                "sdpa_tflops": flops / sdpa / 1e12 if sdpa else None,
                "sweep": results,
                "group": group,
            }
        )
        print(
            f"prefill kv={kv_name} b={batch} ctx={context} new={new}: "
            f"{rows[-1]['tflops']:.0f} TFLOP/s, "
            f"best {best_name} {rows[-1]['best_tflops']:.0f}, sdpa {rows[-1]['sdpa_tflops']}",
            flush=True,
        )
        q = k = v = cache = meta = kd = vd = None  # free before the next configuration
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Two panels: decode KV read rate as a share of the copy bandwidth; prefill TFLOP/s beside
    SDPA."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["kind"] == "decode"]
    prefill = [r for r in rows if r["kind"] == "prefill"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(
        [f"{r['kv_dtype']}\nb{r['batch']}\nctx{r['context']}" for r in decode],
        [100 * r["of_bandwidth"] for r in decode],
    )
    left.set_ylabel("% of copy bandwidth")
    left.set_title("decode (CUDA graph)")
    labels = [f"{r['batch']}x{r['new_tokens']}\nctx{r['context']}" for r in prefill]
    x = range(len(prefill))
    right.bar([i - 0.2 for i in x], [r["tflops"] for r in prefill], width=0.4, label="triton paged")
    right.bar(
        [i + 0.2 for i in x],
        [r["sdpa_tflops"] or 0 for r in prefill],
        width=0.4,
        label="SDPA dense",
    )
    right.set_xticks(list(x), labels)
    right.set_ylabel("TFLOP/s")
    right.set_title("prefill")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument(
        "--contexts",
        default="1024,4096,conv",
        help="decode contexts: token counts, or conv (each sequence's own, as a closed-loop load "
        "on the conv trace holds them: bench.trace.running_contexts)",
    )
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument(
        "--prefill-cases",
        default="",
        help="SEQS:CONTEXT:NEW,... (e.g. a mixed step's prompts: 2:1200:384); default: a fresh "
        "prompt of --prefill tokens, 8 x 512, a quarter of --prefill after the rest cached",
    )
    ap.add_argument(
        "--programs-per-sm",
        default="8",
        help="decode split targets to try, the first is the default",
    )
    ap.add_argument(
        "--decode-splits",
        default="",
        help="decode split counts to try (splits per sequence and kv head), after the pps targets",
    )
    ap.add_argument(
        "--fused-merge",
        default="1,0",
        help="decode split merge in the kernel (1) or a second launch (0)",
    )
    ap.add_argument(
        "--decode-sweep", default="", help="extra decode tiles M:N:warps:stages[:registers],..."
    )
    ap.add_argument(
        "--prefill-sweep", default="", help="extra prefill tiles M:N:warps:stages[:registers],..."
    )
    ap.add_argument(
        "--kv-dtypes",
        default="auto",
        help=f"KV cache dtypes to run every row with, of {', '.join(KV_CACHE_DTYPES)}",
    )
    ap.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip timing the torch reference decode",
    )
    ap.add_argument("--no-sdpa", dest="sdpa", action="store_false", help="skip the SDPA baseline")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    rows = []
    for kv_name in args.kv_dtypes.split(","):
        rows += decode_rows(args, bandwidth, dtype, kv_name) + prefill_rows(args, dtype, kv_name)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth": bandwidth,
        "shape": vars(args),
        "rows": rows,
    }
    with open(os.path.join(args.out, "attention_micro.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, os.path.join(args.out, "attention_micro.png"))
    print(
        f"\n{result['device']}, bf16, H={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
        f"block={args.block_size}; copy bandwidth {bandwidth / 1e12:.2f} TB/s"
    )
    print(
        "| KV | decode batch | context | KV MB | us/step (graph) | us (eager) | us (torch ref) "
        "| of copy bw |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["kind"] == "decode":
            ref = f"{r['reference_s'] * 1e6:.0f}" if r["reference_s"] else "-"
            print(
                f"| {r['kv_dtype']} | {r['batch']} | {r['context']} | {r['kv_bytes'] / 1e6:.0f} "
                f"| {r['graph_s'] * 1e6:.1f} | {r['eager_s'] * 1e6:.1f} "
                f"| {ref} | {r['of_bandwidth']:.0%} |"
            )
    print("| KV | prefill seqs | context | new tokens | ms | TFLOP/s | SDPA TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["kind"] == "prefill":
            sdpa = f"{r['sdpa_tflops']:.0f}" if r["sdpa_tflops"] else "-"
            print(
                f"| {r['kv_dtype']} | {r['batch']} | {r['context']} | {r['new_tokens']} "
                f"| {r['seconds'] * 1e3:.2f} | {r['tflops']:.0f} | {sdpa} |"
            )


if __name__ == "__main__":
    main()
