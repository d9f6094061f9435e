"""Decode speed of the engine as it stands (reference torch attention, eager, no CUDA graphs) on a GPU.

`python -m bench.reference_decode --config llama-3.1-8b.json --out DIR`: synthesizes the checkpoint, measures the
device-to-device bandwidth, then time per decode step at a few batch sizes; prints a table, writes DIR/*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.checkpoint import synthesize
from engine import LLM, SamplingParams


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy (the HBM ceiling weights stream at)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def decode_step_seconds(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Median-free estimate: (last token time - first token time) / (new_tokens - 1), all sequences in lockstep."""
    prompts = [[(1000 + 7 * i + j) % 30000 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    outs = llm.generate(prompts, params)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return (last - first) / (new_tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    t0 = time.perf_counter()
    model_dir = synthesize(args.config, os.path.join(args.model_dir, args.config.removesuffix(".json")), device="cuda")
    synth_s = time.perf_counter() - t0
    bandwidth = copy_bandwidth()
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", max_model_len=4096)
    init_s = time.perf_counter() - t0
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    embed_bytes = runner.model.embed_tokens.weight.numel() * runner.model.embed_tokens.weight.element_size()
    if runner.model.lm_head is None:  # tied: the table is also the lm_head, read in full every step
        embed_bytes = 0
    floor_s = (weight_bytes - embed_bytes) / bandwidth  # the embedding table is only gathered, not read whole
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        step = decode_step_seconds(llm, batch, prompt_len=128, new_tokens=args.new_tokens)
        rows.append({"batch": batch, "ms_per_step": step * 1e3, "tok_s": batch / step, "roofline_frac": floor_s / step})
    result = {
        "config": args.config, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "copy_bandwidth_GBps": bandwidth / 1e9, "weight_GB": weight_bytes / 1e9, "floor_ms": floor_s * 1e3,
        "synthesize_s": synth_s, "engine_init_s": init_s, "num_kv_blocks": llm.engine.num_kv_blocks, "rows": rows,
    }
    with open(os.path.join(args.out, "reference_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['device']}, {args.config}, bf16, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
          f"weights {weight_bytes / 1e9:.2f} GB, floor {floor_s * 1e3:.2f} ms/step, init {init_s:.1f} s")
    print(f"{'batch':>5} {'ms/step':>9} {'tok/s':>9} {'of roofline':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ms_per_step']:>9.2f} {r['tok_s']:>9.1f} {r['roofline_frac']:>11.0%}")


if __name__ == "__main__":
    main()
