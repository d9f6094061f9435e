"""Where a warm start's time goes inside the process: what the cold-start phases are made of.

`python -m bench.start_profile [--config llama-3.1-8b.json] [--entries serve,queue] [--runs 2]`
(py-spy on PATH; a GPU) does two things and writes OUT/start_profile.json:

  overlap   fresh interpreters, each round in turn: `import torch` alone; the handler's settings
            (handler.config + load_settings) then `import torch`, as the start runs them; and the
            two side by side on two threads. Says whether work in the start's interpreter can
            hide under torch's import (it can where that import gives up the interpreter's lock).
  profiles  warm starts (with --dropped, page cache dropped before each) of the real entry
            points (bench.cold_start.run_entry) under
            `py-spy record --threads --idle --nonblocking --subprocesses` (serve's engine process
            and the stream process included): each thread's samples summarised as
            a sequence of segments (the deepest frame of this repo, and the library frame it
            called), so that each phase of the ready line shows what it spent. The speedscope
            files go to OUT/profiles/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.cold_start import child_env

REPO = Path(__file__).resolve().parent.parent
OUR_PACKAGES = ("handler", "engine", "cache", "warmup")

_OVERLAP_CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
mode = sys.argv[1]
done = {}

def settings():
    import handler.config as c
    c.load_settings({})
    done["settings"] = time.perf_counter() - t0

def torch_and_cuda():
    import torch
    done["torch"] = time.perf_counter() - t0
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    done["cuda"] = time.perf_counter() - t0

if mode == "torch":
    torch_and_cuda()
elif mode == "serial":
    settings()
    torch_and_cuda()
else:
    side = threading.Thread(target=torch_and_cuda)
    side.start()
    settings()
    side.join()
done["end"] = time.perf_counter() - t0
print("RESULT " + json.dumps(done), flush=True)
"""


def overlap(rounds: int) -> dict:
    """Median seconds (process start -> each stamp) of the three arrangements."""
    env = child_env()
    samples: dict[str, list[dict]] = {"torch": [], "serial": [], "threads": []}
    for _ in range(rounds):
        for mode, runs in samples.items():
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", _OVERLAP_CHILD, mode],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(out.stderr[-2000:])
            stamps = json.loads(line[len("RESULT ") :])
            stamps["wall"] = time.perf_counter() - t0
            runs.append(stamps)
    return {
        mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for mode, runs in samples.items()
    }


def _label(stack: list[dict]) -> str:
    """A sample's label: the deepest frame of this repo, and the first frame it called below it
    (a library's, or an import's module)."""
    ours = None
    for i, frame in enumerate(stack):  # outermost first
        rel = _repo_path(frame["file"])
        if rel is not None:
            ours = i
    if ours is None:
        top = stack[-1] if stack else {"name": "?", "file": "?"}
        return f"{top['name']} ({_short(top['file'])})"
    frame = stack[ours]
    label = f"{_repo_path(frame['file'])}:{frame['name']}"
    below = [f for f in stack[ours + 1 :] if not f["file"].startswith("<frozen importlib")]
    if below:  # an import shows as the module it runs
        label += f" > {below[0]['name']} ({_short(below[0]['file'])})"
    return label


def _repo_path(path: str) -> str | None:
    try:
        rel = Path(path).resolve().relative_to(REPO)
    except (ValueError, OSError):
        return None
    return str(rel) if rel.parts and rel.parts[0] in OUR_PACKAGES else None


def _short(path: str) -> str:
    parts = Path(path).parts
    for root in ("site-packages", "dist-packages", "lib"):
        if root in parts:
            return "/".join(parts[parts.index(root) + 1 :][:3])
    return "/".join(parts[-2:])


def summarise(speedscope: str, min_s: float = 0.02) -> dict:
    """Per thread: its seconds, and its samples as consecutive segments of one label (short ones
    folded into the one before), each with its start (seconds from the thread's first sample)."""
    data = json.loads(Path(speedscope).read_text())
    frames = data["shared"]["frames"]
    threads = {}
    for prof in data["profiles"]:
        weights = prof["weights"]
        segments: list[list] = []  # [label, start, seconds]
        t = 0.0
        for sample, w in zip(prof["samples"], weights):
            label = _label([frames[i] for i in sample])
            if segments and segments[-1][0] == label:
                segments[-1][2] += w
            else:
                segments.append([label, t, w])
            t += w
        merged: list[list] = []
        for seg in segments:
            if merged and (seg[2] < min_s or merged[-1][0] == seg[0]):
                merged[-1][2] += seg[2]
            else:
                merged.append(list(seg))
        threads[prof["name"]] = {
            "seconds": round(t, 3),
            "segments": [(label, round(s, 3), round(d, 3)) for label, s, d in merged],
        }
    return threads


def profile_runs(args, out_dir: str) -> list[dict]:
    from bench.cold_start import (
        bench_model,
        drop_caches,
        prompt_text,
        run_entry,
        start_pages_path,
        warm_cache,
    )
    from cache.pack import find_packs

    model_dir, cache_dir = bench_model(args.config, args.model_dir)
    prompt = prompt_text(args.prompt_len)
    entries = [e for e in args.entries.split(",") if e]
    for entry in entries:  # first starts write the pack, the start pages, Triton's cache
        first = run_entry(
            entry, model_dir, cache_dir, prompt, {}, keep_until=start_pages_path(cache_dir, entry)
        )
        print(f"first start ({entry}): {first.get('total_s', first.get('error'))}", flush=True)
    warm_cache(find_packs(os.path.join(model_dir, "packs"))[:1])
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    results = []
    os.makedirs(os.path.join(out_dir, "profiles"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    for i in range(args.runs):
        for entry in entries:
            cache = "dropped" if args.dropped else "warm"
            path = os.path.join(out_dir, "profiles", f"{i + 1}-{entry}-{cache}.speedscope.json")
            if args.dropped:
                drop_caches(model_dir)
            spies: list[subprocess.Popen] = []

            def attach(pid: int, path: str = path) -> None:
                cmd = [spy, "record", "--pid", str(pid), "--threads", "--idle", "--nonblocking"]
                cmd += ["--subprocesses"]  # serve's engine process, the stream process
                cmd += ["-r", str(args.rate), "--format", "speedscope", "-o", path]
                # a session of its own: the entry's group is stopped with SIGTERM, which would end
                # py-spy before it writes; it stops by itself once the process exits
                spies.append(
                    subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
                )

            r = run_entry(
                entry,
                model_dir,
                cache_dir,
                prompt,
                {},
                on_spawn=attach,
                log_path=os.path.join(out_dir, "logs", f"{i + 1}-{entry}-{cache}.log"),
            )
            for spy_proc in spies:
                spy_proc.wait(timeout=60)
            r["cache"] = cache
            r["profile"] = summarise(path) if os.path.exists(path) else None
            print(f"{entry} run {i + 1}: {r.get('total_s', r.get('error'))} s", flush=True)
            results.append(r)
    return results


def print_profile(r: dict, min_thread_s: float = 0.05) -> None:
    print(
        f"\n== {r['entry']} ({r.get('cache', 'warm')}): first token {r.get('total_s')} s; "
        f"ready-line phases {r['phases']}"
    )
    for name, thread in (r.get("profile") or {}).items():
        if thread["seconds"] < min_thread_s:
            continue
        print(f"  {name}: {thread['seconds']:.2f} s sampled")
        for label, start, seconds in thread["segments"]:
            if seconds >= 0.02:
                print(f"    {start:6.2f} +{seconds:5.2f}  {label[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--entries", default="serve,queue")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dropped", action="store_true", help="drop the page cache before each run")
    ap.add_argument("--overlap-rounds", type=int, default=5)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.overlap_rounds:
        report["overlap"] = overlap(args.overlap_rounds)
        for mode, stamps in report["overlap"].items():
            print(f"overlap {mode:<8} " + ", ".join(f"{k} {v:.2f}" for k, v in stamps.items()))
    if args.runs:
        report["runs"] = profile_runs(args, args.out)
        for r in report["runs"]:
            print_profile(r)
    path = os.path.join(args.out, "start_profile.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
