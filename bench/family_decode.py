"""Batch-1 decode of several model families in one run, each against the roofline of the bytes a
token reads (bench/moe_decode.py's count: every weight but a gathered embedding table, the selected
experts only, the KV cache), with random bf16 weights made on the GPU (load_format "dummy").

`python -m bench.family_decode --out DIR` (default configs: Llama-3.1-8B, Phi-4, Gemma-3-27B-it)
writes DIR/family_decode.json and prints a table. `--variants as-is,no-rope-in-attention,as-is`
builds each config's engine once per listed variant (VARIANTS: a decode-path switch set away
from its default), in that order, so an A/B runs interleaved on one machine. `--quantization
none,fp8` runs each config with bf16 weights, then FP8 (EngineArgs' quantization); `--batch N`
decodes N sequences in lockstep.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.checkpoint import config_only_dir
from bench.moe_decode import bytes_per_token
from bench.reference_decode import decode_step_seconds, graph_replay_seconds
from bench.roofline import copy_bandwidth
from bench.serving import config_path
from engine import LLM

DEFAULT_CONFIGS = "llama-3.1-8b.json,phi-4.json,gemma-3-27b-it.json"
# decode-path switches a run compares: (module, attribute, value) set while the engine is built
VARIANTS = {
    "as-is": (),
    "no-rope-in-attention": (("engine.attention.triton_attn", "ROTATE_IN_KERNEL", False),),
    "no-step-transfer": (("engine.step_transfer", "ENABLED", False),),
    "copy-on-step-stream": (("engine.sampling", "COPY_ON_SIDE_STREAM", False),),
    "pdl-prologues": (("engine.layers.row_gemv", "PDL_PROLOGUES", True),),
    "no-fused-quantize": (("engine.layers.fused_linears", "FUSE_QUANTIZE", False),),
    "no-gated-epilogue": (("engine.layers.fused_linears", "GATED", False),),
    "no-norm-after": (("engine.layers.fused_linears", "NORM_AFTER", False),),
    "norm-after-no-pdl": (("engine.layers.row_gemv", "PDL_NORMED", False),),
    "moe-no-norm-after": (("engine.layers.moe", "NORM_AFTER", False),),
    "moe-no-normed-input": (("engine.layers.moe", "NORMED_INPUT", False),),
    "moe-no-split": (
        ("engine.layers.moe", "NORM_AFTER", False),
        ("engine.layers.moe", "NORMED_INPUT", False),
    ),
}


@contextlib.contextmanager
def switched(variant: str) -> Iterator[None]:
    """VARIANTS[variant]'s switches set inside, the modules' own values restored after."""
    saved = []
    try:
        for module_name, name, value in VARIANTS[variant]:
            module = importlib.import_module(module_name)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def decode_row(
    name: str,
    root: str,
    bandwidth: float,
    prompt_len: int,
    new_tokens: int,
    quantization: str | None = None,
    batch: int = 1,
) -> dict:
    """One config's decode of `batch` sequences in lockstep (CUDA graphs, random weights made on
    the GPU, `quantization` as EngineArgs takes it) and its floor: the bytes a step reads at
    `bandwidth` (the weights once, each sequence's KV; for batch 1, the selected experts only: a
    larger batch of a mixture of experts gets no floor, its experts' bytes unknown)."""
    config = json.loads(config_path(name).read_text())
    llm = LLM(
        model=config_only_dir(config, Path(name).stem, root),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        max_num_seqs=max(8, batch),
        cuda_graph_sizes=[batch],
        quantization=quantization,
    )
    try:
        read = bytes_per_token(llm.engine.runner.model, prompt_len + new_tokens // 2)
        step = decode_step_seconds(llm, batch, prompt_len=prompt_len, new_tokens=new_tokens)
        replay = graph_replay_seconds(llm, batch)
        experts = read["experts_all"] > 0
    finally:
        llm.shutdown()
        del llm
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()
    step_bytes = read["total"] + (batch - 1) * read["kv"]
    floor = None if batch > 1 and experts else step_bytes / bandwidth
    return {
        "config": name,
        "batch": batch,
        "gb_per_token": step_bytes / 1e9,
        "ms_per_step": step * 1e3,
        "floor_ms": None if floor is None else floor * 1e3,
        "of_roofline": None if floor is None else floor / step,
        "graph_replay_ms": None if replay is None else replay * 1e3,
    }


def family_row(
    name: str,
    root: str,
    bandwidth: float,
    prompt_len: int,
    new_tokens: int,
    variant: str,
    quantization: str | None = None,
    batch: int = 1,
) -> dict:
    """One config's decode of `batch` sequences (CUDA graphs) and its floor, its engine built
    under `variant` with `quantization` (EngineArgs')."""
    with switched(variant):
        row = decode_row(name, root, bandwidth, prompt_len, new_tokens, quantization, batch)
    row["variant"] = variant
    row["quantization"] = quantization or "none"
    print(
        f"{name} ({row['quantization']}, {variant}, batch {batch}): {row['ms_per_step']:.2f} "
        f"ms/step, {_of_floor(row)} ({row['gb_per_token']:.2f} GB a step)",
        flush=True,
    )
    return row


def _of_floor(row: dict) -> str:
    if row["floor_ms"] is None:
        return "no floor"
    return f"{row['of_roofline']:.0%} of the {row['floor_ms']:.2f} ms floor"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help="bench/configs names, comma-separated"
    )
    ap.add_argument("--model-dir", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--variants", default="as-is", help=f"comma-separated, in run order: {', '.join(VARIANTS)}"
    )
    ap.add_argument(
        "--quantization", default="none", help="comma-separated: none (bf16 weights), fp8"
    )
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded in lockstep")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    quantizations = [None if q == "none" else q for q in args.quantization.split(",") if q]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    rows = [
        family_row(
            name,
            args.model_dir,
            bandwidth,
            args.prompt_len,
            args.new_tokens,
            variant,
            q,
            args.batch,
        )
        for name in args.configs.split(",")
        if name
        for q in quantizations
        for variant in variants
    ]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "copy_bandwidth": bandwidth,
        "rows": rows,
    }
    with open(os.path.join(args.out, "family_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"\n{result['device']}, bf16 activations, batch {args.batch}, copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s"
    )
    print("| config | weights | variant | GB read a step | ms/step | floor ms | of roofline |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        floor = "- | -"
        if r["floor_ms"] is not None:
            floor = f"{r['floor_ms']:.2f} | {r['of_roofline']:.0%}"
        print(
            f"| {r['config']} | {r['quantization']} | {r['variant']} | {r['gb_per_token']:.2f} "
            f"| {r['ms_per_step']:.2f} | {floor} |"
        )


if __name__ == "__main__":
    main()
