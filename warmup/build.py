"""`python -m warmup build`: a compiled-engine artifact for the GPU it runs on, stored beside the model's snapshot.

The build starts the engine with an empty Triton cache of its own, a profiled KV-sizing step and every decode graph
captured, then runs prompts of many lengths and sampling settings so the kernels a server meets get compiled; it
keeps those kernels, the measured step peak and the graph sizes, ends with a smoke generation, and publishes the
artifact atomically (optionally to S3 as well). Prints the artifact's path and the build time.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time

from warmup.artifacts import ARTIFACT_FILE, ENGINES_DIR, TRITON_DIR, current_key, key_id

log = logging.getLogger(__name__)

def smoke_prompt(vocab: int) -> list[int]:
    """The build's last generation (its greedy tokens are kept in the record, to compare a compiled run with)."""
    return [(1000 + 7 * i) % (vocab - 1) + 1 for i in range(32)]


def _exercise(llm, max_len: int, vocab: int) -> None:
    """Prompts of many lengths (alone, batched, and meeting decodes in mixed steps) and every sampler path."""
    from engine import SamplingParams

    def prompt(n: int, salt: int) -> list[int]:
        return [(salt * 131 + 17 * i) % (vocab - 2) + 1 for i in range(n)]

    lengths = [n for n in (1, 2, 7, 16, 31, 64, 100, 128, 255, 512, 1000, 2048, 4096, 8192, 16384)
               if n + 16 < max_len] + [max_len - 16]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, n in enumerate(lengths):  # alone: prefill, then decode at batch 1
        llm.generate([prompt(n, i)], greedy)
    mixed = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=24, ignore_eos=True, seed=1),
             SamplingParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2,
                            max_tokens=24, ignore_eos=True, seed=2),
             SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)]
    prompts = [prompt(lengths[i % len(lengths)] // (1 + i % 3) or 1, 100 + i) for i in range(48)]
    llm.generate(prompts, [mixed[i % len(mixed)] for i in range(len(prompts))])  # batched and mixed steps


def build(model: str, *, dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256,
          max_num_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.9, block_size: int = 16,
          out_dir: str | None = None, cache_dir: str | None = None, revision: str | None = None,
          push: str | None = None) -> tuple[str, dict]:
    """Build and publish an artifact for `model` (a snapshot directory or any reference cache.resolve takes);
    returns (its directory, its artifact.json). Run it in a process of its own: it points Triton's cache at a
    fresh directory for its whole life."""
    t0 = time.perf_counter()
    if not os.path.isdir(model):
        from cache import resolve

        options = {"cache_dir": cache_dir, "revision": revision}
        model = resolve(model, **{k: v for k, v in options.items() if v})
    import torch
    import triton.knobs

    from engine import LLM, EngineArgs, SamplingParams

    staging_root = out_dir or os.path.join(model, ENGINES_DIR)
    os.makedirs(staging_root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".build-", dir=staging_root)
    try:
        triton.knobs.cache.dir = os.path.join(staging, TRITON_DIR)  # only what this engine compiles
        args = EngineArgs(model=model, dtype=dtype, device="cuda", max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          gpu_memory_utilization=gpu_memory_utilization, block_size=block_size)
        key = current_key(args)
        llm = LLM(**{**vars(args), "kv_sizing": "profile", "cuda_graph_capture": "start"})
        core = llm.engine
        _exercise(llm, core.context_limit, core.runner.model_config.vocab_size)
        vocab = core.runner.model_config.vocab_size
        smoke = llm.generate([smoke_prompt(vocab)], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        data = {"key": key, "record": {
            "kv_step_bytes": int(core.runner.kv_step_bytes), "num_kv_blocks": core.num_kv_blocks,
            "graph_sizes": args.graph_sizes(), "smoke_prompt": smoke_prompt(vocab),
            "smoke_tokens": smoke[0].outputs[0].token_ids, "build_seconds": round(seconds, 2),
            "gpu_name": torch.cuda.get_device_name(), "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
        with open(os.path.join(staging, ARTIFACT_FILE), "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = os.path.join(staging_root, key_id(key))
        if os.path.isdir(final):  # a rebuild of the same key replaces the old one
            shutil.rmtree(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if push:
        from cache.remote import join_uri, push_dir

        push_dir(final, join_uri(push, ENGINES_DIR, key_id(key)))
    log.info("warmup: built %s in %.1f s", final, seconds)
    return final, data
