"""Where a compiled-start burst's time goes, from the py-spy samples `bench.compiled_start --py-spy`
wrote: for each sampled start, the engine thread's samples inside the burst's window, split into
waiting on the GPU (the sampler's read-back synchronize), waiting for work, and the rest.

Aligning the samples with the run's clock (seconds since the server's spawn): py-spy attaches only
after the server printed its port, and in its speedscope output each thread's profile starts at that
thread's own first sample, so neither the spawn nor py-spy's attach is a profile's zero. A profile's
end is what can be placed: py-spy runs with --idle, so it samples every live thread at every tick
until the process exits, and a thread that lives to the exit has its last sample end there. The
run's "stopped_s" (the server's exit, since its spawn) is that end, and a sample at time t of a
thread whose samples sum to T is at stopped_s - (T - t). This assumes the engine thread lives to the
process's exit (and that py-spy kept up with its rate, so the weights add up to the wall time), so
only the engine thread is summarised; threads that end early (the background warm-up) cannot be
placed. Runs written before compiled_start recorded "stopped_s" cannot be aligned and say so.

`python -m bench.burst_profile DIR` (DIR holds compiled-start.json and the *.speedscope.json files);
prints one line per start.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

ENGINE_LOOPS = ("AsyncLLM._loop", "EngineCore.step")


def _window(run: dict) -> tuple[float, float]:
    """Seconds from the server's spawn: from just after the first request's first token to the
    burst's end (the first request's other tokens take well under 0.1 s)."""
    start = run["first_token_s"] + 0.1
    return start, start + run["burst_wall_s"] + 0.1


def _in_engine_loop(names: list[str]) -> bool:
    return any(n in names for n in ENGINE_LOOPS)


def _engine_bucket(names: list[str]) -> str:
    """What the engine thread was doing in one stack (outermost first) of its loop."""
    leaf = names[-1]
    if "synchronize" in leaf:
        return "engine: GPU wait"
    if leaf in ("Condition.wait", "Event.wait"):
        return "engine: no work"
    return "engine: host"


def _starts_since_spawn(weights: list[float], stopped_s: float) -> list[float]:
    """When each sample of a thread that lived to the process's exit began, in seconds since the
    spawn: walking back from the exit, each sample begins its weight before the next one."""
    starts = []
    end = stopped_s
    for weight in reversed(weights):
        end -= weight
        starts.append(end)
    return starts[::-1]


def summarise(profile_path: str, run: dict) -> dict[str, float]:
    """Seconds of the engine thread's samples per bucket inside the burst's window, each thread
    placed by its end at the run's "stopped_s"."""
    with open(profile_path) as f:
        data = json.load(f)
    frames = data["shared"]["frames"]
    start, end = _window(run)
    seconds: collections.Counter = collections.Counter()
    for thread in data["profiles"]:
        stacks = [[frames[i]["name"] for i in stack] for stack in thread["samples"]]
        if not any(_in_engine_loop(names) for names in stacks):
            continue
        starts = _starts_since_spawn(thread["weights"], run["stopped_s"])
        for names, weight, at in zip(stacks, thread["weights"], starts):
            if start <= at <= end and _in_engine_loop(names):
                seconds[_engine_bucket(names)] += weight
    return dict(seconds)


def describe(name: str, run: dict, profile_path: str) -> str:
    """One start's line: its burst, and the engine's seconds per bucket in the burst's window."""
    head = f"{name:5} burst {run['burst_wall_s']:.2f} s, TTFT p99 {run['ttft_p99_s']:.2f} s: "
    if "stopped_s" not in run:
        return head + "cannot be aligned (the run has no stopped_s, the server's exit time)"
    buckets = summarise(profile_path, run)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(buckets.items()))
    return head + (parts or "no samples of the engine thread in the window")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dir")
    args = ap.parse_args()
    with open(os.path.join(args.dir, "compiled-start.json")) as f:
        runs = json.load(f)["runs"]
    for name, run in runs.items():
        path = os.path.join(args.dir, f"{name.replace('#', '-')}.speedscope.json")
        if os.path.exists(path):
            print(describe(name, run, path))


if __name__ == "__main__":
    main()
