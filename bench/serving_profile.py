"""Where the device time goes in online serving (`python -m bench.serving_profile`): N closed-loop
clients on the conv trace through AsyncLLM, as `bench.serving --parts online` runs them, with every
engine step timed on the device and split by kind, then a torch.profiler window whose kernels are
grouped by what they do and by the kind of step that launched them.

Step kinds: "decode" (every row one new token: the CUDA graph when the batch fits one), "mixed"
(decode rows beside prompt chunks, run eagerly) and "prefill" (prompt chunks only). Each step is
timed by CUDA events recorded on the current stream just before and just after the runner queues
it, so a step's device time includes any wait for the host inside it; the time between one step's
end and the next one's start is the device idle between steps.

The first pass (no profiler) gives the step table; the profiler pass after it gives the kernel
table (the profiler slows the host, so its step times are not used). FLOP rates: the linears'
2 x params x rows, attention's 4 x query-key pairs x heads x head_dim x layers (causal pairs
counted once), each over the whole step's device time.

Any other option is bench.serving's (`--load-format dummy`, `--quantization fp8`,
`--max-num-batched-tokens`, ...). Prints the tables; writes OUT/serving_profile.json.
`--compare base=A.json,B.json new=C.json` compares results already written: the line of mixed-step
device time against prompt tokens for each label, so runs whose windows carried different prompt
amounts are compared at the same one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import faulthandler
import gzip
import itertools
import json
import logging
import os
import tempfile
import threading
import time

import torch

from bench import serving
from bench.drivers import run_online
from bench.layer_shapes import active_linear_params
from bench.timing import summarize_window
from engine.config import ModelConfig

log = logging.getLogger("bench.serving_profile")

# Kernel name fragments -> what the kernel does (first match wins; names lowercased).
KERNEL_GROUPS = (
    ("attention", ("paged_attention", "merge_splits")),
    ("kv write + rope", ("write_kv", "rope")),
    ("norm + activation", ("rms_norm", "silu_and_mul", "gate_and_mul")),
    ("linears (Triton)", ("skinny_gemm", "row_gemv", "fp8_skinny", "quantize_rows")),
    ("linears (cuBLAS)", ("gemm", "nvjet", "cutlass", "xmma", "splitk")),
    ("sampling", ("race", "mask_logits", "softmax", "argmax", "topk", "sort", "exponential")),
    ("copies", ("memcpy", "memset")),
)


# Launches from the host: the runtime's (cuBLAS, torch, graph replays) and the driver's (Triton).
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, fragments in KERNEL_GROUPS:
        if any(f in low for f in fragments):
            return group
    return "other torch ops"


class StepClock:
    """Wraps a runner's execute: each step's kind, rows and tokens, the host seconds it took to
    queue it, and CUDA events around it; each step runs inside a profiler range named "step/<kind>".
    Recording (and a profiler) start and stop on the engine thread, at the first step after
    `switch` asks for it, or on the caller's thread when the engine has no step to run."""

    def __init__(self, runner):
        self.inner = runner.execute
        self.steps: list[dict] = []
        self.recording = False
        self._switch: tuple[bool, object, threading.Event] | None = None
        self._lock = threading.Lock()
        runner.execute = self.execute

    def switch(self, on: bool, profiler=None, wait_s: float = 5.0) -> None:
        """Start (stop) recording, and the profiler if given, on the engine thread at its next step;
        blocks until done. An engine with no step to run within wait_s (idle) is switched from
        this thread."""
        done = threading.Event()
        with self._lock:
            self._switch = (on, profiler, done)
        if not done.wait(wait_s):
            self._apply_switch()

    def _apply_switch(self) -> None:
        with self._lock:
            if self._switch is None:
                return
            (on, profiler, done), self._switch = self._switch, None
            if profiler is not None:
                profiler.start() if on else profiler.stop()
            self.recording = on
            done.set()

    def execute(self, scheduled, rows, previous=None, fill_masks=None):
        if self._switch is not None:
            self._apply_switch()
        if not self.recording:
            return self.inner(scheduled, rows, previous, fill_masks)
        chunks = [s for s in scheduled if s.num_new_tokens > 1]
        prefill = sum(s.num_new_tokens for s in chunks)
        decode = len(scheduled) - len(chunks)
        kind = "decode" if not chunks else ("prefill" if decode == 0 else "mixed")
        pairs = 0  # query-key pairs attention computes this step (causal)
        for s in scheduled:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            pairs += n * start + n * (n + 1) // 2
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"step/{kind}"):
            out = self.inner(scheduled, rows, previous, fill_masks)
        host = time.perf_counter() - t0
        end.record()
        self.steps.append(
            {
                "kind": kind,
                "rows": len(scheduled),
                "decode_rows": decode,
                "prefill_tokens": prefill,
                "pairs": pairs,
                "host_s": host,
                "events": (begin, end),
            }
        )
        return out

    def resolve(self) -> list[dict]:
        """Device seconds of each recorded step and the idle gap before it; drops the events."""
        torch.cuda.synchronize()
        out, last_end = [], None
        for s in self.steps:
            begin, end = s.pop("events")
            s["device_s"] = begin.elapsed_time(end) / 1e3
            s["gap_before_s"] = last_end.elapsed_time(begin) / 1e3 if last_end is not None else 0.0
            last_end = end
            out.append(s)
        self.steps = []
        return out


def linear_params(config: dict) -> tuple[int, int]:
    """(parameters of the decoder layers' linears one token multiplies, of the lm_head) of a
    config.json (bench.layer_shapes)."""
    cfg = ModelConfig.from_dict(config)
    return active_linear_params(cfg), cfg.hidden_size * cfg.vocab_size


def step_table(steps: list[dict], window_s: float, config: dict) -> dict:
    """Per kind: steps, rows and tokens, device and host seconds, and their share of the window."""
    layers, lm_head = linear_params(config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_pair = heads * head_dim * config["num_hidden_layers"]
    table = {}
    for kind in ("decode", "mixed", "prefill"):
        ss = [s for s in steps if s["kind"] == kind]
        if not ss:
            continue
        device = sum(s["device_s"] for s in ss)
        tokens = sum(s["decode_rows"] + s["prefill_tokens"] for s in ss)
        table[kind] = {
            "steps": len(ss),
            "mean_rows": sum(s["rows"] for s in ss) / len(ss),
            "mean_decode_rows": sum(s["decode_rows"] for s in ss) / len(ss),
            "mean_prefill_tokens": sum(s["prefill_tokens"] for s in ss) / len(ss),
            "device_s": device,
            "device_share": device / window_s,
            "mean_device_ms": device / len(ss) * 1e3,
            "mean_host_ms": sum(s["host_s"] for s in ss) / len(ss) * 1e3,
            "gap_s": sum(s["gap_before_s"] for s in ss),
            "linear_TFLOP": 2 * layers * tokens / 1e12,
            "attention_TFLOP": 4 * sum(s["pairs"] for s in ss) * per_pair / 1e12,
            "lm_head_rows": sum(s["rows"] for s in ss),
            "lm_head_TFLOP": 2 * lm_head * sum(s["rows"] for s in ss) / 1e12,
        }
    return table


def kernel_table(trace_path: str) -> dict:
    """Kernel seconds by (step kind, kernel group) from a profiler chrome trace: each kernel is
    matched through its launch's correlation id to the "step/<kind>" range around the launch. Also
    the steps of each kind in the window, and the attention launches apart by their query tiles
    (the grid's third axis): one tile is a decode launch (or a prompt of one tile), several a
    prompt launch."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ranges = collections.defaultdict(list)  # tid -> [(start, end, kind)]
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("step/"):
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"][5:]))
    kind_of: dict[int, str] = {}
    for e in events:
        if e.get("cat") not in LAUNCH_CATS or "correlation" not in e.get("args", {}):
            continue
        for start, end, kind in ranges.get(e["tid"], ()):
            if start <= e["ts"] <= end:
                kind_of[e["args"]["correlation"]] = kind
                break
    seconds = collections.defaultdict(float)
    names = collections.defaultdict(float)
    attention = collections.defaultdict(lambda: [0.0, 0])  # (kind, tiles) -> [seconds, launches]
    span = [float("inf"), 0.0]
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        kind = kind_of.get(e.get("args", {}).get("correlation"), "outside steps")
        group = "copies" if e["cat"] != "kernel" else kernel_group(e["name"])
        seconds[(kind, group)] += e["dur"] / 1e6
        names[(group, e["name"][:80])] += e["dur"] / 1e6
        span = [min(span[0], e["ts"]), max(span[1], e["ts"] + e["dur"])]
        if "paged_attention" in e["name"]:
            grid = e["args"].get("grid", [1, 1, 1])
            launch = attention[(kind, "one query tile" if grid[2] == 1 else "query tiles")]
            launch[0] += e["dur"] / 1e6
            launch[1] += 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:25]
    steps = collections.Counter(kind for spans in ranges.values() for _, _, kind in spans)
    return {
        "by_kind_group": [{"kind": k, "group": g, "s": s} for (k, g), s in sorted(seconds.items())],
        "steps": dict(steps),
        "attention_launches": [
            {"kind": k, "launch": t, "s": s, "launches": n}
            for (k, t), (s, n) in sorted(attention.items())
        ],
        "top_kernels": [{"group": g, "name": n, "s": s} for (g, n), s in top],
        "span_s": (span[1] - span[0]) / 1e6 if span[1] else 0.0,
    }


async def measure(bench: serving.Bench, a: argparse.Namespace) -> dict:
    engine = await bench.start_engine()
    clock = StepClock(engine.engine.runner)
    make_request = bench.online_request()
    counter = itertools.count()
    c = a.concurrency[0]

    async def record_window(seconds: float, profiler=None) -> tuple[float, float]:
        await asyncio.sleep(a.online_warmup)
        await asyncio.to_thread(clock.switch, True, profiler)
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        await asyncio.to_thread(clock.switch, False, profiler)
        return t0, time.perf_counter()

    # pass 1: steps timed, no profiler
    timed = asyncio.create_task(record_window(a.online_seconds))
    records, w0, w1, _ = await run_online(
        engine, make_request, c, a.online_warmup, a.online_seconds + 1.0, f"timed-c{c}", counter
    )
    t0, t1 = await timed
    steps = clock.resolve()
    result = {
        "concurrency": c,
        "serving": summarize_window(records, w0, w1),
        "window_s": t1 - t0,
        "steps": step_table(steps, t1 - t0, bench.config),
        "step_samples": steps[:: max(1, len(steps) // 400)],
    }
    log.info("c=%d: %.0f output tok/s", c, result["serving"]["output_tok_s"])

    # pass 2: the profiler over a short window of the same load
    trace = os.path.join(tempfile.mkdtemp(prefix="serving-profile-"), "trace.json")
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )

    profiled = asyncio.create_task(record_window(a.profile_seconds, prof))
    await run_online(
        engine,
        make_request,
        c,
        a.online_warmup,
        a.profile_seconds + 1.0,
        f"profiled-c{c}",
        counter,
    )
    await profiled
    clock.resolve()
    prof.export_chrome_trace(trace)
    result["kernels"] = kernel_table(trace)
    if a.keep_trace:
        with open(trace, "rb") as f, gzip.open(os.path.join(a.out, "trace.json.gz"), "wb") as g:
            g.write(f.read())
    os.remove(trace)
    return result


def render(result: dict) -> str:
    lines = [
        f"concurrency {result['concurrency']}: {result['serving']['output_tok_s']:.0f} output "
        f"tok/s over {result['window_s']:.1f} s of recorded steps",
        "kind | steps | rows | decode rows | prefill tok | device ms/step | host ms/step | "
        "device share | idle before (s) | linear TFLOP/s | attention TFLOP/s",
    ]
    for kind, t in result["steps"].items():
        lines.append(
            f"{kind} | {t['steps']} | {t['mean_rows']:.1f} | {t['mean_decode_rows']:.1f} | "
            f"{t['mean_prefill_tokens']:.0f} | {t['mean_device_ms']:.2f} | {t['mean_host_ms']:.2f} "
            f"| {t['device_share']:.1%} | {t['gap_s']:.3f} | "
            f"{t['linear_TFLOP'] / t['device_s']:.0f} | {t['attention_TFLOP'] / t['device_s']:.0f}"
        )
    k = result.get("kernels")
    if k:
        steps = k.get("steps", {})
        lines.append(
            f"kernels over {k['span_s']:.2f} s of profiled device time (seconds; ms per step of "
            f"the kind, steps in the window: {', '.join(f'{n} {c}' for n, c in steps.items())}):"
        )
        for row in k["by_kind_group"]:
            per_step = _per_step_ms(row["s"], steps.get(row["kind"]))
            lines.append(f"  {row['kind']:>13} | {row['group']:<20} | {row['s']:.3f} | {per_step}")
        for row in k.get("attention_launches", ()):
            per_step = _per_step_ms(row["s"], steps.get(row["kind"]))
            lines.append(
                f"  {row['kind']:>13} | attention, {row['launch']:<9} | {row['s']:.3f} | {per_step}"
                f" | {row['launches']} launches, {row['s'] / row['launches'] * 1e6:.1f} us each"
            )
        lines.append("top kernels:")
        for row in k["top_kernels"]:
            lines.append(f"  {row['s']:.3f} s  {row['group']:<20} {row['name']}")
    return "\n".join(lines)


def _per_step_ms(seconds: float, steps: int | None) -> str:
    return f"{seconds / steps * 1e3:.2f} ms/step" if steps else "-"


def mixed_step_fit(files: list[str]) -> dict:
    """Over the mixed steps sampled in these results: the least-squares line of device ms against
    prompt tokens, and each file's output tok/s."""
    xs, ys, rates = [], [], []
    for path in files:
        with open(path) as f:
            result = json.load(f)
        rates.append(result["serving"]["output_tok_s"])
        for s in result["step_samples"]:
            if s["kind"] == "mixed":
                xs.append(s["prefill_tokens"])
                ys.append(s["device_s"] * 1e3)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"mixed_steps": n, "ms": my - slope * mx, "ms_per_token": slope, "output_tok_s": rates}


def compare(groups: list[str], at_tokens: int) -> str:
    """--compare LABEL=A.json,B.json ...: one line per label."""
    lines = [
        f"label | mixed steps | device ms = a + b x prompt tokens | at {at_tokens} | output tok/s"
    ]
    for group in groups:
        label, _, files = group.partition("=")
        fit = mixed_step_fit(files.split(","))
        at = fit["ms"] + fit["ms_per_token"] * at_tokens
        rates = ", ".join(f"{r:.0f}" for r in fit["output_tok_s"])
        lines.append(
            f"{label} | {fit['mixed_steps']} | {fit['ms']:.1f} + {fit['ms_per_token'] * 1e3:.2f} "
            f"per 1000 | {at:.1f} ms | {rates}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, add_help=False)
    ap.add_argument("--profile-seconds", type=float, default=3.0, help="the profiler's window")
    ap.add_argument("--keep-trace", action="store_true", help="write OUT/trace.json.gz")
    ap.add_argument(
        "--dump-stacks-after",
        type=float,
        default=0.0,
        help="seconds after which every thread's stack is printed and the run exits (0: never)",
    )
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="LABEL=JSON[,JSON]",
        help="run nothing: fit each label's mixed steps (device ms against prompt tokens)",
    )
    ap.add_argument("--at-tokens", type=int, default=1600, help="--compare: evaluate the fits here")
    own, rest = ap.parse_known_args(argv)
    if own.compare:
        return own
    if "--concurrency" not in rest:
        rest += ["--concurrency", "64"]
    a = serving.parse_args(rest + ["--parts", "online"])
    if len(a.concurrency) != 1:
        raise SystemExit("--concurrency: one level per call")
    if not a.device.startswith("cuda"):
        raise SystemExit("bench.serving_profile needs a CUDA device (it times steps with events)")
    for k, v in vars(own).items():
        setattr(a, k, v)
    return a


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    a = parse_args(argv)
    if a.compare:
        print(compare(a.compare, a.at_tokens))
        return
    if a.dump_stacks_after:  # a run that hangs shows where every thread is
        faulthandler.dump_traceback_later(a.dump_stacks_after, exit=True)
    os.makedirs(a.out, exist_ok=True)
    bench = serving.Bench(a)
    try:
        result = asyncio.run(measure(bench, a))
    finally:
        if bench.engine is not None:
            bench.engine.shutdown()
    result["meta"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(a).items() if k != "merge"},
    }
    with open(os.path.join(a.out, "serving_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(render(result))


if __name__ == "__main__":
    main()
