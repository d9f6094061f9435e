"""The processes of a tensor-parallel engine: rank 0 is the caller's; ranks 1..N-1 are started here,
one process each, and wait on their stdin for the line that says where rank 0's store listens and
which EngineArgs to build.

Starting them is cheap and torch-free (so a worker can start them first thing, while everything else
loads); the engine's rank 0 connects later (attach_ranks + RankProcesses.connect). Rank 0 watches
its ranks: a rank that exits unasked is reported to the listeners (the engine fails what is in
flight). A rank exits when its stdin closes, which is also what happens when rank 0's process dies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

FOLLOWER = "engine.distributed.follower"
HOST = "127.0.0.1"  # one host: every rank meets rank 0's store on loopback
# From rank 0's connect to the last rank joining (a rank may still be importing torch).
CONNECT_TIMEOUT_S = 600.0


class RankDied(RuntimeError):
    """A tensor-parallel rank's process ended while the engine needed it."""


class RankProcesses:
    """Ranks 1..size-1 of one engine, on `device_type` ("cuda": rank i on cuda:i, or "cpu")."""

    def __init__(
        self, size: int, device_type: str, entry: str = FOLLOWER, entry_args: tuple[str, ...] = ()
    ) -> None:
        self.size = size
        self.device_type = device_type
        self.dead: RankDied | None = None
        self._listeners: list[Callable[[RankDied], None]] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._store = None
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, size):
            device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
            cmd = [
                sys.executable,
                "-m",
                entry,
                "--rank",
                str(rank),
                "--size",
                str(size),
                "--device",
                device,
                "--log-level",
                level,
                *entry_args,
            ]
            # Its own session: a terminal's Ctrl-C reaches rank 0, which stops the others.
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
            threading.Thread(
                target=self._watch, args=(rank,), name=f"tp-rank-{rank}", daemon=True
            ).start()
        log.info(
            "tensor parallel: started ranks 1..%d (pids %s)",
            size - 1,
            ",".join(str(p.pid) for p in self.procs.values()),
        )

    # ---- deaths ------------------------------------------------------------------------------
    def _watch(self, rank: int) -> None:
        code = self.procs[rank].wait()
        with self._lock:
            if self._stopping or self.dead is not None:
                return
            self.dead = RankDied(f"tensor parallel rank {rank} exited with code {code}")
            listeners = list(self._listeners)
        log.error("%s: the engine cannot go on", self.dead)
        for listener in listeners:
            listener(self.dead)

    def on_death(self, listener: Callable[[RankDied], None]) -> None:
        """Call listener(RankDied) (on a watcher thread) when a rank exits unasked; at once if one
        has."""
        with self._lock:
            self._listeners.append(listener)
            dead = self.dead
        if dead is not None:
            listener(dead)

    # ---- rank 0 connects ---------------------------------------------------------------------
    def connect(self, args, device, dtype):
        """Rank 0 (torch is up): open the store, tell every rank where it is and which EngineArgs to
        build, wait for them all to join, then form the process groups ->
        engine.distributed.comm.TensorParallel."""
        import torch.distributed as dist

        from engine.distributed.comm import STORE_TIMEOUT, join

        self._store = dist.TCPStore(
            HOST, 0, self.size, True, timeout=STORE_TIMEOUT, wait_for_workers=False
        )
        line = json.dumps({"port": self._store.port, "args": dataclasses.asdict(args)}) + "\n"
        for proc in self.procs.values():
            try:
                proc.stdin.write(line.encode())
                proc.stdin.flush()
            except OSError:
                pass  # it died: the wait below reports it
        keys = [f"joined/{rank}" for rank in self.procs]
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not self._store.check(keys):
            if self.dead is not None:
                raise self.dead
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor parallel: ranks did not join within {CONNECT_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.01)
        return join(0, self.size, self._store, device, args.all_reduce_backend, dtype)

    def stop(self, timeout: float = 10.0) -> None:
        """Close every rank's stdin (it exits), wait up to `timeout` s, then kill what is left."""
        with self._lock:
            self._stopping = True
        for proc in self.procs.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- ranks started ahead of the engine (a worker starts them first; the engine attaches later) --
_STARTED: RankProcesses | None = None


def start_ranks(
    size: int, device_type: str, entry: str = FOLLOWER, entry_args: tuple[str, ...] = ()
) -> RankProcesses:
    """Start ranks 1..size-1 now (torch-free); the next engine of that size on that device type
    attaches to them."""
    global _STARTED
    if _STARTED is not None:
        _STARTED.stop()
    _STARTED = RankProcesses(size, device_type, entry, entry_args)
    return _STARTED


def attach_ranks(size: int, device_type: str) -> RankProcesses:
    """The ranks start_ranks started for this size and device type, else new ones."""
    global _STARTED
    started, _STARTED = _STARTED, None
    if started is not None and (started.size, started.device_type) == (size, device_type):
        return started
    if started is not None:
        started.stop()
    return RankProcesses(size, device_type)
