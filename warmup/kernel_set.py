"""The engine's Triton kernel set, found without running a kernel: the model's forward runs on meta
tensors (shapes and strides, no memory) for every step shape the runner can make, and each Triton
launch compiles or loads its kernel instead of running it.

The launches are the engine's own: its layers and attention backend compute every argument, so each
kernel's specialization (argument types, 16-divisibility, constexprs, warps, stages) is the one a
real step looks up. Whether that compile is for this GPU or for a named target depends on Triton's
active driver (see warmup.aot). Each kernel compiled or loaded is also recorded as Triton's
specialization data, from which a serving worker puts it in its JIT's cache with no trace
(JITFunction.preload; warmup.ready): tracing on meta tensors runs torch's Python meta kernels, whose
first call imports a large part of torch, about a second of the interpreter's lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# .sink: the list this thread's launches go to while it traces; .records: where the specialization
# data of the kernels it compiles or loads goes
_state = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_patched: list[tuple[object, str, object]] = []  # (owner, attribute, original) to put back
# The engine's "is this a CUDA tensor that takes the Triton path" checks, by module and name.
_CUDA_CHECKS = (
    ("engine.layers.fused", "fused_kernels_available"),
    ("engine.layers.skinny_gemm", "skinny_applies"),
    ("engine.layers.fused_linears", "row_gemv_applies"),
)
# layer 0 (no residual into its first norm) and any later one: every layer's launches
TRACED_LAYERS = 2


@dataclass(frozen=True)
class Step:
    """One step the runner can launch: T tokens of B sequences, block tables B x W; `graph`: a
    decode graph's step (B one-token rows, logits written into the graphs' static buffer), else an
    eager step."""

    num_tokens: int
    num_seqs: int
    table_width: int
    graph: bool = False


class _AsCuda:
    """A meta tensor as the engine's is-this-CUDA checks see it (everything else is the tensor's
    own)."""

    is_cuda = True

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __getattr__(self, name: str):
        return getattr(self._tensor, name)


def _meta_as_cuda(check):
    def patched(x, *rest):
        return check(_AsCuda(x) if getattr(x, "is_meta", False) else x, *rest)

    patched.__wrapped__ = check
    return patched


def _compile_only(run):
    """JITFunction.run for a thread that traces: compile (or load) the kernel, run nothing, keep
    it."""

    def patched(self, *args, grid, warmup, **kwargs):
        sink = getattr(_state, "sink", None)
        if sink is None:  # every other thread launches as usual
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel is not None:
            sink.append(kernel)
        return kernel

    patched.__wrapped__ = run
    return patched


def _record_specialization(previous):
    """Triton's after-compile hook (called where a kernel enters the JIT's in-memory cache) for a
    thread that traces: the kernel's specialization data into its records; `previous` hook runs
    too."""

    def hook(*, fn, compile, **kwargs):
        records = getattr(_state, "records", None)
        if records is not None:
            records.append(
                {"module": fn.module, "name": fn.name, "data": compile["specialization_data"]}
            )
        if previous is not None:
            return previous(fn=fn, compile=compile, **kwargs)
        return None

    return hook


def _install_patches() -> None:
    """The compile-only launch, the specialization recorder and the meta-aware CUDA checks, in
    every engine module that holds them."""
    import importlib

    from triton import knobs
    from triton.runtime.jit import JITFunction

    # the modules whose checks are patched are loaded first
    import engine.attention.triton_attn  # noqa: F401
    import engine.models.decoder  # noqa: F401
    import engine.quant.fp8_kernels  # noqa: F401  (FP8 linears ask fused_kernels_available)
    import engine.sampling  # noqa: F401

    _patched.append((JITFunction, "run", JITFunction.run))
    JITFunction.run = _compile_only(JITFunction.run)
    previous = knobs.runtime.jit_post_compile_hook
    _patched.append((knobs.runtime, "jit_post_compile_hook", previous))
    knobs.runtime.jit_post_compile_hook = _record_specialization(previous)
    for module_name, name in _CUDA_CHECKS:
        original = getattr(importlib.import_module(module_name), name)
        for module in [
            m for n, m in list(sys.modules.items()) if n.startswith("engine") and m is not None
        ]:
            if getattr(module, name, None) is original:
                _patched.append((module, name, original))
                setattr(module, name, _meta_as_cuda(original))


@contextlib.contextmanager
def compile_only(sink: list, records: list | None = None) -> Iterator[None]:
    """Within: this thread's Triton launches compile or load their kernel into Triton's caches (disk
    and this process's memory, for the active driver's device), append it to `sink` and run nothing;
    meta tensors take the engine's CUDA paths. `records` gets {module, name, data} (Triton's
    specialization data, for JITFunction.preload) for each kernel that entered the in-memory cache
    meanwhile. Other threads are unaffected; the patches are removed when the last tracer
    leaves."""
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            _install_patches()
        _patch_users += 1
    _state.sink, _state.records = sink, records
    try:
        yield
    finally:
        _state.sink = _state.records = None
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                while _patched:
                    owner, name, original = _patched.pop()
                    setattr(owner, name, original)


# ---- the step shapes
# -----------------------------------------------------------------------------------------
def steps_for(args, max_model_len: int, first_only: bool = False) -> list[Step]:
    """Every step shape that selects a different kernel specialization, for EngineArgs `args` on a
    GPU.

    Eager (prefill and mixed) steps vary the skinny GEMM's row count (1, 16, other); a mixed step
    adds the attention's decode launch beside its prompt launch. Decode graphs are one step per
    captured size at the full table width. The table width selects no specialization (the attention
    kernel takes its row stride unspecialized) but sets a decode's split count: decode steps that
    run eager (enforce_eager, or batches above the largest graph) take every batch at the widest
    tables and every width at the smallest batch, which between them give every split count.
    first_only: what a first request meets (a prompt, then decode at 1).
    """
    width = -(-max_model_len // args.block_size)
    tokens = [t for t in (2, 16, 17) if t <= args.max_num_batched_tokens] or [
        args.max_num_batched_tokens
    ]
    steps = [Step(t, 1, width) for t in tokens]
    if args.max_num_seqs > 1 and args.max_num_batched_tokens > 17:
        steps.append(Step(18, 2, width))  # a decode beside a prompt chunk
    sizes = [] if args.enforce_eager else args.graph_sizes()
    steps += [Step(s, s, width, graph=True) for s in (sizes[:1] if first_only else sizes)]
    if first_only:
        return steps
    eager_from = 1 if not sizes else sizes[-1] + 1
    if eager_from <= args.max_num_seqs:
        steps += [Step(b, b, width) for b in range(eager_from, args.max_num_seqs + 1)]
        steps += [Step(eager_from, eager_from, w) for w in range(1, width)]
    return steps


# ---- tracing
# -------------------------------------------------------------------------------------------------
def meta_model(model_config, dtype: torch.dtype, target_programs: int, quantization=None):
    """The decoder on the meta device with the Triton attention backend, TRACED_LAYERS layers deep;
    the backend splits decode as a GPU whose split target is `target_programs` (programs per SM x
    the SM count) would; quantization: the engine's scheme (its name or QuantConfig), whose linears
    and experts launch their own kernels."""
    from engine.attention.triton_attn import TritonAttentionBackend
    from engine.models.decoder import build_model

    backend = TritonAttentionBackend(None)
    backend.target_programs = target_programs
    layers = min(TRACED_LAYERS, model_config.num_layers)
    return build_model(
        dataclasses.replace(model_config, num_layers=layers),
        dtype,
        "meta",
        backend,
        quant=quantization,
    )


def split_target(num_sms: int) -> int:
    """The attention backend's decode split target on a GPU with num_sms SMs (as its constructor
    computes it)."""
    from engine.attention.triton_attn import TritonAttentionBackend

    default = TritonAttentionBackend(None)  # its CPU stand-in counts 2 SMs
    return default.target_programs // default.num_sms * num_sms


def _inputs(step: Step, block_size: int, max_model_len: int):
    """A step's packed inputs as the stager lays them out, on the meta device."""
    from engine.step_inputs import StepLayout, views

    layout = StepLayout(step.num_tokens, step.num_seqs, step.table_width)
    _, nbytes = layout.offsets()
    buf = torch.empty(nbytes, dtype=torch.uint8, device="meta")
    per_seq = [1] * step.num_seqs  # the runner's order: decodes first, then the prompt chunk
    per_seq[-1] += step.num_tokens - step.num_seqs
    starts = [0, *itertools.accumulate(per_seq)]
    host = dict(
        num_decode_seqs=step.num_seqs - (per_seq[-1] > 1),
        max_query_len=max(per_seq),
        max_seq_len=max_model_len,
        query_start_loc_cpu=starts,
        seq_lens_cpu=per_seq,
        block_size=block_size,
    )
    return views(buf, layout, host)


def trace(
    model,
    steps: list[Step],
    block_size: int,
    max_model_len: int,
    sink: list,
    kv_cache_dtype: str = "auto",
    records: list | None = None,
) -> None:
    """Run each step's forward (and a graph step's logits, the sampler's greedy pick and draw,
    and the kernel that moves a step's inputs to the device) with launches compile-only, over a KV
    cache of the engine's kv_cache_dtype (FP8 takes other kernels); `records`: compile_only's."""
    from engine import step_transfer
    from engine.attention import kv_cache_shape
    from engine.attention.kv_quant import resolve_kv_cache_dtype
    from engine.layers.vocab_argmax import greedy_argmax, race_sample

    cfg, dtype = model.config, model.dtype
    blocks = 16 * -(-max_model_len // (16 * block_size)) or 16
    kv = torch.empty(
        kv_cache_shape(len(model.layers), blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
        dtype=resolve_kv_cache_dtype(kv_cache_dtype, dtype),
        device="meta",
    )
    largest = max([s.num_seqs for s in steps if s.graph], default=1)
    logits = torch.empty(largest, cfg.vocab_size, dtype=torch.float32, device="meta")
    with compile_only(sink, records), torch.inference_mode():
        for step in steps:
            inputs = _inputs(step, block_size, max_model_len)
            hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta)
            if step.graph:
                model.compute_logits(hidden, out=logits[: step.num_seqs])
        race_sample(logits[:1], torch.empty(1, dtype=torch.int64, device="meta"))
        greedy_argmax(logits[:1])
        words = torch.empty(step_transfer.BLOCK, dtype=torch.int64, device="meta")
        step_transfer.send(words, words, words, (0, 0, 1))


def kernel_dirs(kernels: list) -> dict[str, str]:
    """Triton cache directory (its name under the cache root) -> kernel name, for compiled
    kernels."""
    from triton.runtime.cache import get_cache_manager

    out = {}
    for kernel in kernels:
        manager = get_cache_manager(kernel.hash)
        out[os.path.basename(manager.cache_dir)] = kernel.metadata.name
    return out
