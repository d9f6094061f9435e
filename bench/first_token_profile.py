"""Where a cold start's time goes, function by function: cProfile of the one start sequence
(warmup.start, as the worker runs it: the weights streaming while torch imports) and of the first
one-token generate, in a fresh process.

`python -m bench.first_token_profile MODEL_DIR [--top 40]`: run it twice (the first run writes the
pack).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import tempfile
import time

T0 = time.perf_counter()


async def _one_token(engine, request_id: str, prompt: list[int]) -> None:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    async for _ in engine.generate(request_id, prompt, params):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dir")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="the start's cache (start pages); default: a temporary one",
    )
    args = ap.parse_args()
    from warmup.start import EngineStart, StartArgs

    start = EngineStart(
        StartArgs(
            model=args.model_dir,
            cache_dir=args.cache_dir or tempfile.mkdtemp(),
            device=args.device,
            engine_options={"dtype": "bfloat16", "max_model_len": 4096},
        )
    )
    prof = cProfile.Profile()
    prof.enable()  # this thread: the start runs here (run(), not begin())
    engine = start.run()
    stamps = {"start": time.perf_counter() - T0}
    prompt = [(1000 + 7 * i) % 30000 for i in range(args.prompt_len)]
    t = time.perf_counter()
    asyncio.run(_one_token(engine, "first", prompt))
    stamps["first_generate"] = time.perf_counter() - t
    prof.disable()
    t = time.perf_counter()
    asyncio.run(_one_token(engine, "second", [p + 1 for p in prompt]))
    stamps["second_generate"] = time.perf_counter() - t
    print({k: round(v, 3) for k, v in {**stamps, **start.phases}.items()})
    engine.shutdown()
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(s.getvalue()[-12000:] if key == "cumulative" else s.getvalue()[-6000:])


if __name__ == "__main__":
    sys.exit(main())
