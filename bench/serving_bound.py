"""What bounds a serving run: the output rate its load would reach with every decode row's reads at
the copy bandwidth and every prompt token's linears at the GEMM rate, both measured here.

`python -m bench.serving_bound RUN.json [RUN.json ...] --out bound.json` reads
`bench.serving_profile` results: the prompt tokens each decode row brought with it, the mean
context of the decode steps, the weights and KV dtypes. It measures, on this GPU, the copy
bandwidth and the model's linears at `--rows` rows (bf16 through cuBLAS; FP8 weights through
`torch._scaled_mm` with per-tensor scales, the fastest FP8 GEMM measured here), then prints per run:
the measured output tok/s, the bound and its two terms. Attention's compute, norms, RoPE and
sampling are left out, so the bound is generous.

`python -m bench.serving_bound --fixed PROMPT:OUTPUT:USERS --config C --scheme fp8kv` takes instead
the load of USERS clients at fixed lengths (every one decoding at every step), and prints beside
the bound its read ceiling: the rate if every prompt token's linears ran inside a decode step's
reads, which no schedule beats at these ceilings. `--ceilings serving_bound.json` reuses the copy
bandwidth and GEMM rate a GPU run measured (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

import torch

from bench.checkpoint import CONFIGS
from bench.layer_shapes import layer_linears
from bench.roofline import model_bytes
from bench.serving_profile import linear_params
from engine.config import ModelConfig


@dataclass(frozen=True)
class Load:
    """What a serving run asked of the GPU, per decode row."""

    output_tok_s: float
    output_per_decode_row: float  # a request's first token comes from its prompt step
    prompt_per_decode_row: float
    mean_context: float
    decode_rows_per_step: float  # they share one read of the weights
    fp8_weights: bool
    fp8_kv: bool


def load_of(result: dict) -> Load:
    """The load of one bench.serving_profile result."""
    steps = result["steps"]
    decode_rows = sum(s["steps"] * s["mean_decode_rows"] for s in steps.values())
    prompt = sum(s["steps"] * s["mean_prefill_tokens"] for s in steps.values())
    decodes = [s for s in result["step_samples"] if s["kind"] == "decode" and s["decode_rows"]]
    args = result["meta"]["args"]
    return Load(
        output_tok_s=result["serving"]["output_tok_s"],
        output_per_decode_row=result["serving"]["output_tok_s"] * result["window_s"] / decode_rows,
        prompt_per_decode_row=prompt / decode_rows,
        mean_context=sum(s["pairs"] for s in decodes) / sum(s["decode_rows"] for s in decodes),
        decode_rows_per_step=decode_rows / sum(s["steps"] for s in steps.values()),
        fp8_weights=args.get("quantization") == "fp8",
        fp8_kv=str(args.get("kv_cache_dtype", "auto")).startswith("fp8"),
    )


def _step_bytes(load: Load, config: dict) -> tuple[int, int, int]:
    """(parameters of the layers' linears a token multiplies, bytes of the weights a decode step
    reads, bytes of KV a token holds) under the load's dtypes: FP8 linears and an FP8 cache take
    one byte a value."""
    layer_params, _ = linear_params(config)
    size = model_bytes(config, torch.bfloat16)
    weights = size.decode_weights - (layer_params if load.fp8_weights else 0)
    return layer_params, weights, size.kv_per_token // (2 if load.fp8_kv else 1)


def bound(load: Load, config: dict, copy_bw: float, gemm_flop_s: float) -> dict:
    """Output tok/s with the decode reads at copy_bw and the prompt linears at gemm_flop_s."""
    layer_params, weights, kv_per_token = _step_bytes(load, config)
    decode_s = (weights / load.decode_rows_per_step + load.mean_context * kv_per_token) / copy_bw
    prompt_s = load.prompt_per_decode_row * 2 * layer_params / gemm_flop_s
    rate = load.output_per_decode_row / (decode_s + prompt_s)
    return {
        "decode_us_per_row": decode_s * 1e6,
        "prompt_us_per_row": prompt_s * 1e6,
        "bound_output_tok_s": rate,
        "measured_of_bound": load.output_tok_s / rate,
    }


def fixed_load(prompt: int, output: int, users: int, fp8_weights: bool, fp8_kv: bool) -> Load:
    """The load of `users` closed-loop clients each asking for `output` tokens after a
    `prompt`-token prompt, at its heaviest: every client decoding at every step. A request's first
    token comes from its prompt step, the other output - 1 from decode rows at contexts
    prompt + 1 to prompt + output - 1. Nothing measured: output_tok_s is 0."""
    rows = output - 1
    return Load(
        output_tok_s=0.0,
        output_per_decode_row=output / rows,
        prompt_per_decode_row=prompt / rows,
        mean_context=prompt + output / 2,
        decode_rows_per_step=users,
        fp8_weights=fp8_weights,
        fp8_kv=fp8_kv,
    )


def read_ceiling(load: Load, config: dict, copy_bw: float, gemm_flop_s: float) -> dict:
    """Output tok/s if every prompt token's linears ran inside a decode step (a mixed step reads the
    weights once for its decode rows and its prompt tokens alike): a step yields one token per
    decode row and takes at least the longer of its reads (the weights, each row's KV) at copy_bw
    and its rows' and their prompt tokens' linears at gemm_flop_s. No schedule of this load beats
    it at these ceilings; bound() charges the prompts apart, as steps of their own."""
    layer_params, weights, kv_per_token = _step_bytes(load, config)
    rows = load.decode_rows_per_step
    read_s = (weights + rows * load.mean_context * kv_per_token) / copy_bw
    compute_s = rows * (1 + load.prompt_per_decode_row) * 2 * layer_params / gemm_flop_s
    return {
        "step_read_ms": read_s * 1e3,
        "step_compute_ms": compute_s * 1e3,
        "ceiling_output_tok_s": rows * load.output_per_decode_row / max(read_s, compute_s),
    }


def measured_ceilings(path: str, fp8_weights: bool) -> tuple[float, float]:
    """(copy bandwidth, GEMM FLOP/s) from a serving_bound.json this module wrote: its copy
    bandwidth and the fastest GEMM rate among its runs with the same weights."""
    stored = json.load(open(path))
    rates = [r["gemm_flop_s"] for r in stored["runs"].values() if r["fp8_weights"] == fp8_weights]
    if not rates:
        raise SystemExit(f"--ceilings: {path} has no run with fp8_weights={fp8_weights}")
    return stored["copy_bandwidth"], max(rates)


def gemm_flop_s(config: dict, rows: int, fp8: bool) -> float:
    """FLOP/s of one decoder layer's linears at `rows` rows, each timed in a CUDA graph."""
    from bench.attention_micro import time_call

    seconds = flops = 0.0
    for _, n, k in layer_linears(ModelConfig.from_dict(config)):
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        w = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
        if fp8:
            xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")

            def run(xq=xq, wq=wq, one=one):
                torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        else:

            def run(x=x, w=w):
                torch.nn.functional.linear(x, w)

        seconds += time_call(run, graph=True)
        flops += 2 * rows * n * k
    return flops / seconds


SCHEMES = {"bf16": (False, False), "fp8": (True, False), "fp8kv": (True, True)}
# the options' values when not given (they default to None, so that main sees which were)
DEFAULTS = {"rows": 1024, "config": "llama-3.1-8b.json", "scheme": "bf16"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("runs", nargs="*", help="bench.serving_profile results (serving_profile.json)")
    ap.add_argument("--rows", type=int, help="rows of the timed prompt GEMMs (default 1024)")
    ap.add_argument(
        "--fixed",
        default="",
        help="PROMPT:OUTPUT:USERS: instead of runs, the load of USERS clients at these lengths "
        "(with --config and --scheme), its bound and its read ceiling",
    )
    ap.add_argument("--config", help="--fixed: a bench/configs file (default llama-3.1-8b.json)")
    ap.add_argument("--scheme", choices=sorted(SCHEMES), help="--fixed: dtypes (default bf16)")
    ap.add_argument(
        "--ceilings",
        help="--fixed: a serving_bound.json measured before (its copy bandwidth and GEMM rate) "
        "instead of measuring on this GPU",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out") + "/serving_bound.json")
    a = ap.parse_args(argv)
    fixed_only = [
        f"--{name}" for name in ("config", "scheme", "ceilings") if getattr(a, name) is not None
    ]
    if a.fixed and a.runs:
        raise SystemExit("--fixed: give runs or --fixed, not both")
    if a.fixed and a.ceilings is not None and a.rows is not None:
        raise SystemExit("--rows: with --ceilings nothing is timed (the stored GEMM rate is used)")
    for name, value in DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.fixed:
        out = fixed_main(a)
    elif a.runs:
        if fixed_only:
            raise SystemExit(f"{', '.join(fixed_only)}: only with --fixed (runs carry their own)")
        out = runs_main(a)
    else:
        raise SystemExit("give serving_profile.json runs, or --fixed PROMPT:OUTPUT:USERS")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


def fixed_main(a) -> dict:
    prompt, output, users = (int(x) for x in a.fixed.split(":"))
    if prompt < 1 or output < 2 or users < 1:
        raise SystemExit(f"--fixed {a.fixed}: needs PROMPT >= 1, OUTPUT >= 2, USERS >= 1")
    fp8_weights, fp8_kv = SCHEMES[a.scheme]
    config = json.load(open(CONFIGS / a.config))
    if a.ceilings:
        copy_bw, rate = measured_ceilings(a.ceilings, fp8_weights)
        source = a.ceilings
    else:
        from bench.roofline import copy_bandwidth

        copy_bw, rate = copy_bandwidth("cuda", 2 << 30), gemm_flop_s(config, a.rows, fp8_weights)
        source = torch.cuda.get_device_name()
    load = fixed_load(prompt, output, users, fp8_weights, fp8_kv)
    terms = {**bound(load, config, copy_bw, rate), **read_ceiling(load, config, copy_bw, rate)}
    del terms["measured_of_bound"]
    print(
        f"{a.config} {a.scheme}, {users} clients at {prompt} / {output} tokens, "
        f"{copy_bw / 1e12:.2f} TB/s and {rate / 1e12:.0f} TFLOP/s ({source}): "
        f"bound {terms['bound_output_tok_s']:.0f} output tok/s (prompts apart), "
        f"ceiling {terms['ceiling_output_tok_s']:.0f} (prompts inside decode steps: a step reads "
        f"for {terms['step_read_ms']:.1f} ms, computes for {terms['step_compute_ms']:.1f} ms)",
        flush=True,
    )
    return {
        "ceilings_from": source,
        "copy_bandwidth": copy_bw,
        "gemm_flop_s": rate,
        "config": a.config,
        "scheme": a.scheme,
        "load": asdict(load),
        **terms,
    }


def runs_main(a) -> dict:
    from bench.roofline import copy_bandwidth

    results = {path: json.load(open(path)) for path in a.runs}
    configs = {r["meta"]["args"]["config"] for r in results.values()}
    config = {name: json.load(open(CONFIGS / name)) for name in configs}
    copy_bw = copy_bandwidth("cuda", 2 << 30)
    rates = {}
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth": copy_bw, "runs": {}}
    for path, result in results.items():
        load = load_of(result)
        name = result["meta"]["args"]["config"]
        key = (name, load.fp8_weights)
        if key not in rates:
            rates[key] = gemm_flop_s(config[name], a.rows, load.fp8_weights)
        terms = bound(load, config[name], copy_bw, rates[key])
        out["runs"][path] = {**asdict(load), "gemm_flop_s": rates[key], **terms}
        print(
            f"{path}: {load.output_tok_s:.0f} output tok/s measured, "
            f"bound {terms['bound_output_tok_s']:.0f} "
            f"({terms['measured_of_bound']:.0%}): decode {terms['decode_us_per_row']:.0f} us/row "
            f"at {copy_bw / 1e12:.2f} TB/s, prompt {terms['prompt_us_per_row']:.0f} us/row "
            f"({load.prompt_per_decode_row:.2f} tokens at {rates[key] / 1e12:.0f} TFLOP/s), "
            f"context {load.mean_context:.0f}",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
