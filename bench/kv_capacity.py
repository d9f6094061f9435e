"""KV capacity of an FP8 KV cache against the model-dtype one on this GPU: the engine started on a
random-weight checkpoint of a real architecture (bench/configs) once per KV cache dtype, at the
default gpu_memory_utilization; the tokens its cache holds, the cache's bytes and the sizing's
inputs. Then a short greedy decode with each, as a smoke check of the FP8 engine path.

`python -m bench.kv_capacity --config llama-3.1-8b.json --out DIR` writes DIR/kv_capacity.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from bench.checkpoint import synthesize
from engine import LLM, EngineArgs, SamplingParams


def measure(model_dir: str, kv_cache_dtype: str, args) -> dict:
    engine_args = EngineArgs(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        kv_cache_dtype=kv_cache_dtype,
        load_format="safetensors",
        max_model_len=args.max_model_len,
    )
    t0 = time.perf_counter()
    llm = LLM(engine_args=engine_args)
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    cache = runner.kv_cache
    prompts = [list(range(1000 + 97 * i, 1000 + 97 * i + args.prompt_len)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    generate_s = time.perf_counter() - t0
    row = {
        "kv_cache_dtype": kv_cache_dtype,
        "cache_dtype": str(cache.dtype).removeprefix("torch."),
        "tokens": runner.num_blocks * runner.block_size,
        "blocks": runner.num_blocks,
        "block_size": runner.block_size,
        "bytes_per_token": runner.bytes_per_block // runner.block_size,
        "kv_gib": cache.numel() * cache.element_size() / (1 << 30),
        "gpu_memory_utilization": engine_args.gpu_memory_utilization,
        "step_allowance_gib": (runner.kv_step_bytes or 0) / (1 << 30),
        "start_s": start_s,
        "generate_8x_s": generate_s,
        "greedy_tokens": [o.outputs[0].token_ids for o in outs],
    }
    llm.shutdown()
    del llm, runner, cache, outs
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument("--checkpoint", default="/tmp/kv-capacity-ckpt")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--kv-dtypes", default="auto,fp8")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = synthesize(args.config, args.checkpoint, device="cuda")
    synth_s = time.perf_counter() - t0
    rows = [measure(model_dir, kv, args) for kv in args.kv_dtypes.split(",")]
    base = rows[0]
    for r in rows:
        r["tokens_vs_first"] = r["tokens"] / base["tokens"]
        r["greedy_leading_agreement_vs_first"] = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            for a, b in zip(r["greedy_tokens"], base["greedy_tokens"])
        ]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": args.config,
        "synthesize_s": synth_s,
        "rows": rows,
    }
    with open(os.path.join(args.out, "kv_capacity.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, {args.config} (random bf16 weights)")
    print("| KV cache | tokens | x first | GiB | bytes/token | start s | 8x generate s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['kv_cache_dtype']} ({r['cache_dtype']}) | {r['tokens']:,} "
            f"| {r['tokens_vs_first']:.2f} | {r['kv_gib']:.2f} | {r['bytes_per_token']:,} "
            f"| {r['start_s']:.1f} | {r['generate_8x_s']:.2f} |"
        )
        print(f"  greedy leading agreement vs first: {r['greedy_leading_agreement_vs_first']}")


if __name__ == "__main__":
    main()
