"""One fresh process of the cold-start benchmark: start -> first token (or weights on the GPU), timed per phase.

`python bench/cold_start_child.py MODE MODEL_DIR PROMPT_LEN [EXTRA_JSON]`, MODE: ours | hf | safetensors | bare |
loader (the pack alone through the streaming loader).
Prints one JSON line of wall-clock stamps (time.time()); the parent subtracts the moment it spawned this process.
"""
import sys
import time

T_MAIN = time.time()  # the interpreter is up and this file runs: before any import of ours or torch's
import json  # noqa: E402
import os  # noqa: E402

MODE, MODEL_DIR, PROMPT_LEN = sys.argv[1], sys.argv[2], int(sys.argv[3])
# LLM keyword arguments, plus loader settings to compare: _prefetch [threads, MiB] (threads 0: none),
# _stream ("process": cache.device_stream, the default; "thread": page-cache prefetch + the in-process loader),
# _loader_chunk_mb, _preload (0: the engine starts the stream), _imports_first (1: prefetch torch's files first),
# _gentle_mb (prefetch one piece of that size at a time until torch is up), _engine_mode (ENGINE_MODE, default jit),
# _warmup (0: no start-time warm-up), _pages (0: no start-page read-ahead)
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
stamps: dict = {"main": T_MAIN}
fetch = None

if MODE == "ours":  # start streaming the pack, and the warm-up, before torch imports
    import cache.loader
    from warmup.start import start_warmup

    warm = start_warmup() if extra.pop("_warmup", 1) else None

    pf = extra.pop("_prefetch", None)
    imports_first = bool(extra.pop("_imports_first", 0))
    gentle = extra.pop("_gentle_mb", 0) << 20
    import cache.start_pages

    pages_path = cache.start_pages.default_path(os.path.dirname(MODEL_DIR))  # as a worker keeps it in its cache dir
    if extra.pop("_stream", "process") == "process":  # the pack streams to the GPU from a separate process
        import cache.device_stream

        fetch = cache.device_stream.start(MODEL_DIR, start_pages=pages_path if extra.pop("_pages", 1) else None)
        if fetch is not None:
            stamps["device_stream_started"] = time.time()
            pf = [0, 0]
    if pf is None or pf[0] > 0:
        fetch = cache.loader.prefetch(MODEL_DIR, *([pf[0], pf[1] << 20] if pf else []), imports_first=imports_first,
                                      gentle_bytes=gentle)
        stamps["prefetch_started"] = time.time()
    if "_loader_chunk_mb" in extra:
        cache.loader.DEFAULT_CHUNK_BYTES = extra.pop("_loader_chunk_mb") << 20
    preload = extra.pop("_preload", 1)
    engine_mode = extra.pop("_engine_mode", "jit")
    extra.pop("_triton", None)  # the parent set TRITON_CACHE_DIR

import torch  # noqa: E402

stamps["import_torch"] = time.time()
if fetch is not None and hasattr(fetch, "boost"):
    fetch.boost()  # the import is done (a preload's loader would boost it too, a little later)
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
stamps["cuda_init"] = time.time()
prompt = [(1000 + 7 * i) % 30000 for i in range(PROMPT_LEN)]
phases: dict = {}


def timed(name, fn):
    """Wrap fn so each call adds its wall seconds to phases[name] (the engine's own code runs unchanged)."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


if MODE == "ours":
    if preload:  # the weights stream while the engine imports and builds (as handler.engine_boot does)
        from engine.config import EngineArgs
        from engine.models.weights import preload_weights

        stamps["preloading"] = preload_weights(EngineArgs(model=MODEL_DIR, dtype="bfloat16", device="cuda", **extra))
        stamps["preload_started"] = time.time()
    if warm is not None and warm.install():
        stamps["warmup_installed"] = time.time()
    from engine import EngineArgs
    from warmup.artifacts import prepare

    engine_args, selection = prepare(engine_mode, EngineArgs(model=MODEL_DIR, dtype="bfloat16", device="cuda",
                                                             **extra))
    stamps["engine_mode"] = time.time()
    import engine.runner as runner_module
    from engine import LLM, SamplingParams

    runner_module.load_model = timed("weights", runner_module.load_model)
    runner_module.ModelRunner._size_kv_cache = timed("kv_sizing", runner_module.ModelRunner._size_kv_cache)
    graphs = getattr(runner_module, "DecodeGraphs", None)
    if graphs is not None:
        graphs.capture = timed("graphs", graphs.capture)
    stamps["imports"] = time.time()
    llm = LLM(**vars(engine_args))
    torch.cuda.synchronize()
    stamps["engine_ready"] = time.time()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    stamps["first_token"] = time.time()
    model = llm.engine.runner.model
    model.wait_weights()
    recorded = cache.start_pages.record(pages_path) if not os.path.exists(pages_path) else None  # as a worker does
    preloading = stamps.pop("preloading", None)
    result = {"load_stats": getattr(model, "load_stats", None), "token": out[0].outputs[0].token_ids,
              "num_kv_blocks": llm.engine.num_kv_blocks, "preloaded": preloading, "start_pages_recorded": recorded,
              "engine_mode": selection.mode, "engine_mode_reason": selection.reason,
              "prefetch_bytes": getattr(fetch, "bytes_read", 0),
              "prefetch_seconds": ((fetch.finished or time.perf_counter()) - fetch.started)
              if isinstance(fetch, cache.loader.Prefetch) else 0,
              "device_stream": getattr(fetch, "finished", None) if not isinstance(fetch, cache.loader.Prefetch)
              else None}
elif MODE == "hf":
    import transformers

    stamps["imports"] = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16, device_map="cuda")
    torch.cuda.synchronize()
    stamps["engine_ready"] = time.time()
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    stamps["first_token"] = time.time()
    result = {"token": ids[0, -1:].tolist()}
elif MODE == "safetensors":
    from safetensors.torch import load_file

    stamps["imports"] = time.time()
    shards = sorted(os.path.join(MODEL_DIR, n) for n in os.listdir(MODEL_DIR) if n.endswith(".safetensors"))
    tensors = {}
    for shard in shards:
        tensors.update(load_file(shard, device="cuda"))
    torch.cuda.synchronize()
    stamps["engine_ready"] = time.time()
    result = {"nbytes": sum(t.numel() * t.element_size() for t in tensors.values())}
elif MODE == "loader":
    from cache.loader import load_pack
    from cache.pack import find_packs

    stamps["imports"] = time.time()
    st = load_pack(find_packs(os.path.join(MODEL_DIR, "packs"))[0], "cuda").wait()
    stamps["engine_ready"] = time.time()
    result = {"load_stats": {"source": "pack", "gbps": st.gbps, "seconds": st.seconds, "nbytes": st.nbytes,
                             "pin_seconds": st.pin_seconds, "alloc_seconds": st.alloc_seconds, "mode": st.mode,
                             "threads": st.threads, "chunk_bytes": st.chunk_bytes}}
elif MODE == "bare":
    result = {}
else:
    raise SystemExit(f"mode: {MODE!r} is not one of ours, hf, safetensors, bare, loader")

result.update(stamps=stamps, phases=phases, transformers_imported="transformers" in sys.modules)
print("RESULT " + json.dumps(result), flush=True)
