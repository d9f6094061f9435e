"""Where the first token's time goes once torch is up: cProfile of the engine's imports, its build and the first
one-token generate, in a fresh process, with the weights already on the GPU (streamed during `import torch`).

`python -m bench.first_token_profile MODEL_DIR [--top 40]`: run it twice (the first run writes the pack).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dir")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    import cache.device_stream
    from warmup.start import start_warmup

    warm = start_warmup()
    cache.device_stream.start(args.model_dir)
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    stamps = {"torch_and_cuda": time.perf_counter() - T0}
    if warm is not None:
        warm.install()
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    from engine import LLM, SamplingParams

    stamps["engine_imports"] = time.perf_counter() - t
    t = time.perf_counter()
    llm = LLM(model=args.model_dir, dtype="bfloat16", device="cuda", max_model_len=4096)
    torch.cuda.synchronize()
    stamps["engine_build"] = time.perf_counter() - t
    prompt = [(1000 + 7 * i) % 30000 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([prompt], params)
    torch.cuda.synchronize()
    stamps["first_generate"] = time.perf_counter() - t
    prof.disable()
    t = time.perf_counter()
    llm.generate([[p + 1 for p in prompt]], params)
    torch.cuda.synchronize()
    stamps["second_generate"] = time.perf_counter() - t
    print({k: round(v, 3) for k, v in stamps.items()})
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(s.getvalue()[-12000:] if key == "cumulative" else s.getvalue()[-6000:])


if __name__ == "__main__":
    sys.exit(main())
