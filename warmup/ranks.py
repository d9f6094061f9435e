"""Tensor parallelism in the start sequence: ranks 1..N-1 start first thing, before this
process imports torch, each in its own process (`python -m warmup.ranks`) that streams its own
pack shard to its GPU (cache.device_stream) while it imports the engine; the engine, rank 0 in this
process, takes them over when it builds. A rank's death fails the jobs in flight (the engine's
streams end with its error, and the worker's and the server's fatal paths exit 1); should the
engine's thread be stuck in a collective, this process still ends with status 1 after
EXIT_BACKSTOP_S."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)

EXIT_BACKSTOP_S = 60.0  # past the worker's and the server's own exits after a fatal engine error


def launch(
    model_dir: str,
    tensor_parallel_size: int,
    device: str,
    want: tuple[str, str | None] = ("auto", None),
):
    """Start ranks 1..N-1 for the model in `model_dir` (nothing for one GPU); returns their
    RankProcesses. want: the engine's (dtype setting, quantization), so that each rank streams the
    shard of the pack the engine will load (cache.pack.find_packs), as rank 0 does."""
    if tensor_parallel_size == 1:
        return None
    from engine.distributed.launch import start_ranks  # stdlib only: torch is not imported here

    gpu = device == "cuda" or (device == "auto" and os.path.exists("/dev/nvidiactl"))
    dtype, quantization = want
    ranks = start_ranks(
        tensor_parallel_size,
        "cuda" if gpu else "cpu",
        entry="warmup.ranks",
        entry_args=(
            "--model-dir",
            model_dir,
            "--dtype",
            dtype,
            "--quantization",
            quantization or "",
        ),
    )
    ranks.on_death(_exit_after_backstop)
    return ranks


def _exit_after_backstop(exc: BaseException) -> None:
    def exit_later() -> None:
        time.sleep(EXIT_BACKSTOP_S)
        log.error("%s; exiting with status 1", exc)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)

    threading.Thread(target=exit_later, name="tp-exit-backstop", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """One rank: its device stream first (stdlib only), then the engine's follower."""
    from engine.distributed.follower import main as follow, parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    opts, rest = parse_args(argv)
    own = argparse.ArgumentParser(prog="python -m warmup.ranks")
    own.add_argument("--model-dir", required=True)
    own.add_argument("--dtype", default="auto")
    own.add_argument("--quantization", default="")
    mine = own.parse_args(rest)
    if opts.device.startswith("cuda"):
        from cache import device_stream

        want = (mine.dtype, mine.quantization or None)
        device_stream.start(mine.model_dir, opts.device, shard=(opts.rank, opts.size), want=want)
    follow(argv)


if __name__ == "__main__":
    main()
