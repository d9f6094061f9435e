"""The serving benchmark (`make bench`, `python -m bench.serving`): decode at batch 1, offline and
online serving through AsyncLLM, and HF transformers side by side, on a random-weight checkpoint
synthesized from an HF config.

Parts (`--parts decode,offline,online,hf`) can run in separate calls with the same `--out`: each
call merges its sections into OUT/serving.json, then the table is printed and OUT/serving.png
redrawn. `--merge A.json B.json` combines results written elsewhere. Sizes scale with `--scale` for
smoke runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import report
from bench.checkpoint import CONFIGS, config_only_dir, synthesize
from bench.drivers import decode_step_times, run_offline, run_online, wait_idle
from bench.roofline import copy_bandwidth, decode_window, model_bytes
from bench.timing import summarize, summarize_window
from bench.trace import (
    BenchRequest,
    conv_requests,
    fixed_requests,
    make_requests,
    random_prompt,
    sample_lengths,
)
from engine import AsyncLLM, EngineArgs
from engine.config import ModelConfig
from engine.layers import experts as experts_layer
from warmup.artifacts import prepare

PARTS = ("hf", "decode", "conv", "fixed", "online")  # the order they run in; "offline": conv,fixed
SEEDS = {"conv": 1, "fixed": 2, "online": 3, "hf": 4, "warmup": 5, "decode": 6}
log = logging.getLogger("bench.serving")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config",
        default="llama-3.1-8b.json",
        help="a bench/configs name or a path to an HF config",
    )
    ap.add_argument(
        "--model-dir",
        default=None,
        help="checkpoint dir (default: synthesized under /tmp/coldbrew-bench)",
    )
    ap.add_argument(
        "--out", default=None, help="output dir (default bench/results/<date>-serving-<config>)"
    )
    ap.add_argument(
        "--parts", default="decode,offline,online,hf", help=f"any of {','.join(PARTS)},offline"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="merge these results into OUT and report; run nothing",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--scale", type=float, default=1.0, help="multiplies request counts and online durations"
    )
    ap.add_argument("--num-requests", type=int, default=1000, help="offline conv-trace requests")
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--fixed-requests", type=int, default=256)
    ap.add_argument("--fixed-prompt", type=int, default=1024)
    ap.add_argument("--fixed-output", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument(
        "--online-lengths",
        default="conv",
        choices=["conv", "fixed"],
        help="the online clients' request lengths: the conv trace's, or every request "
        "--fixed-prompt tokens in and --fixed-output out (as fixed-length published runs)",
    )
    ap.add_argument(
        "--online-seconds", type=float, default=30.0, help="measured window per concurrency level"
    )
    ap.add_argument(
        "--online-warmup", type=float, default=5.0, help="seconds per level before the window opens"
    )
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument(
        "--hf-requests", type=int, default=64, help="conv-trace subset run by HF and by us"
    )
    ap.add_argument(
        "--hf-batch-size", type=int, default=32, help="static batch size of HF generate"
    )
    ap.add_argument(
        "--warmup-requests", type=int, default=256, help="mixed requests run before any timing"
    )
    ap.add_argument(
        "--quantization", default=None, choices=["fp8"], help="EngineArgs.quantization (FP8 W8A8)"
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", help="EngineArgs.kv_cache_dtype (auto, fp8, ...)"
    )
    ap.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights made on the device (no checkpoint written; the config alone)",
    )
    ap.add_argument(
        "--moe-experts",
        default="fused",
        choices=["fused", "loop"],
        help="a MoE model's experts: the fused Triton kernels, or a per-expert loop of plain "
        "matmuls (it reads the routing back, so the engine runs without CUDA graphs)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--engine-mode",
        default="jit",
        choices=["jit", "compiled", "auto"],
        help="ENGINE_MODE (compiled needs `python -m warmup build` with the same limits first)",
    )
    ap.add_argument(
        "--bandwidth-bytes", type=int, default=None, help="buffer of the copy-bandwidth test"
    )
    args = ap.parse_args(argv)
    args.parts = [
        p.strip() for p in args.parts.replace("offline", "conv,fixed").split(",") if p.strip()
    ]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {','.join(PARTS)}")
    if args.scale <= 0:
        ap.error(f"--scale: must be > 0, got {args.scale}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    name = Path(args.config).stem
    if args.out is None:
        args.out = str(
            Path(__file__).parent / "results" / f"{datetime.date.today()}-serving-{name}"
        )
    if args.model_dir is None:
        args.model_dir = f"/tmp/coldbrew-bench/model/{name}"
    return args


def scaled(n: int | float, scale: float) -> int:
    return max(1, round(n * scale))


def config_path(name: str) -> Path:
    """A path to an HF config.json-like file, or the name of one in bench/configs."""
    return Path(name).resolve() if Path(name).is_file() else CONFIGS / name


def load_config(name: str) -> dict:
    return json.loads(config_path(name).read_text())


class Bench:
    """One call: the checkpoint, the byte counts and bandwidth, one engine shared by the parts that
    need it."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.config = load_config(args.config)
        self.mc = ModelConfig.from_dict(self.config)
        self.dtype = getattr(torch, args.dtype)
        t0 = time.perf_counter()
        if args.load_format == "dummy":  # the engine makes its weights; it needs the config only
            where = Path(args.model_dir)
            self.model_dir = config_only_dir(self.config, where.name, str(where.parent))
        else:
            self.model_dir = synthesize(
                str(config_path(args.config)), args.model_dir, device=args.device
            )
        self.synthesize_s = time.perf_counter() - t0
        self.bytes = model_bytes(self.config, self.dtype)
        nbytes = args.bandwidth_bytes or (
            (2 << 30) if args.device.startswith("cuda") else (64 << 20)
        )
        self.bandwidth = copy_bandwidth(args.device, nbytes)
        self.engine: AsyncLLM | None = None
        self.engine_init_s: float | None = None
        self.results: dict = {"kv": {}}

    # ---- the engine ------------------------------------------------------------------------------
    def max_model_len(self) -> int:
        a = self.args
        need = max(
            a.max_prompt + a.max_output,
            a.fixed_prompt + a.fixed_output,
            a.decode_prompt + a.decode_tokens,
        )
        return min(need, self.mc.max_position_embeddings)

    async def start_engine(self) -> AsyncLLM:
        if self.engine is None:
            a = self.args
            gc.collect()
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
            experts_layer.EXPERTS_IMPL = "loop" if a.moe_experts == "loop" else "auto"
            t0 = time.perf_counter()
            engine_args, self.engine_selection = prepare(
                a.engine_mode,
                EngineArgs(
                    model=self.model_dir,
                    dtype=a.dtype,
                    device=a.device,
                    max_model_len=self.max_model_len(),
                    block_size=a.block_size,
                    num_kv_blocks=a.num_kv_blocks,
                    gpu_memory_utilization=a.gpu_memory_utilization,
                    max_num_seqs=a.max_num_seqs,
                    max_num_batched_tokens=a.max_num_batched_tokens,
                    seed=0,
                    quantization=a.quantization,
                    kv_cache_dtype=a.kv_cache_dtype,
                    load_format=a.load_format,
                    enforce_eager=a.moe_experts == "loop",
                ),
            )
            self.results["engine_mode"] = {
                "mode": self.engine_selection.mode,
                "reason": self.engine_selection.reason,
            }
            self.engine = AsyncLLM(**vars(engine_args))
            self.engine_init_s = time.perf_counter() - t0
            await self.warm_up()
        return self.engine

    async def warm_up(self) -> None:
        """Mixed prompt lengths and outputs of 1..64 tokens, so kernels compile and the decode batch
        passes through many sizes before anything is timed."""
        a = self.args
        n = scaled(a.warmup_requests, a.scale)
        top = min(512, a.max_prompt)
        lengths = [(1 + (16 + i * 37) % top, 1 + i % min(64, a.max_output)) for i in range(n)]
        t0 = time.perf_counter()
        await run_offline(
            self.engine, make_requests(lengths, self.mc.vocab_size, SEEDS["warmup"]), "warmup"
        )
        # Decode graphs are captured lazily: take the sizes the warm-up did not reach now, not
        # inside a timed part.
        self.graph_capture_s = await self.engine.capture_cuda_graphs()
        self.warmup_s = time.perf_counter() - t0

    # ---- parts -----------------------------------------------------------------------------------
    async def decode(self) -> None:
        a = self.args
        engine = await self.start_engine()
        step_s, all_s = await decode_step_times(
            engine,
            a.decode_prompt,
            a.decode_tokens,
            self.mc.vocab_size,
            repeats=3,
            seed=SEEDS["decode"] * 1000,
        )
        floor_s = self.bytes.decode_weights / self.bandwidth
        self.results["decode"] = {
            "prompt_len": a.decode_prompt,
            "new_tokens": a.decode_tokens,
            "ms_per_token": step_s * 1e3,
            "tok_s": 1 / step_s,
            "floor_ms": floor_s * 1e3,
            "roofline_frac": floor_s / step_s,
            "decode_weights_GB": self.bytes.decode_weights / 1e9,
            "bandwidth_GBps": self.bandwidth / 1e9,
            "repeats_ms": [s * 1e3 for s in all_s],
            "how": (
                "(engine finish time - first token time) / (tokens - 1), median of 3; "
                "floor = weights less the embedding table / copy bandwidth"
            ),
        }

    async def conv(self) -> None:
        """Offline (a): conv-trace lengths, all requests at once."""
        a = self.args
        reqs = conv_requests(
            scaled(a.num_requests, a.scale),
            self.mc.vocab_size,
            SEEDS["conv"],
            a.max_prompt,
            a.max_output,
        )
        records, start, end, poller = await run_offline(
            await self.start_engine(), reqs, "offline-conv"
        )
        self.results.setdefault("offline", {})["conv"] = {
            **summarize(records, start, end),
            "kv": poller.kv(),
        }
        log.info("offline conv: %.0f output tok/s", self.results["offline"]["conv"]["output_tok_s"])

    async def fixed(self) -> None:
        """Offline (b): fixed lengths, all requests at once, with the steady decode window against
        its roofline."""
        a = self.args
        reqs = fixed_requests(
            scaled(a.fixed_requests, a.scale),
            a.fixed_prompt,
            a.fixed_output,
            self.mc.vocab_size,
            SEEDS["fixed"],
        )
        records, start, end, poller = await run_offline(
            await self.start_engine(), reqs, "offline-fixed"
        )
        out = {**summarize(records, start, end), "kv": poller.kv()}
        out["decode_window"] = decode_window(
            records, poller.first_preemption_time(), self.bytes, self.bandwidth
        )
        self.results.setdefault("offline", {})["fixed"] = out
        log.info("offline fixed: %.0f output tok/s", out["output_tok_s"])

    def online_request(self) -> Callable[[int], BenchRequest]:
        """make_request(k) for the online clients: request k of the conv trace's lengths (or the
        fixed lengths, `--online-lengths fixed`), with its own random prompt."""
        a = self.args
        if a.online_lengths == "fixed":
            lengths = [(a.fixed_prompt, a.fixed_output)]
        else:
            lengths = sample_lengths(19365, SEEDS["online"], a.max_prompt, a.max_output)

        def make_request(k: int) -> BenchRequest:
            p, o = lengths[k % len(lengths)]
            return BenchRequest(
                random_prompt(p, self.mc.vocab_size, SEEDS["online"] * 1_000_003 + k), o
            )

        return make_request

    async def online(self) -> None:
        a = self.args
        engine = await self.start_engine()
        make_request = self.online_request()
        levels, counter = [], itertools.count()
        for c in a.concurrency:
            records, w0, w1, poller = await run_online(
                engine,
                make_request,
                c,
                a.online_warmup * a.scale,
                a.online_seconds * a.scale,
                f"online-c{c}",
                counter,
            )
            levels.append(
                {"concurrency": c, **summarize_window(records, w0, w1), "kv": poller.kv()}
            )
            log.info("online c=%d: %.0f output tok/s", c, levels[-1]["output_tok_s"])
        self.results["online"] = {
            "levels": levels,
            "how": (
                f"closed loop: each client sends its next {a.online_lengths}-length request when "
                "the last ends; "
                "statistics over the window after the warm-up; requests open at the end are "
                "aborted after their first token"
            ),
        }

    async def hf(self) -> None:
        """HF first (its model and ours do not share the GPU), then our engine on the very same
        requests."""
        from bench import hf_baseline

        a = self.args
        n = scaled(a.hf_requests, a.scale)
        lengths = sample_lengths(
            scaled(a.num_requests, a.scale), SEEDS["conv"], a.max_prompt, a.max_output
        )[:n]
        reqs = make_requests(lengths, self.mc.vocab_size, SEEDS["hf"])
        out: dict = {}
        if self.engine is None:
            t0 = time.perf_counter()
            model = hf_baseline.load_hf_model(self.model_dir, self.dtype, a.device)
            out["load_s"] = time.perf_counter() - t0
            dec = BenchRequest(
                random_prompt(a.decode_prompt, self.mc.vocab_size, SEEDS["decode"]), a.decode_tokens
            )
            step = hf_baseline.decode_step_time(model, dec, a.device)
            out["decode_b1"] = {"ms_per_token": step * 1e3, "tok_s": 1 / step}
            try:  # a baseline that fails (out of memory, an API change) is reported, not fatal
                records, start, end = hf_baseline.run_generate(
                    model, reqs, a.hf_batch_size, a.device
                )
                out["generate"] = {**summarize(records, start, end), "batch_size": a.hf_batch_size}
            except Exception as exc:
                log.exception("HF generate failed")
                out["generate"] = f"failed: {exc!r}"
            try:
                records, start, end = hf_baseline.run_continuous_batching(model, reqs, a.device)
                out["generate_batch"] = summarize(records, start, end)
            except Exception as exc:
                log.exception("HF continuous batching failed")
                out["generate_batch"] = f"failed: {exc!r}"
            hf_baseline.free_hf_model(model)
            del model
        else:
            out["skipped"] = "our engine already holds the GPU; run the hf part first or alone"
        engine = await self.start_engine()
        records, start, end, poller = await run_offline(engine, reqs, "hf-subset")
        out["ours"] = {**summarize(records, start, end), "kv": poller.kv()}
        out["how"] = (
            "same requests for all three (random ids, conv-trace lengths); HF generate in static "
            "batches in trace order, left-padded, every row run to the batch's longest output; "
            "HF continuous batching through its manager with per-request max_new_tokens, EOS off"
        )
        self.results["hf"] = out

    async def run(self) -> dict:
        order = [p for p in PARTS if p in self.args.parts]
        t0 = time.perf_counter()
        try:
            for part in order:
                await getattr(self, part)()
                section = "offline" if part in ("conv", "fixed") else part
                # a call cut short keeps what it measured
                write(self.args.out, {section: self.results[section]})
            if self.engine is not None:
                await wait_idle(self.engine)
                s = await asyncio.to_thread(self.engine.stats)
                self.results["kv"]["+".join(order)] = {
                    "num_kv_blocks": s.num_kv_blocks,
                    "peak_used_blocks": s.peak_used_blocks,
                    "waste_frac": 1 - s.peak_used_blocks / s.num_kv_blocks,
                    "preemptions": s.num_preemptions,
                    "kv_GB": s.num_kv_blocks * self.args.block_size * self.bytes.kv_per_token / 1e9,
                }
        finally:
            if self.engine is not None:
                self.engine.shutdown()
        a = self.args
        self.results["meta"] = {
            "config": a.config,
            "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "dtype": a.dtype,
            "quantization": a.quantization,
            "kv_cache_dtype": a.kv_cache_dtype,
            "load_format": a.load_format,
            "moe_experts": a.moe_experts,
            "weights_GB": self.bytes.weights / 1e9,
            "kv_bytes_per_token": self.bytes.kv_per_token,
            "timing": (
                "every AsyncLLM stream output is timestamped on arrival in the client (asyncio, "
                "same process); TTFT from submission (offline: all at once); a chunk of k new "
                "tokens dt after the previous one counts k inter-token gaps of dt / k; prompts are "
                "random ids, outputs forced (ignore_eos)"
            ),
            "calls": [
                {
                    "parts": order,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"
                    ),
                    "bandwidth_GBps": self.bandwidth / 1e9,
                    "synthesize_s": self.synthesize_s,
                    "engine_init_s": self.engine_init_s,
                    "warmup_s": getattr(self, "warmup_s", None),
                    "graph_capture_after_warmup_s": getattr(self, "graph_capture_s", None),
                    "wall_s": time.perf_counter() - t0,
                    "scale": a.scale,
                    "args": {k: v for k, v in vars(a).items() if k not in ("merge",)},
                }
            ],
        }
        return self.results


def write(out_dir: str, new: dict) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "serving.json")
    merged = report.merge(report.load(path) if os.path.exists(path) else {}, new)
    report.save(merged, path)
    report.plot(merged, os.path.join(out_dir, "serving.png"))
    return merged


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.merge:
        merged: dict = {}
        for path in args.merge:
            merged = report.merge(merged, report.load(path))
        os.makedirs(args.out, exist_ok=True)
        report.save(merged, os.path.join(args.out, "serving.json"))
        report.plot(merged, os.path.join(args.out, "serving.png"))
    else:
        merged = write(args.out, asyncio.run(Bench(args).run()))
    print(f"results: {os.path.join(args.out, 'serving.json')}")
    print(report.table(merged))


if __name__ == "__main__":
    main()
