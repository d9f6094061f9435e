"""Batch-1 decode of several model families in one run, each against the roofline of the bytes a
token reads (bench/moe_decode.py's count: every weight but a gathered embedding table, the selected
experts only, the KV cache), with random bf16 weights made on the GPU (load_format "dummy").

`python -m bench.family_decode --out DIR` (default configs: Llama-3.1-8B, Phi-4, Gemma-3-27B-it)
writes DIR/family_decode.json and prints a table. `--variants as-is,no-rope-in-attention,as-is`
builds each config's engine once per listed variant (VARIANTS: a decode-path switch set away
from its default), in that order, so an A/B runs interleaved on one machine.
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
    "pdl-prologues": (("engine.layers.row_gemv", "PDL_PROLOGUES", True),),
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
) -> dict:
    """One config's batch-1 decode (CUDA graphs, random weights made on the GPU, `quantization` as
    EngineArgs takes it) and its floor: the bytes a token reads at `bandwidth`."""
    config = json.loads(config_path(name).read_text())
    llm = LLM(
        model=config_only_dir(config, Path(name).stem, root),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        max_num_seqs=8,
        cuda_graph_sizes=[1],
        quantization=quantization,
    )
    try:
        read = bytes_per_token(llm.engine.runner.model, prompt_len + new_tokens // 2)
        step = decode_step_seconds(llm, 1, prompt_len=prompt_len, new_tokens=new_tokens)
        replay = graph_replay_seconds(llm, 1)
    finally:
        llm.shutdown()
        del llm
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()
    floor = read["total"] / bandwidth
    return {
        "config": name,
        "gb_per_token": read["total"] / 1e9,
        "ms_per_step": step * 1e3,
        "floor_ms": floor * 1e3,
        "of_roofline": floor / step,
        "graph_replay_ms": None if replay is None else replay * 1e3,
    }


def family_row(
    name: str, root: str, bandwidth: float, prompt_len: int, new_tokens: int, variant: str
) -> dict:
    """One config's batch-1 decode (CUDA graphs) and its floor, its engine built under
    `variant`."""
    with switched(variant):
        row = decode_row(name, root, bandwidth, prompt_len, new_tokens)
    row["variant"] = variant
    print(
        f"{name} ({variant}): {row['ms_per_step']:.2f} ms/step, {row['of_roofline']:.0%} of the "
        f"{row['floor_ms']:.2f} ms floor ({row['gb_per_token']:.2f} GB/token)",
        flush=True,
    )
    return row


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
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    bandwidth = copy_bandwidth("cuda", 2 << 30)
    rows = [
        family_row(name, args.model_dir, bandwidth, args.prompt_len, args.new_tokens, variant)
        for name in args.configs.split(",")
        if name
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
    print(f"\n{result['device']}, bf16, batch 1, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| config | variant | GB read per token | ms/step | floor ms | of roofline |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['config']} | {r['variant']} | {r['gb_per_token']:.2f} | {r['ms_per_step']:.2f} "
            f"| {r['floor_ms']:.2f} | {r['of_roofline']:.0%} |"
        )


if __name__ == "__main__":
    main()
