"""A tensor-parallel rank other than 0 (`python -m engine.distributed.follower`, started by
launch.RankProcesses): imports the engine, reads rank 0's store port and EngineArgs from stdin,
joins, builds its shard's ModelRunner and runs rank 0's plans until told to stop. It exits when its
stdin closes (rank 0 stopped it, or died); an error exits non-zero, which rank 0 sees."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m engine.distributed.follower", description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--device", required=True, help="cuda:<rank> or cpu")
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_known_args(argv)


def _exit_when_stdin_closes() -> None:
    sys.stdin.buffer.read()
    os._exit(0)


def serve(rank: int, size: int, device_name: str) -> None:
    import torch
    import torch.distributed as dist

    from engine.config import EngineArgs
    from engine.core import model_limits
    from engine.distributed.comm import STORE_TIMEOUT, join, leave
    from engine.distributed.launch import HOST
    from engine.runner import ModelRunner

    line = sys.stdin.buffer.readline()  # rank 0 is ready to connect (or, at end of file, gone)
    if not line:
        return
    threading.Thread(target=_exit_when_stdin_closes, name="stdin-watch", daemon=True).start()
    message = json.loads(line)
    args = EngineArgs(**message["args"])
    device = torch.device(device_name)
    store = dist.TCPStore(HOST, message["port"], size, False, timeout=STORE_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    model_config, max_model_len, dtype = model_limits(args, device)
    tp = join(rank, size, store, device, args.all_reduce_backend, dtype)
    runner = ModelRunner(args, model_config, dtype, device, max_model_len, tp)
    runner.follow()
    leave()


def main(argv: list[str] | None = None) -> None:
    opts, _ = parse_args(argv)
    logging.basicConfig(
        level=opts.log_level,
        format=f"%(asctime)s %(levelname)s rank{opts.rank} %(name)s: %(message)s",
    )
    try:
        serve(opts.rank, opts.size, opts.device)
    except BaseException:  # noqa: BLE001 - rank 0 learns of it from the exit code
        log.exception("tensor parallel rank %d failed", opts.rank)
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # skip interpreter teardown (CUDA and NCCL state): rank 0 has what it needs


if __name__ == "__main__":
    main()
