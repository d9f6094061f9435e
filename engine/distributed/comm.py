"""The collectives one tensor-parallel rank runs: the per-layer all-reduce, the vocabulary gather of
the logits, the broadcast of sampled ids, and small host-side agreements, over torch.distributed
(NCCL on GPU, gloo on CPU).

The all-reduce is NCCL's by default; "symm_mem" takes torch's symmetric-memory one-shot all-reduce
(peer-to-peer loads, no NVLink multicast) for messages that fit its buffer, and NCCL for larger
ones. Every call is legal inside a CUDA graph capture, so the decode graphs hold their all-reduces.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.plan import IDLE_TIMEOUT, PlanChannel
from engine.distributed.sharding import Shard

log = logging.getLogger(__name__)

# A rank's store operations, and its device collectives (NCCL's watchdog).
STORE_TIMEOUT = timedelta(minutes=10)
# The symmetric-memory buffer: decode-sized messages (a batch's hidden states) fit; prefill ones go
# to NCCL.
SYMM_MEM_BYTES = 8 << 20


class Communicator:
    """Collectives of one rank among `size`, on the default process group (device tensors) and a
    gloo group (host)."""

    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        cpu_group,
        all_reduce: str = "nccl",
        dtype: torch.dtype | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.cpu_group = cpu_group
        self.nccl = device.type == "cuda"
        self.symm: _SymmMemAllReduce | None = None
        if all_reduce == "symm_mem" and self.nccl and dtype is not None:
            self.symm = _SymmMemAllReduce.agree(self, dtype)
        plain = "nccl" if self.nccl else "gloo"
        self.all_reduce_name = "symm_mem" if self.symm is not None else plain

    # ---- device tensors (every rank calls each of these in the same order) ----------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x itself, summed in place, or a new tensor)."""
        if self.symm is not None:
            out = self.symm(x)
            if out is not None:
                return out
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[N, V/size] logits of each rank's vocabulary rows -> [N, V] (padded V) in vocabulary
        order."""
        n, part = local.shape
        local = local.contiguous()
        if self.nccl:
            stacked = torch.empty((self.size * n, part), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(stacked, local)
            return stacked.view(self.size, n, part).permute(1, 0, 2).reshape(n, self.size * part)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t, on every rank (in place)."""
        dist.broadcast(t, src=0)
        return t

    # ---- host values -------------------------------------------------------------------------
    def min_int(self, value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def abort(self) -> None:
        """Unblock collectives waiting on a dead rank (NCCL aborts its communicators)."""
        if not self.nccl:
            return
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception as e:  # noqa: BLE001 - it only shortens a hang of a dying engine
            log.debug("abort of the process group failed: %s", e)


class _SymmMemAllReduce:
    """torch's symmetric-memory one-shot all-reduce over a buffer mapped by every rank (CUDA peer
    access)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm

        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm.empty(SYMM_MEM_BYTES // dtype.itemsize, dtype=dtype, device=device)

    def rendezvous(self) -> None:
        import torch.distributed._symmetric_memory as symm

        symm.enable_symm_mem_for_group(self.group_name)  # the exchange's store (once per group)
        symm.rendezvous(self.buffer, self.group_name)

    @classmethod
    def agree(cls, comm: Communicator, dtype: torch.dtype) -> "_SymmMemAllReduce | None":
        """Every rank sets it up, or none uses it (a rank that can't says why; the others follow it
        to NCCL)."""
        made, why = None, ""
        try:
            made = cls(dtype, comm.device)
        except Exception as e:  # noqa: BLE001 - reported, NCCL serves instead
            why = f"{type(e).__name__}: {e}"
        if comm.min_int(made is not None) and made is not None:
            try:
                made.rendezvous()
            except Exception as e:  # noqa: BLE001
                made, why = None, f"{type(e).__name__}: {e}"
            if not comm.min_int(made is not None):
                made = None
        else:
            made = None
        if made is None:
            log.warning(
                "all_reduce_backend symm_mem: not available on this machine (%s); using NCCL",
                why or "another rank could not set it up",
            )
        return made

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        n = x.numel()
        if n > self.buffer.numel() or x.dtype != self.buffer.dtype:
            return None
        staged = self.buffer[:n]
        staged.copy_(x.reshape(-1))
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out.view(-1))
        return out


@dataclass
class TensorParallel:
    """What a rank's runner needs: its slice of the model, its collectives, and the channel of rank
    0's plans."""

    shard: Shard
    comm: Communicator
    channel: PlanChannel


def join(
    rank: int, size: int, store, device: torch.device, all_reduce: str, dtype: torch.dtype
) -> TensorParallel:
    """Form the process groups of one tensor-parallel engine (every rank calls it): the default one
    (NCCL on GPU, gloo on CPU) for the model's collectives, and a gloo group, patient enough for an
    idle worker, for the plans."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=STORE_TIMEOUT,
        device_id=device if cuda else None,
    )
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    comm = Communicator(rank, size, device, cpu_group, all_reduce, dtype)
    log.info(
        "tensor parallel: rank %d of %d on %s, all-reduce %s",
        rank,
        size,
        device,
        comm.all_reduce_name,
    )
    return TensorParallel(Shard(rank, size), comm, PlanChannel(cpu_group))


LEAVE_TIMEOUT_S = 10.0


def leave() -> None:
    """Close this process's process groups (a later engine in the same process forms new ones).

    NCCL's are aborted, not destroyed: a destroy waits on communicators that decode graphs captured,
    and on peers that may have exited already (on 2x H200 the destroy never returned after graphs
    had been captured). Either runs on a thread bounded by LEAVE_TIMEOUT_S, so a shutdown never
    hangs here."""
    if not dist.is_initialized():
        return
    nccl = dist.get_backend() == "nccl"

    def close() -> None:
        try:
            if nccl:
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - the engine is going away either way
            log.warning("tensor parallel: closing the process groups failed: %s", e)

    thread = threading.Thread(target=close, name="tp-leave", daemon=True)
    thread.start()
    thread.join(LEAVE_TIMEOUT_S)
    if thread.is_alive():
        log.warning(
            "tensor parallel: the process groups did not close within %.0f s; the process's "
            "exit ends them",
            LEAVE_TIMEOUT_S,
        )
