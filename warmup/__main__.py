"""`python -m warmup build --model MODEL [--dtype D] [--max-model-len N] [--max-num-seqs N] ...`: build a compiled
engine for this GPU beside the model's snapshot (see warmup/build.py); prints its path and the build time."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m warmup", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a compiled-engine artifact for this GPU")
    b.add_argument("--model", required=True, help="a snapshot directory, hub id, or s3:// URI (resolved by cache)")
    b.add_argument("--revision", default=None, help="hub branch, tag or commit of --model")
    b.add_argument("--dtype", default="auto")
    b.add_argument("--max-model-len", type=int, default=None)
    b.add_argument("--max-num-seqs", type=int, default=256)
    b.add_argument("--max-num-batched-tokens", type=int, default=8192)
    b.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--out-dir", default=None, help="where artifacts go (default: <snapshot>/engines)")
    b.add_argument("--cache-dir", default=None, help="the snapshot cache, when --model is not a directory")
    b.add_argument("--push", default=None, metavar="S3_URI", help="also upload the artifact to S3_URI/engines/<id>")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from warmup.build import build

    path, data = build(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                       out_dir=args.out_dir, cache_dir=args.cache_dir, revision=args.revision, push=args.push)
    print(path)
    print(f"build time {data['record']['build_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
