"""Compile the engine's kernel set for GPU architectures this machine need not have: no GPU, no CUDA
driver.

Triton's driver is replaced by one that names a target (GPUTarget("cuda", <cc>, 32)) and owns no
device, and warmup.kernel_set traces the model's steps with launches compile-only. Each kernel lands
in Triton's cache directory under the key Triton's JIT computes on a GPU of that architecture
(source, target, options, environment), so a worker that has the directory compiles nothing. The
decode attention splits its work by the GPU's SM count, so the set is traced once per SM count of
the architecture's GPUs, each on a (virtual) device of its own, so that every kernel a GPU of that
count launches is recorded for it (KernelSet.preload).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import itemgetter

log = logging.getLogger(__name__)

# SMs of the data-centre and workstation GPUs of each supported architecture (NVIDIA's
# specifications): sm_80 A100 108, A30 56; sm_86 A40 / RTX A6000 84, RTX 3090 82, A10 72, RTX A5000
# 64, RTX A4000 48; sm_89 L40 / L40S / RTX 6000 Ada 142, RTX 4090 128, L4 58, RTX 4000 Ada 48, RTX
# 2000 Ada 22; sm_90 H100 SXM / NVL, H200, GH200 132, H100 PCIe 114, H20 78.
ARCH_SM_COUNTS = {
    "sm_80": (108, 56),
    "sm_86": (84, 82, 72, 64, 48),
    "sm_89": (142, 128, 58, 48, 22),
    "sm_90": (132, 114, 78),
}
SUPPORTED_ARCHES = tuple(ARCH_SM_COUNTS)
WARP_SIZE = 32


def parse_arches(text: str) -> list[str]:
    """'sm_80,sm_90' -> ['sm_80', 'sm_90'], refusing a name that is not sm_<digits>."""
    arches = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arches if not re.fullmatch(r"sm_\d{2,3}", a)]
    if bad or not arches:
        raise ValueError(
            f"--arch: expected names like sm_80,sm_90 (supported: {', '.join(SUPPORTED_ARCHES)}), "
            f"got {text!r}"
        )
    return list(dict.fromkeys(arches))


def capability(arch: str) -> int:
    return int(arch.removeprefix("sm_"))


class TargetDriver:
    """Stands in for Triton's CUDA driver where there is no GPU: it names the target and the
    (virtual) device the JIT keys its in-memory cache by (one per SM count when given); nothing is
    launched through it (kernel_set's launches are compile-only)."""

    def __init__(self, arch: str, sm_count: int | None = None):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.device = f"aot:{arch}" if sm_count is None else f"aot:{arch}:{sm_count}sm"
        self.target = GPUTarget("cuda", capability(arch), WARP_SIZE)

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("meta")


@contextlib.contextmanager
def target_driver(arch: str, sm_count: int | None = None) -> Iterator[None]:
    """Triton's active driver names `arch` inside (the previous one is restored, never created:
    creating the real one needs a CUDA driver)."""
    from triton.runtime.driver import driver

    previous = getattr(driver, "_active", None)
    driver.set_active(TargetDriver(arch, sm_count))
    try:
        yield
    finally:
        driver._active = previous


@contextlib.contextmanager
def triton_cache_dir(path: str) -> Iterator[None]:
    """Triton writes and reads its kernel cache in `path` inside."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        previous = knobs.cache.dir
        knobs.cache.dir = path
    else:  # Triton before 3.4 reads the variable when it opens a cache entry
        previous = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = path
    try:
        yield
    finally:
        if knobs is not None:
            knobs.cache.dir = previous
        elif previous is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = previous


def sm_counts_for(arch: str, extra: list[int] | None = None) -> list[int]:
    """The SM counts to trace for `arch`: its GPUs' (ARCH_SM_COUNTS) and any extra ones asked
    for."""
    counts = list(ARCH_SM_COUNTS.get(arch, ())) + list(extra or [])
    if not counts:
        raise ValueError(
            f"--arch {arch}: no GPU of this architecture is known here; name its SM count with "
            f"--sm-count (supported without it: {', '.join(SUPPORTED_ARCHES)})"
        )
    return sorted(set(counts), reverse=True)


@dataclass
class KernelSet:
    """What compile_kernel_set found: {Triton cache entry directory: kernel name}, and for each SM
    count the specialization data of every kernel a GPU of that count launches ({sm_count, module,
    name, data}: JITFunction.preload's input, by the kernel's module and qualified name)."""

    entries: dict[str, str] = field(default_factory=dict)
    preload: list[dict] = field(default_factory=list)

    def add(self, other: KernelSet) -> None:
        """`other`'s kernels too (a kernel two processes traced is recorded once)."""
        self.entries.update(other.entries)
        seen = {_record_key(r) for r in self.preload}
        for record in other.preload:
            if _record_key(record) not in seen:
                seen.add(_record_key(record))
                self.preload.append(record)


def _record_key(record: dict) -> tuple:
    return record["sm_count"], record["module"], record["name"], record["data"]


def compile_kernel_set(
    args, cache_dir: str, sm_counts: list[int], arch: str | None = None, jobs: int = 1
) -> KernelSet:
    """Compile every kernel EngineArgs `args` can launch into Triton cache dir `cache_dir` (kernels
    already there are kept), for `arch` without a GPU (in `jobs` processes, each tracing a share of
    the steps), or (arch None) for this process's GPU through Triton's own driver (whose one device
    records a kernel shared by several SM counts under the first only)."""
    from engine.config import ModelConfig
    from warmup.kernel_set import steps_for

    cfg = ModelConfig.from_dir(args.model)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    items = [(count, step) for count in sm_counts for step in steps_for(args, max_model_len)]
    jobs = max(1, min(jobs, len(items))) if arch is not None else 1
    if jobs == 1:
        return _compile_items(vars(args), cache_dir, arch, items)
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    # neighbours (the same kernels) go to different processes
    shares = [items[i::jobs] for i in range(jobs)]
    out = KernelSet()
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        for part in pool.map(
            _compile_items, [vars(args)] * jobs, [cache_dir] * jobs, [arch] * jobs, shares
        ):
            out.add(part)
    return out


def _compile_items(engine_args: dict, cache_dir: str, arch: str | None, items: list) -> KernelSet:
    """Trace (SM count, step) items with compile-only launches (run in a process of its own when
    jobs > 1), each SM count's on a device of its own."""
    import torch

    from engine import EngineArgs
    from engine.config import ModelConfig, resolve_dtype
    from engine.quant import model_quantization
    from warmup.kernel_set import kernel_dirs, meta_model, split_target, trace

    args = EngineArgs(**engine_args)
    cfg = ModelConfig.from_dir(args.model)
    quantization = model_quantization(args.quantization, cfg)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    dtype = resolve_dtype(args.dtype, cfg, torch.device("cuda"))
    sink: list = []
    preload: list[dict] = []
    with triton_cache_dir(cache_dir):
        for count, group in itertools.groupby(sorted(items, key=itemgetter(0)), itemgetter(0)):
            model = meta_model(cfg, dtype, split_target(count), quantization)
            driver = target_driver(arch, count) if arch is not None else contextlib.nullcontext()
            found: list[dict] = []
            with driver:
                for _, step in group:
                    trace(
                        model,
                        [step],
                        args.block_size,
                        max_model_len,
                        sink,
                        args.kv_cache_dtype,
                        found,
                    )
            preload += [dict(record, sm_count=count) for record in found]
        with target_driver(arch) if arch is not None else contextlib.nullcontext():
            build_runtime_modules(sink)
        return KernelSet(kernel_dirs(sink), preload)


def build_runtime_modules(kernels: list) -> int:
    """Build the C modules Triton compiles with gcc at a process's first launches into the current
    Triton cache, as a first launch on the GPU would: its driver utilities (`cuda_utils`) and each
    kernel's launcher (one per signature), about 0.3 s apiece. They link against the CUDA driver's
    library, not a GPU; where it is missing none is built (the worker builds them at first use).
    Returns how many were built."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher, CudaUtils
    except ImportError:
        return 0
    seen: set = set()
    built = 0
    try:
        CudaUtils()
        built += 1
        for kernel in kernels:
            src = kernel.src
            sig = (repr(sorted(src.signature.items())), repr(sorted(src.constants.items())))
            if sig not in seen:
                seen.add(sig)
                CudaLauncher(src, kernel.metadata)
                built += 1
    except Exception as exc:  # noqa: BLE001 - no libcuda here (AssertionError, ImportError), no gcc
        log.info("warmup: Triton's C modules not built here (%s); workers build them", exc)
    return built
