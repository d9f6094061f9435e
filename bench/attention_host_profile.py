"""Host time of one eager Triton attention call (a batch-1 decode over 4,096 tokens, Llama-3.1-8B
heads) with a bf16 and an FP8 cache: wall time per call with the GPU kept busy, then a cProfile of
300 calls each (what the Python side does per call). Prints only; the 2026-11-26 H100 output is in
bench/results/2026-11-26-h100-fp8-kv/prof_host.log.

`python -m bench.attention_host_profile`
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from bench.attention_micro import make_step
from engine.attention.triton_attn import TritonAttentionBackend


def main() -> None:
    backend = TritonAttentionBackend("cuda")
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        q, k, v, cache, meta = make_step(1, 4096, 1, 32, 8, 128, 16, torch.bfloat16, kv)

        def call():
            return backend.forward(q, k, v, cache, meta, 128**-0.5)

        for _ in range(20):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            call()
        host = (time.perf_counter() - t0) / 500
        torch.cuda.synchronize()
        print(f"{kv}: host {host * 1e6:.1f} us per forward", flush=True)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            call()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        print(text.getvalue()[:3500])


if __name__ == "__main__":
    main()
