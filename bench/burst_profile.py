"""Where a compiled-start burst's time goes, from the py-spy samples `bench.compiled_start --py-spy`
wrote: for each sampled start, the engine thread's samples inside the burst's window, split into
waiting on the GPU (the sampler's read-back synchronize), waiting for work, and the rest, beside the
background kernel warm-up's samples (tracing, and waiting for requests).

`python -m bench.burst_profile DIR` (DIR holds compiled-start.json and the *.speedscope.json files);
prints one line per start.
"""

from __future__ import annotations

import argparse
import collections
import json
import os


def _window(run: dict) -> tuple[float, float]:
    """Seconds from the server's spawn: from just after the first request's first token to the
    burst's end (the first request's other tokens take well under 0.1 s)."""
    start = run["first_token_s"] + 0.1
    return start, start + run["burst_wall_s"] + 0.1


def _classify(names: list[str]) -> list[str]:
    """The buckets one stack (outermost first) counts in."""
    out = []
    if "AsyncLLM._loop" in names or "EngineCore.step" in names:
        leaf = names[-1]
        if "synchronize" in leaf:
            out.append("engine: GPU wait")
        elif leaf in ("Condition.wait", "Event.wait"):
            out.append("engine: no work")
        else:
            out.append("engine: host")
    if any(n in ("_trace_steps", "_load", "trace") for n in names):
        out.append("warm-up: waiting" if "wait_idle" in names else "warm-up: tracing")
    return out


def summarise(profile_path: str, run: dict) -> dict[str, float]:
    """Seconds of samples per bucket inside the burst's window, over every thread."""
    with open(profile_path) as f:
        data = json.load(f)
    frames = data["shared"]["frames"]
    start, end = _window(run)
    seconds: collections.Counter = collections.Counter()
    for thread in data["profiles"]:
        t = 0.0
        for stack, weight in zip(thread["samples"], thread["weights"]):
            if start <= t <= end:
                for bucket in _classify([frames[i]["name"] for i in stack]):
                    seconds[bucket] += weight
            t += weight
    return dict(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dir")
    args = ap.parse_args()
    with open(os.path.join(args.dir, "compiled-start.json")) as f:
        runs = json.load(f)["runs"]
    for name, run in runs.items():
        path = os.path.join(args.dir, f"{name.replace('#', '-')}.speedscope.json")
        if not os.path.exists(path):
            continue
        buckets = summarise(path, run)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(buckets.items()))
        print(
            f"{name:5} burst {run['burst_wall_s']:.2f} s, TTFT p99 {run['ttft_p99_s']:.2f} s: "
            f"{parts or 'no samples of the engine or the warm-up in the window'}"
        )


if __name__ == "__main__":
    main()
