"""xgrammar against llguidance on what structured outputs cost: import time, tokenizer set-up,
JSON-schema compile time, the per-step token-mask fill at batch 1 and 64, and which JSON Schema
keywords each enforces.

    python -m bench.grammar_engines [--tokenizer tokenizer.json | llama3/tokenizer.model]

Both engines see the same tokenizer (by default the Llama-3 one, 128,256 tokens, from the
llama-models wheel), the same schemas and the same token streams; both fill a CPU int32 bitmask as
the engine's sampler will consume it. Prints a table last and writes JSON (and a PNG when matplotlib
is there) under --out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import time

import numpy as np

from bench.grammar_schemas import (
    FEATURE_CASES,
    NESTED_20_FIELDS,
    FeatureCase,
    nested_instance,
    pydantic_case,
)
from bench.grammar_tokenizer import load_bench_tokenizer

ENGINES = ("llguidance", "xgrammar")


class LLGuidance:
    """llguidance as engine/structured.py uses it: the tokenizer from tokenizer.json's text;
    compiling a schema builds a template LLMatcher, and each request gets a deep copy of it (copies
    share the lexer states the template and earlier copies computed)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: list[int], threads: int):
        import llguidance

        self.lib = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=stop_ids
        )
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        error = self.lib.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        template = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask[row].ctypes.data, bitmask.shape[1] * 4)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepts_end(self, matcher) -> bool:
        return matcher.is_accepting()


class XGrammar:
    """xgrammar: TokenizerInfo from the byte-level vocabulary (no transformers tokenizer), a
    GrammarCompiler with its cache off so every compile is measured, a GrammarMatcher per
    request."""

    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: list[int], threads: int):
        import xgrammar

        self.lib = xgrammar
        vocab = json.loads(tokenizer_json)
        encoded = [""] * vocab_size
        for text, i in vocab["model"]["vocab"].items():
            encoded[i] = text
        for added in vocab["added_tokens"]:
            encoded[added["id"]] = added["content"]
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        self.info = xgrammar.TokenizerInfo(
            encoded,
            meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=stop_ids,
            add_prefix_space=meta["add_prefix_space"],
        )
        self.compiler = xgrammar.GrammarCompiler(
            self.info, max_threads=threads, cache_enabled=False
        )
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.stop_ids = stop_ids

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=False)

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepts_end(self, matcher) -> bool:
        return matcher.accept_token(self.stop_ids[0]) and matcher.is_terminated()


def _engine(name: str, tokenizer_json: str, vocab_size: int, stop_ids: list[int], threads: int):
    return (LLGuidance if name == "llguidance" else XGrammar)(
        tokenizer_json, vocab_size, stop_ids, threads
    )


# ---- measurements
# ---------------------------------------------------------------------------------


def import_seconds(module: str, after: str | None, runs: int) -> list[float]:
    """Seconds `import module` takes in a fresh interpreter (after an untimed `import after`)."""
    pre = f"import {after}; " if after else ""
    timed = f"t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    code = f"{pre}import time; {timed}"
    out = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        out.append(float(done.stdout.strip().splitlines()[-1]))
    return out


def _summary(values: list[float], scale: float = 1e6) -> dict:
    arr = np.asarray(values) * scale
    return {
        "median": float(np.median(arr)),
        "mean": float(arr.mean()),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
        "n": int(arr.size),
    }


def compile_seconds(engine, schema: dict, runs: int) -> dict:
    """Schema -> compiled grammar -> a matcher -> its first mask: each part timed, `runs` times."""
    parts: dict[str, list[float]] = {"compile": [], "matcher": [], "first_mask": []}
    bitmask = np.zeros((1, engine.mask_words), dtype=np.int32)
    for _ in range(runs):
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        t1 = time.perf_counter()
        matcher = engine.matcher(compiled)
        t2 = time.perf_counter()
        engine.fill(matcher, bitmask, 0)
        t3 = time.perf_counter()
        parts["compile"].append(t1 - t0)
        parts["matcher"].append(t2 - t1)
        parts["first_mask"].append(t3 - t2)
    total = [a + b + c for a, b, c in zip(parts["compile"], parts["matcher"], parts["first_mask"])]
    out = {k: _summary(v, 1e3) for k, v in parts.items()}
    out["total"] = _summary(total, 1e3)
    return out


def _without_length_bounds(schema):
    if isinstance(schema, dict):
        return {
            k: _without_length_bounds(v)
            for k, v in schema.items()
            if k not in ("minLength", "maxLength")
        }
    if isinstance(schema, list):
        return [_without_length_bounds(v) for v in schema]
    return schema


COMPILE_PROBES = {
    "string": {"type": "string"},
    "string, maxLength 40": {"type": "string", "maxLength": 40},
    "string, maxLength 200": {"type": "string", "maxLength": 200},
    "20-field schema without min/maxLength": _without_length_bounds(NESTED_20_FIELDS),
}


def compile_probes(engine) -> dict[str, float]:
    """Milliseconds to compile single features: what a schema's compile time grows with."""
    out = {}
    for name, schema in COMPILE_PROBES.items():
        t0 = time.perf_counter()
        engine.compile(schema)
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


def step_costs(engine, compiled, streams: list[list[int]], rounds: int) -> dict:
    """Per decode step of a batch of len(streams) requests: fill every row's mask (one batched call
    when the batch is larger than one), then accept each row's next token. Steps run while every row
    has a token left. The first round meets the schema cold (the first requests after its compile);
    the later rounds are new requests with the same schema ("warm"), as a service sees a schema its
    clients send again and again."""
    batch = len(streams)
    steps = min(len(s) for s in streams)
    bitmask = np.zeros((batch, engine.mask_words), dtype=np.int32)
    fills: list[float] = []
    accepts: list[float] = []
    allowed: list[int] = []
    for _ in range(rounds):
        matchers = [engine.matcher(compiled) for _ in range(batch)]
        for t in range(steps):
            t0 = time.perf_counter()
            if batch == 1:
                engine.fill(matchers[0], bitmask, 0)
            else:
                engine.fill_batch(matchers, bitmask)
            t1 = time.perf_counter()
            for m, s in zip(matchers, streams):
                if not engine.accept(m, s[t]):
                    raise RuntimeError(f"{engine.name} refused token {s[t]} at step {t}")
            t2 = time.perf_counter()
            fills.append(t1 - t0)
            accepts.append(t2 - t1)
            allowed.append(int(np.unpackbits(bitmask[0].view(np.uint8)).sum()))
    return {
        "batch": batch,
        "steps": steps,
        "rounds": rounds,
        "fill_us_cold": _summary(fills[:steps]),
        "fill_us": _summary(fills[steps:] or fills),
        "accept_us": _summary(accepts),
        "fill_plus_accept_us_per_row": float(np.median(np.add(fills, accepts)) * 1e6 / batch),
        "allowed_tokens_row0": {"median": float(np.median(allowed)), "min": int(min(allowed))},
    }


def check_case(engine, case: FeatureCase, encode) -> dict:
    """Does the engine compile the case's schema, take its valid texts, refuse the invalid?"""
    try:
        compiled = engine.compile(case.schema)
        engine.matcher(compiled)
    except Exception as exc:  # noqa: BLE001 - an engine's refusal is the result being measured
        return {"verdict": "refused", "error": str(exc).splitlines()[0][:300]}

    def accepts(text: str) -> bool:
        matcher = engine.matcher(compiled)
        return all(engine.accept(matcher, t) for t in encode(text)) and engine.accepts_end(matcher)

    wrong_refusals = [t for t in case.valid if not accepts(t)]
    let_through = [t for t in case.invalid if accepts(t)]
    verdict = (
        "enforced"
        if not wrong_refusals and not let_through
        else ("refuses valid" if wrong_refusals else "not enforced")
    )
    return {"verdict": verdict, "valid_refused": wrong_refusals, "invalid_accepted": let_through}


def special_tokens_in_strings(
    engine, compiled_string_schema, encode, special_ids: list[int]
) -> int:
    """How many special (added) token ids the mask allows inside a JSON string: each would put a
    control token such as <|python_tag|> into the value (and vanish from the text when special
    tokens are skipped)."""
    matcher = engine.matcher(compiled_string_schema)
    for t in encode('{"s": "ab'):
        engine.accept(matcher, t)
    bitmask = np.zeros((1, engine.mask_words), dtype=np.int32)
    engine.fill(matcher, bitmask, 0)
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
    return int(sum(bits[i] for i in special_ids))


def run(args: argparse.Namespace) -> dict:
    from tokenizers import Tokenizer

    tokenizer, source = load_bench_tokenizer(args.tokenizer)
    assert isinstance(tokenizer, Tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer_json = tokenizer.to_str()
    special_ids = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    stop_names = (
        "<|eot_id|>",
        "<|end_of_text|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|endoftext|>",
        "</s>",
    )
    stop_ids = [i for i in (tokenizer.token_to_id(n) for n in stop_names) if i is not None][:3]
    if not stop_ids:
        raise SystemExit(
            "the tokenizer has none of the usual end-of-turn tokens: " + ", ".join(stop_names)
        )

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    rng = random.Random(args.seed)
    streams = [encode(json.dumps(nested_instance(rng))) for _ in range(max(args.batch))]
    result: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.node(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "threads": args.threads,
            "tokenizer": source,
            "vocab_size": vocab_size,
            "stop_ids": stop_ids,
            "schema_fields": 20,
            "tokens_per_instance": [len(s) for s in streams[:8]],
        },
        "engines": {},
    }
    for name in args.engines:
        entry: dict = {"version": importlib.metadata.version(name)}
        entry["import_s"] = _summary(import_seconds(name, None, args.import_runs), 1)
        entry["import_after_torch_s"] = _summary(import_seconds(name, "torch", args.import_runs), 1)
        entry["imports_transformers"] = (
            subprocess.run(
                [sys.executable, "-c", f"import sys, {name}; print('transformers' in sys.modules)"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            == "True"
        )
        t0 = time.perf_counter()
        engine = _engine(name, tokenizer_json, vocab_size, stop_ids, args.threads)
        entry["tokenizer_setup_s"] = time.perf_counter() - t0
        engine.mask_words = (vocab_size + 31) // 32
        entry["compile_20_fields_ms"] = compile_seconds(engine, NESTED_20_FIELDS, args.compile_runs)
        entry["compile_probes_ms"] = compile_probes(engine)
        compiled = engine.compile(NESTED_20_FIELDS)
        entry["steps"] = {
            str(b): step_costs(engine, compiled, streams[:b], args.rounds) for b in args.batch
        }
        cases = FEATURE_CASES + [pydantic_case()]
        entry["features"] = {c.feature: check_case(engine, c, encode) for c in cases}
        string_schema = engine.compile({"type": "object", "properties": {"s": {"type": "string"}}})
        entry["special_tokens_allowed_in_strings"] = special_tokens_in_strings(
            engine, string_schema, encode, special_ids
        )
        result["engines"][name] = entry
        print(f"{name}: done", file=sys.stderr, flush=True)
    return result


def table(result: dict) -> str:
    names = list(result["engines"])
    rows = [("", *names)]
    for name in names:
        e = result["engines"][name]
        e["_cols"] = [
            f"{e['import_s']['median']:.2f} s",
            f"{e['import_after_torch_s']['median']:.2f} s",
            "yes" if e["imports_transformers"] else "no",
            f"{e['tokenizer_setup_s']:.2f} s",
            f"{e['compile_20_fields_ms']['total']['median']:.1f} ms "
            f"(compile {e['compile_20_fields_ms']['compile']['median']:.1f}, "
            f"first mask {e['compile_20_fields_ms']['first_mask']['median']:.1f})",
            *(f"{ms:.1f} ms" for ms in e.get("compile_probes_ms", {}).values()),
            *(
                f"{s['fill_us']['median']:.0f} us (p99 {s['fill_us']['p99']:.0f}; "
                f"cold {s['fill_us_cold']['median']:.0f})"
                for s in e["steps"].values()
            ),
            f"{sum(v['verdict'] == 'enforced' for v in e['features'].values())}"
            f"/{len(e['features'])}",
            str(e["special_tokens_allowed_in_strings"]),
        ]
    labels = [
        "import (fresh process)",
        "import after torch",
        "imports transformers",
        "tokenizer set-up",
        "20-field schema to first mask",
        *(f"compile: {name}" for name in result["engines"][names[0]].get("compile_probes_ms", {})),
        *(f"mask fill per step, batch {b} (median)" for b in result["engines"][names[0]]["steps"]),
        "schema features enforced",
        "special tokens allowed in a string",
    ]
    for i, label in enumerate(labels):
        rows.append((label, *(result["engines"][n]["_cols"][i] for n in names)))
    for n in names:
        del result["engines"][n]["_cols"]
    feats = list(result["engines"][names[0]]["features"])
    rows.append(("", *("" for _ in names)))
    for f in feats:
        rows.append((f, *(result["engines"][n]["features"][f]["verdict"] for n in names)))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(result["engines"])
    batches = list(result["engines"][names[0]]["steps"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        med = [result["engines"][name]["steps"][b]["fill_us"]["median"] for b in batches]
        ax.bar([i + k * width for i in range(len(batches))], med, width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(batches))])
    ax.set_xticklabels([f"batch {b}" for b in batches])
    ax.set_ylabel("mask fill per step (us, median)")
    ax.set_title(
        f"{result['meta']['vocab_size']}-token vocabulary, 20-field schema, "
        f"{result['meta']['threads']} threads"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json, a model dir, or a Llama-3 tokenizer.model",
    )
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    parser.add_argument(
        "--threads",
        type=int,
        default=min(os.cpu_count() or 1, 16),
        help="mask-fill threads, the same for both engines",
    )
    parser.add_argument("--rounds", type=int, default=3, help="passes over the token streams")
    parser.add_argument("--compile-runs", type=int, default=5)
    parser.add_argument("--import-runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="cpu", help="file name part: the machine (cpu, h100 ...)")
    args = parser.parse_args()
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{result['meta']['date']}-{args.tag}-grammar-engines")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    print(table(result))
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
