"""`python -m warmup build --model MODEL [--arch sm_80,sm_90] [--no-gpu] [--dtype D] ...`:
compiled engines beside the model's snapshot (see warmup/build.py), one per architecture: on this
GPU (its own architecture, with the measured KV record), or compiled here without a GPU (--no-gpu,
or the other --arch names). Prints each artifact's path and build time."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 132,114, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m warmup", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build compiled-engine artifacts")
    b.add_argument(
        "--model",
        required=True,
        help="a snapshot directory, hub id, or s3:// URI (resolved by cache)",
    )
    b.add_argument("--revision", default=None, help="hub branch, tag or commit of --model")
    b.add_argument(
        "--arch",
        default=None,
        help="architectures to build for, e.g. sm_80,sm_86,sm_89,sm_90 "
        "(default: this GPU's; with --no-gpu: all supported)",
    )
    b.add_argument(
        "--no-gpu",
        action="store_true",
        help="compile without a GPU (kernels only; the KV cache is "
        "then sized by the analytic bound)",
    )
    b.add_argument(
        "--sm-count",
        type=_ints,
        default=None,
        metavar="N[,N]",
        help="SM counts to compile the decode attention for, beside each arch's known GPUs",
    )
    b.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes compiling without a GPU (default: one per CPU)",
    )
    b.add_argument("--dtype", default="auto")
    b.add_argument("--max-model-len", type=int, default=None)
    b.add_argument("--max-num-seqs", type=int, default=256)
    b.add_argument("--max-num-batched-tokens", type=int, default=8192)
    b.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3 or fp8_e5m2")
    b.add_argument(
        "--quantization", default=None, help="fp8: the worker's QUANTIZATION (FP8 weights)"
    )
    b.add_argument(
        "--out-dir", default=None, help="where artifacts go (default: <snapshot>/engines)"
    )
    b.add_argument(
        "--cache-dir", default=None, help="the snapshot cache, when --model is not a directory"
    )
    b.add_argument(
        "--push",
        default=None,
        metavar="S3_URI",
        help="also upload each artifact to S3_URI/engines/<id>",
    )
    k = sub.add_parser(
        "kernels",
        help="compile (or find) an engine's kernel set in a Triton cache without a GPU, at a low "
        "CPU priority (what a worker runs in the background after its first request)",
    )
    k.add_argument("--engine-args", required=True, help="the engine's EngineArgs as a JSON object")
    k.add_argument("--arch", required=True, help="one architecture, e.g. sm_90")
    k.add_argument("--sm-count", type=_ints, required=True, metavar="N[,N]")
    k.add_argument(
        "--triton-cache", required=True, help="the Triton cache directory to compile into"
    )
    k.add_argument(
        "--list",
        default=None,
        help="write the set here: a JSON object of its cache entries and, for each SM count, its "
        "kernels' specialization data (what the worker preloads)",
    )
    k.add_argument("--jobs", type=int, default=1, help="processes compiling at once")
    args = ap.parse_args(argv)
    if args.command == "kernels":
        return _kernels(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from warmup.aot import SUPPORTED_ARCHES, parse_arches

    try:
        arches = parse_arches(args.arch) if args.arch else None
    except ValueError as e:
        ap.error(str(e))
    limits = dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
    )
    where = dict(
        out_dir=args.out_dir, cache_dir=args.cache_dir, revision=args.revision, push=args.push
    )
    without_gpu = arches or list(SUPPORTED_ARCHES)
    built = []
    if not args.no_gpu:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA GPU here: add --no-gpu to compile for --arch without one")
        major, minor = torch.cuda.get_device_capability()
        own = f"sm_{major}{minor}"
        without_gpu = [a for a in (arches or []) if a != own]
        if arches is None or own in arches:
            from warmup.build import build

            built.append(build(args.model, **limits, **where))
    if without_gpu:
        from warmup.build import build_without_gpu

        jobs = args.jobs or os.cpu_count() or 1
        built += build_without_gpu(
            args.model, without_gpu, sm_counts=args.sm_count, jobs=jobs, **limits, **where
        )
    for path, data in built:
        print(path)
        print(f"build time {data['record']['build_seconds']:.1f} s ({data['key']['gpu_arch']})")
    return 0


def _kernels(args) -> int:
    import json

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.nice(10)  # beside a serving worker: its own threads come first
    from engine import EngineArgs
    from warmup.aot import compile_kernel_set, parse_arches

    engine_args = EngineArgs(**json.loads(args.engine_args))
    found = compile_kernel_set(
        engine_args, args.triton_cache, args.sm_count, parse_arches(args.arch)[0], args.jobs
    )
    if args.list:
        tmp = f"{args.list}.tmp"
        with open(tmp, "w") as f:
            json.dump({"entries": sorted(found.entries), "preload": found.preload}, f)
        os.replace(tmp, args.list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
