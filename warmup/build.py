"""`python -m warmup build`: compiled-engine artifacts, stored beside the model's snapshot.

On the GPU it runs on (build): the engine starts with an empty Triton cache of its own, a profiled
KV-sizing step and every decode graph captured, then runs prompts of many lengths and sampling
settings; the artifact keeps the kernels it compiled, the measured step peak and the graph sizes,
and a smoke generation's tokens.
Without a GPU (build_without_gpu): for each named architecture, the kernel set warmup.kernel_set
finds, compiled by warmup.aot for that target; the artifact holds kernels only, for any memory size
of that architecture. Both publish atomically (warmup.publish; optionally to S3 as well).
"""

from __future__ import annotations

import logging
import os
import time

from warmup.artifacts import ENGINES_DIR, TRITON_DIR, current_key, gpuless_key, key_id
from warmup.publish import portable_groups, publish_local, staging_dir, write_artifact_file

log = logging.getLogger(__name__)


def smoke_prompt(vocab: int) -> list[int]:
    """The build's last generation (its greedy tokens are kept in the record, to compare a compiled
    run with)."""
    return [(1000 + 7 * i) % (vocab - 1) + 1 for i in range(32)]


def _exercise(llm, max_len: int, vocab: int) -> None:
    """Prompts of many lengths (alone, batched, and meeting decodes in mixed steps) and every
    sampler path."""
    from engine import SamplingParams

    def prompt(n: int, salt: int) -> list[int]:
        return [(salt * 131 + 17 * i) % (vocab - 2) + 1 for i in range(n)]

    lengths = [
        n
        for n in (1, 2, 7, 16, 31, 64, 100, 128, 255, 512, 1000, 2048, 4096, 8192, 16384)
        if n + 16 < max_len
    ] + [max_len - 16]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, n in enumerate(lengths):  # alone: prefill, then decode at batch 1
        llm.generate([prompt(n, i)], greedy)
    mixed = [
        SamplingParams(
            temperature=0.8, top_p=0.9, top_k=40, max_tokens=24, ignore_eos=True, seed=1
        ),
        SamplingParams(
            temperature=1.0,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            max_tokens=24,
            ignore_eos=True,
            seed=2,
        ),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5),
    ]
    prompts = [prompt(lengths[i % len(lengths)] // (1 + i % 3) or 1, 100 + i) for i in range(48)]
    # batched and mixed steps
    llm.generate(prompts, [mixed[i % len(mixed)] for i in range(len(prompts))])


def build(
    model: str,
    *,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    out_dir: str | None = None,
    cache_dir: str | None = None,
    revision: str | None = None,
    push: str | None = None,
) -> tuple[str, dict]:
    """Build and publish an artifact for `model` (a snapshot directory or any reference
    cache.resolve takes); returns (its directory, its artifact.json). Run it in a process of its
    own: it points Triton's cache at a fresh directory for its whole life."""
    t0 = time.perf_counter()
    model = _resolve(model, cache_dir, revision)
    import torch
    import triton.knobs

    from engine import LLM, EngineArgs, SamplingParams
    from warmup.aot import SUPPORTED_ARCHES, compile_kernel_set, sm_counts_for

    staging_root = out_dir or os.path.join(model, ENGINES_DIR)
    staging = staging_dir(staging_root, "build")
    try:
        triton.knobs.cache.dir = os.path.join(staging, TRITON_DIR)  # only what this engine compiles
        args = EngineArgs(
            model=model,
            dtype=dtype,
            device="cuda",
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
        )
        key = current_key(args)
        llm = LLM(**{**vars(args), "kv_sizing": "profile", "cuda_graph_capture": "start"})
        core = llm.engine
        _exercise(llm, core.context_limit, core.runner.model_config.vocab_size)
        # and the kernel set, for this GPU's and its architecture's other SM counts
        arch = key["gpu_arch"]
        own_sms = torch.cuda.get_device_properties(
            torch.cuda.current_device()
        ).multi_processor_count
        counts = sm_counts_for(arch, [own_sms]) if arch in SUPPORTED_ARCHES else [own_sms]
        compile_kernel_set(args, triton.knobs.cache.dir, counts)
        vocab = core.runner.model_config.vocab_size
        smoke = llm.generate(
            [smoke_prompt(vocab)], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        record = {
            "kv_step_bytes": int(core.runner.kv_step_bytes),
            "num_kv_blocks": core.num_kv_blocks,
            "graph_sizes": args.graph_sizes(),
            "smoke_prompt": smoke_prompt(vocab),
            "smoke_tokens": smoke[0].outputs[0].token_ids,
            "build_seconds": round(seconds, 2),
            "gpu_name": torch.cuda.get_device_name(),
            "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        portable_groups(os.path.join(staging, TRITON_DIR))
        write_artifact_file(staging, key, record)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
    # a rebuild of the same key replaces it
    final, _ = publish_local(staging, staging_root, key, replace=True)
    _push(final, key, push)
    log.info("warmup: built %s in %.1f s", final, seconds)
    return final, {"key": key, "record": record}


def build_without_gpu(
    model: str,
    arches: list[str],
    *,
    sm_counts: list[int] | None = None,
    jobs: int = 1,
    out_dir: str | None = None,
    cache_dir: str | None = None,
    revision: str | None = None,
    push: str | None = None,
    **limits,
) -> list[tuple[str, dict]]:
    """One artifact per architecture in `arches`, compiled here without a GPU (each in `jobs`
    processes); returns [(its directory, its artifact.json)]. limits: dtype, max_model_len,
    max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, block_size, kv_cache_dtype,
    quantization (EngineArgs' names)."""
    from warmup.aot import sm_counts_for

    model = _resolve(model, cache_dir, revision)
    # refuses an unknown arch before any work
    plan = [(a, sm_counts_for(a, sm_counts)) for a in arches]
    root = out_dir or os.path.join(model, ENGINES_DIR)
    built = [_build_arch(model, arch, counts, root, limits, jobs) for arch, counts in plan]
    for final, data in built:
        _push(final, data["key"], push)
    return built


def _build_arch(
    model: str, arch: str, sm_counts: list[int], root: str, limits: dict, jobs: int
) -> tuple[str, dict]:
    from engine import EngineArgs
    from warmup.aot import compile_kernel_set

    t0 = time.perf_counter()
    args = EngineArgs(model=model, device="cuda", **limits)
    args.validate()
    key = gpuless_key(args, arch)
    staging = staging_dir(root, "build")
    try:
        kernels = compile_kernel_set(args, os.path.join(staging, TRITON_DIR), sm_counts, arch, jobs)
        portable_groups(os.path.join(staging, TRITON_DIR))
        record = {
            "kv_step_bytes": None,
            "num_kv_blocks": None,
            "graph_sizes": args.graph_sizes(),
            "built_without_gpu": True,
            "sm_counts": sm_counts,
            "kernels": kernels.entries,
            "build_seconds": round(time.perf_counter() - t0, 2),
            "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        write_artifact_file(staging, key, record)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
    final, _ = publish_local(staging, root, key, replace=True)
    log.info(
        "warmup: built %s for %s without a GPU: %d kernels in %.1f s",
        final,
        arch,
        len(kernels.entries),
        record["build_seconds"],
    )
    return final, {"key": key, "record": record}


def _resolve(model: str, cache_dir: str | None, revision: str | None) -> str:
    """--model as a local snapshot directory (resolved through the cache like the worker does)."""
    if os.path.isdir(model):
        return model
    from cache import resolve

    options = {"cache_dir": cache_dir, "revision": revision}
    return resolve(model, **{k: v for k, v in options.items() if v})


def _push(final: str, key: dict, push: str | None) -> None:
    if push:
        from cache.remote import join_uri, push_dir

        push_dir(final, join_uri(push, ENGINES_DIR, key_id(key)))
