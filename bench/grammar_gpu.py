"""What a JSON-schema grammar costs inside the engine's decode step on a GPU: the engine's decode at
batch 1 and 64 with and without the mask, the bitmask's copy and application on the device, and the
grammar engines' CPU comparison (bench/grammar_engines.py) on that machine's cores.

Prepare here (the GPU machine has no network), then carry `.cache/grammar-bench`:

    # the Llama-3 tokenizer (needs the llama-models wheel), and the wheels for the Python there
    python -m bench.grammar_tokenizer .cache/grammar-bench/llama3-tokenizer.json
    pip download --no-deps -d .cache/grammar-bench/wheels --python-version 3.12 \\
        --only-binary=:all: llguidance xgrammar apache-tvm-ffi   # xgrammar: the engines part

On the GPU machine, one command:

    pip install --no-deps --no-index --find-links .cache/grammar-bench/wheels llguidance xgrammar \\
        apache-tvm-ffi && python -m bench.grammar_gpu --out $OUT

The engine's decode runs its own grammar path (SamplingParams.structured_outputs): after the decode
graph is launched, the host reads the previous step's tokens, advances each sequence's matcher,
fills the batch's bitmask (overlapping the forward pass) and copies it to the device, where the
sampler masks the logits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from bench.grammar_schemas import NESTED_20_FIELDS
from engine.structured import GrammarBackend, StructuredOutputs
from engine.token_bitmask import allocate_bitmask, apply_token_bitmask

TOKENIZER = ".cache/grammar-bench/llama3-tokenizer.json"


def device_costs(vocab: int, batches: list[int], repeats: int = 200) -> dict:
    """Median microseconds of the pinned bitmask's copy to the GPU plus apply_token_bitmask, and of
    the apply alone, on float32 logits [batch, vocab] (the sampler's working dtype)."""
    out = {}
    for b in batches:
        logits = torch.randn(b, vocab, device="cuda")
        host = allocate_bitmask(b, vocab, pin_memory=True)
        host.random_()
        dev = torch.empty_like(host, device="cuda")
        timings: dict[str, list[float]] = {"copy_and_apply_us": [], "apply_us": []}
        for i in range(repeats + 10):
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            dev.copy_(host, non_blocking=True)
            e1.record()
            apply_token_bitmask(logits, dev)
            e2.record()
            e2.synchronize()
            if i >= 10:
                timings["copy_and_apply_us"].append(e0.elapsed_time(e2) * 1e3)
                timings["apply_us"].append(e1.elapsed_time(e2) * 1e3)
        out[str(b)] = {k: statistics.median(v) for k, v in timings.items()}
    return out


def _decode_ms(llm, batch: int, tokens: int, spec) -> tuple[float, list]:
    """ms per decode step at `batch` (all sequences in lockstep, greedy, EOS ignored), with the
    grammar `spec` on every sequence or none; and the outputs."""
    from engine import SamplingParams

    prompts = [[(1000 + 7 * i + j) % 30000 for j in range(128)] for i in range(batch)]

    def params(n: int):
        return SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=spec
        )

    llm.generate(prompts, params(4))  # captures this batch's CUDA graph
    torch.cuda.synchronize()
    outs = llm.generate(prompts, params(tokens))
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return 1e3 * (last - first) / (tokens - 1), outs


def _host_profile(llm, batch: int, tokens: int, spec, out_dir: str) -> str:
    """cProfile of the host over one decode run at `batch` with the grammar: where the step loop's
    time goes, by cumulative time, written to grammar_host_profile.txt."""
    import cProfile
    import io
    import pstats

    _decode_ms(llm, batch, tokens, spec)  # warm: graphs captured, masks' lexer states computed
    prof = cProfile.Profile()
    prof.enable()
    _decode_ms(llm, batch, tokens, spec)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    path = os.path.join(out_dir, "grammar_host_profile.txt")
    with open(path, "w") as f:
        f.write(text.getvalue())
    return path


@contextlib.contextmanager
def _timed_fills(backend) -> Iterator[list[float]]:
    """Seconds of each fill_bitmask call the engine makes inside the block (the engine's own call,
    timed around it); the backend's own method again after."""
    seconds: list[float] = []
    fill = backend.fill_bitmask

    def timed(bitmask, matchers):
        t0 = time.perf_counter()
        try:
            return fill(bitmask, matchers)
        finally:
            seconds.append(time.perf_counter() - t0)

    backend.fill_bitmask = timed
    try:
        yield seconds
    finally:
        del backend.fill_bitmask  # the class's own again


def _fresh_grammar(backend, index: int):
    """The 20-field schema under a title of its own (a compile the cache has not seen), compiled
    with the backend's current families (they grow while a run uses the grammar)."""
    spec = StructuredOutputs(json={**NESTED_20_FIELDS, "title": f"sweep {index}"})
    backend.compile(spec)
    return spec


def fill_stats(seconds: list[float], step_ms: float) -> dict:
    """The engine's fill calls: median, mean, p90, max ms, and how many took longer than a step
    without the grammar (those hold the step: the fill overlaps only the forward pass)."""
    ms = sorted(1e3 * s for s in seconds)
    return {
        "fills": len(ms),
        "fill_ms_median": statistics.median(ms),
        "fill_ms_mean": statistics.fmean(ms),
        "fill_ms_p90": ms[int(0.9 * (len(ms) - 1))],
        "fill_ms_max": ms[-1],
        "fills_over_step": sum(m > step_ms for m in ms),
    }


def thread_sweep(llm, args, spec) -> list[dict]:
    """At the largest batch: decode without and with the grammar for each (torch's CPU threads,
    the batch fill's threads, the grammar's families) setting, with the engine's fill calls timed
    (median, mean, p90 ms). Each setting compiles the schema anew and warms it with one run first
    (which grows its families)."""
    b = max(args.batch)
    default_torch = torch.get_num_threads()
    rows = []
    _decode_ms(llm, b, args.tokens, spec)  # graphs captured
    backend = llm.engine.grammars
    settings = [
        (t, f, fam)
        for t in args.torch_threads or [default_torch]
        for f in args.fill_threads or [0]
        for fam in args.families or [0]
    ]
    for index, (torch_threads, fill_threads, families) in enumerate(settings):
        torch.set_num_threads(torch_threads)
        backend.use_fill_threads(fill_threads or None, families or None)
        sweep_spec = _fresh_grammar(backend, index)
        _decode_ms(llm, b, args.tokens, sweep_spec)  # its lexers warm
        plain, _ = _decode_ms(llm, b, args.tokens, None)
        with _timed_fills(backend) as fills:
            grammar, _ = _decode_ms(llm, b, args.tokens, sweep_spec)
        row = {
            "batch": b,
            "torch_threads": torch_threads,
            "fill_threads": backend.fill_threads,
            "families": backend.families,
            "plain_ms": plain,
            "grammar_ms": grammar,
            "grammar_over_plain": grammar / plain,
            **fill_stats(fills, plain),
        }
        rows.append(row)
        print(
            f"threads torch {torch_threads}, fill {row['fill_threads']}, families "
            f"{row['families']}: b={b} {plain:.2f} ms plain, {grammar:.2f} ms with the grammar "
            f"({grammar / plain - 1:+.1%}); fill {row['fill_ms_median']:.2f} ms median, "
            f"{row['fill_ms_mean']:.2f} mean, {row['fill_ms_p90']:.2f} p90, "
            f"{row['fill_ms_max']:.1f} max; {row['fills_over_step']} of {row['fills']} longer "
            f"than a step",
            flush=True,
        )
    torch.set_num_threads(default_torch)
    backend.use_fill_threads(None)
    return rows


def engine_decode(args, tokenizer_json: str) -> dict:
    """The engine's own decode (SamplingParams.structured_outputs, async scheduling, CUDA graphs)
    at each batch, alternating runs without and with the 20-field schema on every sequence."""
    from bench.checkpoint import synthesize
    from engine import LLM

    model_dir = synthesize(
        args.config, os.path.join(args.model_dir, args.config.removesuffix(".json")), device="cuda"
    )
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        f.write(tokenizer_json)  # the engine's grammars read the model's own tokenizer
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        cuda_graph_sizes=args.batch,
    )
    spec = StructuredOutputs(json=NESTED_20_FIELDS)
    out = {
        "fill_threads": llm.engine.grammars.fill_threads,
        "families": llm.engine.grammars.families,
    }
    if args.profile:
        out["profile"] = _host_profile(llm, max(args.batch), args.tokens, spec, args.out)
    if args.fill_threads or args.torch_threads or args.families:
        out["threads"] = thread_sweep(llm, args, spec)
    for b in args.batch:
        runs: dict[str, list[float]] = {"plain_ms": [], "grammar_ms": []}
        fills: list[float] = []
        for _ in range(args.repeats):
            runs["plain_ms"].append(_decode_ms(llm, b, args.tokens, None)[0])
            with _timed_fills(llm.engine.grammars) as timed:
                ms, outs = _decode_ms(llm, b, args.tokens, spec)
            fills += timed
            runs["grammar_ms"].append(ms)
        row = {k: statistics.median(v) for k, v in runs.items()}
        row["grammar_over_plain"] = row["grammar_ms"] / row["plain_ms"]
        row.update(fill_stats(fills, row["plain_ms"]))
        row["runs"] = runs
        # steps each sequence spent inside its grammar (before the document ended)
        eos = set(llm.engine.eos_token_ids)
        inside = [
            next((i for i, t in enumerate(o.outputs[0].token_ids) if t in eos), args.tokens)
            for o in outs
        ]
        row["grammar_steps_median"] = statistics.median(inside)
        out[str(b)] = row
        print(
            f"decode b={b}: {row['plain_ms']:.2f} ms plain, {row['grammar_ms']:.2f} ms with the "
            f"grammar ({row['grammar_over_plain'] - 1:+.1%}); median {row['grammar_steps_median']} "
            f"of {args.tokens} steps inside the grammar; fill {row['fill_ms_median']:.2f} ms "
            f"median, {row['fill_ms_max']:.1f} max, {row['fills_over_step']} of {row['fills']} "
            f"longer than a step",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=TOKENIZER, help="the Llama-3 tokenizer.json")
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per decode run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="device,engine,engines", help="which parts to run")
    ap.add_argument("--profile", action="store_true", help="cProfile one grammar run first")
    ap.add_argument(
        "--fill-threads",
        nargs="*",
        type=int,
        default=[],
        help="sweep the batch fill's threads at the largest batch (0: llguidance's default)",
    )
    ap.add_argument(
        "--families",
        nargs="*",
        type=int,
        default=[],
        help="sweep the copies of the grammar built to fill in parallel (0: one per fill thread)",
    )
    ap.add_argument(
        "--torch-threads",
        nargs="*",
        type=int,
        default=[],
        help="sweep torch's CPU threads (torch.set_num_threads) in the same sweep",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = set(args.parts.split(","))
    with open(args.tokenizer) as f:
        tokenizer_json = f.read()
    vocab = json.loads(tokenizer_json)
    vocab_size = len(vocab["model"]["vocab"]) + len(vocab["added_tokens"])
    eot = next(t["id"] for t in vocab["added_tokens"] if t["content"] == "<|eot_id|>")
    backend = GrammarBackend(tokenizer_json, vocab_size, [eot])
    t0 = time.perf_counter()
    backend.compile(StructuredOutputs(json=NESTED_20_FIELDS))
    result: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "vocab_size": vocab_size,
        "compile_20_fields_with_tokenizer_s": time.perf_counter() - t0,
    }
    # the schema alone, the tokenizer table built: a schema the cache has not seen
    t0 = time.perf_counter()
    backend.compile(StructuredOutputs(json={**NESTED_20_FIELDS, "title": "another"}))
    result["compile_20_fields_s"] = time.perf_counter() - t0
    if "device" in parts:
        result["device_us"] = device_costs(vocab_size, args.batch)
        print("bitmask copy + apply:", json.dumps(result["device_us"]), flush=True)
    if "engine" in parts:
        result["engine"] = engine_decode(args, tokenizer_json)
    if "engines" in parts:
        from bench.grammar_engines import ENGINES, run, table

        engines = [e for e in ENGINES if _importable(e)]
        ns = SimpleNamespace(
            tokenizer=args.tokenizer,
            engines=engines,
            batch=args.batch,
            threads=min(os.cpu_count() or 1, 16),
            rounds=3,
            compile_runs=5,
            import_runs=5,
            seed=0,
        )
        result["engines"] = run(ns)
        print(table(result["engines"]))
    with open(os.path.join(args.out, "grammar_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'grammar_gpu.json')}")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
