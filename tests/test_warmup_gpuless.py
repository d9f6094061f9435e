"""Compiled engines built without a GPU: `python -m warmup build --no-gpu --arch sm_80,sm_90` on a
tiny model gives one artifact per architecture whose cubins are ELF files for that SM (read from the
ELF header, as cuobjdump does), keyed for any memory size with this install's versions; the kernel
set it traces follows the engine's limits.

CPU; Triton must be importable (its wheel carries ptxas). GPU (-m gpu): an artifact built with no
GPU visible, installed into an empty Triton cache, leaves a worker nothing to compile, with jit's
greedy tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import triton_nvidia_backend
from engine import EngineArgs
from warmup.artifacts import (
    ARTIFACT_FILE,
    TRITON_DIR,
    artifact_key,
    install,
    kernel_code_digest,
    select,
)
from warmup.kernel_set import Step, steps_for

triton = pytest.importorskip("triton")

REPO = Path(__file__).resolve().parent.parent
EM_CUDA = 190  # the ELF machine number of NVIDIA's CUDA objects
ENGINE_KERNELS = {
    "paged_attention_kernel",
    "_rms_norm_kernel",
    "_rope_kernel",
    "_gate_and_mul_kernel",
    "_skinny_gemm_kernel",
    "_argmax_kernel",  # the sampler's greedy pick and random draw (vocab_argmax)
    "_row_gemv_kernel",  # batch-1 decode's norm/activation + linear (engine.layers.row_gemv)
    "_send_kernel",  # a step's inputs from pinned host memory to the device (engine.step_transfer)
}
LIMITS = ["--dtype", "bfloat16", "--max-model-len", "128", "--max-num-seqs", "4"]


def cubin_sm(data: bytes) -> int:
    """The SM number a CUDA ELF object was built for: e_flags' low byte, or the next one from ELF
    ABI version 8 (CUDA 12.8's new layout)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not a 64-bit ELF file"
    assert struct.unpack_from("<H", data, 18)[0] == EM_CUDA, "not a CUDA object"
    flags = struct.unpack_from("<I", data, 48)[0]
    return (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF


def run_script_ok(script: str, model_dir: str, triton_cache, *args: str) -> None:
    """Run a test script in a fresh interpreter (its own Triton driver and patches) with the model
    dir (then `args`) as its arguments and its own Triton cache; it must print "ok" last."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(triton_cache), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", script, model_dir, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny") / "llama")
    make_tiny_model("llama", path)
    return path


def build(model: str, *extra: str, env: dict | None = None) -> list[Path]:
    out = subprocess.run(
        [sys.executable, "-m", "warmup", "build", "--model", model, *LIMITS, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return [Path(line) for line in out.stdout.splitlines() if line.startswith("/")]


@pytest.mark.slow
def test_a_build_without_a_gpu_has_kernels_for_each_architecture_keyed_for_it(tiny_llama):
    from engine.models.weights import model_digest

    paths = build(tiny_llama, "--no-gpu", "--arch", "sm_80,sm_90", "--jobs", "2")
    assert len(paths) == 2
    by_arch = {}
    for path in paths:
        data = json.loads((path / ARTIFACT_FILE).read_text())
        key, record = data["key"], data["record"]
        by_arch[key["gpu_arch"]] = path
        assert key == {
            "format": 1,
            "model_digest": model_digest(tiny_llama),
            "gpu_arch": key["gpu_arch"],
            "gpu_memory_gib": "any",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "kernel_code": kernel_code_digest(),
            "dtype": "bfloat16",
            "max_model_len": 128,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 8192,
            "block_size": 16,
            "gpu_memory_utilization": "any",
        }
        assert (
            record["built_without_gpu"]
            and record["kv_step_bytes"] is None
            and record["graph_sizes"] == [1, 2, 4]
        )
        sm = int(key["gpu_arch"].removeprefix("sm_"))
        cubins = sorted((path / TRITON_DIR).rglob("*.cubin"))
        assert len(cubins) == len(record["kernels"]) >= len(ENGINE_KERNELS)
        assert {cubin_sm(c.read_bytes()) for c in cubins} == {sm}
        early = []  # engine.pdl: launched early on Hopper, never where griddepcontrol is missing
        for cubin in cubins:  # Triton's metadata beside each cubin names the same target
            meta = json.loads(cubin.with_suffix(".json").read_text())
            assert (meta["target"]["backend"], meta["target"]["arch"]) == ("cuda", sm)
            early.append(meta["launch_pdl"])
        assert any(early) == (sm >= 90), (sm, early)
        assert set(record["kernels"].values()) == ENGINE_KERNELS
        assert set(record["kernels"]) == {p.name for p in (path / TRITON_DIR).iterdir()}
    assert sorted(by_arch) == ["sm_80", "sm_90"]
    # A worker on an A100 or an H100 of any memory, with the same install, takes its architecture's
    # artifact
    for arch, gib in (("sm_90", 80), ("sm_90", 141), ("sm_80", 40)):
        worker = json.loads((by_arch[arch] / ARTIFACT_FILE).read_text())["key"]
        worker = artifact_key(
            worker["model_digest"],
            {
                **{
                    k: worker[k]
                    for k in (
                        "dtype",
                        "max_model_len",
                        "max_num_seqs",
                        "max_num_batched_tokens",
                        "block_size",
                    )
                },
                "gpu_memory_utilization": 0.95,
            },
            {"gpu_arch": arch, "gpu_memory_gib": gib},
            {k: worker[k] for k in ("torch", "triton", "cuda", "kernel_code")},
        )
        assert select("compiled", [str(p.parent) for p in paths], worker).artifact == str(
            by_arch[arch]
        )
    # installed into a worker's empty cache, each kernel is a hit for Triton's own cache manager
    from triton.runtime.cache import FileCacheManager

    cache = by_arch["sm_90"].parent.parent / "worker-triton"
    install(str(by_arch["sm_90"]), str(cache))
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    try:
        for entry, name in json.loads((by_arch["sm_90"] / ARTIFACT_FILE).read_text())["record"][
            "kernels"
        ].items():
            manager = FileCacheManager(entry)  # the entry's directory name is the manager's key
            assert manager.cache_dir == str(cache / entry)
            assert manager.get_group(f"{name}.json") is not None, entry
    finally:
        os.environ.pop("TRITON_CACHE_DIR")


def test_the_kernel_set_follows_the_engine_limits():
    args = EngineArgs(model="x", max_num_seqs=4, max_model_len=128)
    steps = steps_for(args, 128)
    assert [s for s in steps if s.graph] == [Step(s, s, 8, graph=True) for s in (1, 2, 4)]
    eager = {(s.num_tokens, s.num_seqs, s.table_width) for s in steps if not s.graph}
    # a prompt of 2, 16 and 17 rows, and a decode beside a prompt chunk, at the widest tables
    assert eager == {(2, 1, 8), (16, 1, 8), (17, 1, 8), (18, 2, 8)}
    first = steps_for(args, 128, first_only=True)
    assert [s for s in first if s.graph] == [Step(1, 1, 8, graph=True)] and set(first) <= set(steps)
    wide = steps_for(EngineArgs(model="x", max_num_seqs=4, max_model_len=4096), 4096)
    assert {s.table_width for s in wide} == {256}
    # batches above the largest graph run eager: every batch at the widest tables, every width at
    # the first
    big = steps_for(
        EngineArgs(model="x", max_num_seqs=6, cuda_graph_sizes=[1, 2, 4], max_model_len=64), 64
    )
    decode = {
        (s.num_seqs, s.table_width) for s in big if not s.graph and s.num_seqs == s.num_tokens
    }
    assert decode == {(5, 4), (6, 4), (5, 1), (5, 2), (5, 3)}
    eager_only = steps_for(
        EngineArgs(model="x", max_num_seqs=2, enforce_eager=True, max_model_len=32), 32
    )
    assert not any(s.graph for s in eager_only)
    assert {(s.num_seqs, s.table_width) for s in eager_only if s.num_seqs == s.num_tokens} == {
        (1, 1),
        (1, 2),
        (2, 2),
    }


def test_the_table_width_selects_no_other_attention_kernel(tiny_llama, tmp_path):
    """Why the kernel set traces prompt and mixed steps at one width: their attention launches
    compile to the same kernels at any table width (1, 2, a multiple of 16, other), so a width a
    worker meets later never compiles on its request."""
    script = textwrap.dedent("""
        import sys
        import torch
        from engine.config import ModelConfig
        from warmup.aot import target_driver
        from warmup.kernel_set import Step, meta_model, trace

        cfg = ModelConfig.from_dir(sys.argv[1])

        def attention_kernels(width):
            sink = []
            trace(model, [Step(18, 2, width), Step(17, 1, width)], 16, 512, sink)
            return {k.hash for k in sink if k.name == "paged_attention_kernel"}

        with target_driver("sm_90"):
            model = meta_model(cfg, torch.bfloat16, 132)
            widest = attention_kernels(32)
            assert len(widest) == 2, widest  # the decode launch and the prompt launch
            for width in (1, 2, 16, 17):
                assert attention_kernels(width) == widest, width
        print("ok")
    """)
    run_script_ok(script, tiny_llama, tmp_path)


# ---- GPU ---------------------------------------------------------------------------------
# bf16; an FP8 KV cache; FP8 weights (QUANTIZATION=fp8): each takes kernels of its own
PRECISIONS = {
    "bf16": {},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-weights": {"quantization": "fp8"},
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_an_artifact_built_with_no_gpu_visible_leaves_the_worker_nothing_to_compile(
    tiny_llama, tmp_path, precision
):
    from engine import LLM, SamplingParams
    from warmup.artifacts import prepare
    from warmup.ready import warm_kernels

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    if precision == "fp8-weights" and (major, minor) < (8, 9):
        pytest.skip("FP8 weights need FP8 tensor cores (sm_89 and later)")
    out = tmp_path / "engines"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in PRECISIONS[precision].items()]
    build(
        tiny_llama,
        "--no-gpu",
        "--arch",
        arch,
        "--out-dir",
        str(out),
        *flags,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    args = EngineArgs(
        model=tiny_llama,
        dtype="bfloat16",
        device="cuda",
        max_model_len=128,
        max_num_seqs=4,
        gpu_memory_utilization=0.3,
        **PRECISIONS[precision],
    )
    prompts = [[5 + i, 9, 17, 33] * (1 + 3 * i) for i in range(4)] + [[7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, seed=3)
    tokens = {}
    for mode in ("jit", "compiled"):
        cache = tmp_path / f"triton-{mode}"
        triton.knobs.cache.dir = str(cache)  # an empty cache each: a fresh machine
        engine_args, sel = prepare(mode, args, str(tmp_path))
        if mode == "compiled":
            assert sel.artifact.startswith(str(tmp_path / "engines"))
        before = set(os.listdir(cache)) if cache.exists() else set()
        llm = LLM(**vars(engine_args))
        warm = warm_kernels(llm)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        # every decode graph size, prompts alone and batched, the sampler's draw
        for n in (1, 3, 4):
            llm.generate(prompts[:n], sampled)
        assert warm.loaded.wait(300)
        after = set(os.listdir(cache))
        if mode == "compiled":
            assert warm.compiled == [] and after == before, (
                f"compiled at run time: {sorted(after - before)}"
            )
        else:
            # the empty cache: the background trace compiled the rest of the set
            assert warm.compiled
        # the set's kernels for this GPU's SM count, preloaded from the trace's list
        assert warm.kernels >= len(ENGINE_KERNELS) and warm.skipped == 0, warm.summary()
        del llm
        from conftest import free_gpu_memory

        free_gpu_memory()
    assert tokens["compiled"] == tokens["jit"]
    shutil.rmtree(out)


def test_an_fp8_kv_engine_built_without_a_gpu_is_keyed_and_compiled_for_fp8(tiny_llama):
    """KV_CACHE_DTYPE fp8 takes other attention kernels (the backend's quantizing K/V write, the
    FP8-reading attention): the kernel set is traced over an FP8 cache and the key says so."""
    (path,) = build(
        tiny_llama, "--no-gpu", "--arch", "sm_90", "--jobs", "1", "--kv-cache-dtype", "fp8"
    )
    data = json.loads((path / ARTIFACT_FILE).read_text())
    assert data["key"]["kv_cache_dtype"] == "fp8_e4m3"
    assert set(data["record"]["kernels"].values()) == ENGINE_KERNELS | {"write_kv_kernel"}


def test_an_fp8_weights_engine_built_without_a_gpu_is_keyed_and_compiled_for_fp8(tiny_llama):
    """QUANTIZATION=fp8: the kernel set is traced through the FP8 linears (the one-row GEMV over
    e4m3 weights; at more rows the norm and gate activation writing their rows quantized and the
    kernel scaling _scaled_mm's unit-scale product), so an FP8 worker compiles none of them on a
    request; the key says fp8."""
    (path,) = build(
        tiny_llama, "--no-gpu", "--arch", "sm_90", "--jobs", "1", "--quantization", "fp8"
    )
    data = json.loads((path / ARTIFACT_FILE).read_text())
    assert data["key"]["quantization"] == "fp8"
    kernels = set(data["record"]["kernels"].values())
    assert {"_scale_product_kernel", "_gate_and_mul_fp8_kernel", "_row_gemv_kernel"} <= kernels
    # the one-row GEMV over e4m3 weights: its PTX widens them (cvt ... e4m3x2)
    ptx = [p.read_text() for p in (path / TRITON_DIR).rglob("_row_gemv_kernel.ptx")]
    assert any("e4m3x2" in text for text in ptx), "no one-row GEMV over e4m3 weights in the set"


def test_a_gemma_engine_built_without_a_gpu_takes_the_fused_norm_gate_and_rope(tmp_path):
    """Gemma 3's (1 + w) norms, its GELU gate and its per-head q/k norms run in the same fused
    kernels as Llama's on CUDA (engine.layers.fused), so its kernel set holds them; plain torch ops
    (as before) would leave them out."""
    from tiny_models import make_tiny_model

    model = str(tmp_path / "gemma3")
    make_tiny_model("gemma3", model)
    (path,) = build(model, "--no-gpu", "--arch", "sm_90", "--jobs", "1")
    kernels = set(json.loads((path / ARTIFACT_FILE).read_text())["record"]["kernels"].values())
    assert {"_rms_norm_kernel", "_gate_and_mul_kernel", "_rope_kernel"} <= kernels, kernels


@pytest.mark.skipif(not triton_nvidia_backend(), reason="triton without its CUDA backend (ptxas)")
def test_the_sets_records_preload_each_sm_counts_kernels_with_no_trace(tiny_llama, tmp_path):
    """What a serving worker does with the background trace's list (warmup.ready): a fresh process
    preloads one SM count's records into Triton's JIT cache without tracing, so it imports no
    sympy (torch's Python meta kernels import it, about a second of a worker's interpreter lock);
    then tracing that count's whole set there compiles nothing (every kernel a GPU of that count
    launches was listed for it), and a pause before each record stops the preload where it
    raises. A record for a kernel that no longer exists is counted, not fatal."""
    found = tmp_path / "set.json"
    record_script = textwrap.dedent("""
        import json, os, sys
        from engine import EngineArgs
        from warmup.aot import compile_kernel_set
        args = EngineArgs(model=sys.argv[1], dtype="bfloat16", max_model_len=128, max_num_seqs=4)
        found = compile_kernel_set(args, os.environ["TRITON_CACHE_DIR"], [132, 114], "sm_90")
        json.dump(found.preload, open(sys.argv[2], "w"))
        print("ok")
    """)
    run_script_ok(record_script, tiny_llama, tmp_path / "tc", str(found))
    records = json.loads(found.read_text())
    assert {r["sm_count"] for r in records} == {132, 114}
    script = textwrap.dedent("""
        import json, os, sys
        import torch
        from triton import knobs
        from engine import EngineArgs
        from engine.config import ModelConfig
        from warmup.aot import target_driver
        from warmup.kernel_set import meta_model, split_target, steps_for, trace
        from warmup.ready import preload

        records = json.load(open(sys.argv[2]))
        count = int(sys.argv[3])
        mine = [r for r in records if r["sm_count"] == count]
        ghost = dict(mine[0], name="no_such_kernel")
        cache = os.environ["TRITON_CACHE_DIR"]
        on_disk = set(os.listdir(cache))
        with target_driver("sm_90", count):
            calls = []

            def pause():
                calls.append(1)
                if len(calls) == 3:
                    raise InterruptedError()

            try:
                preload(mine, pause)
            except InterruptedError:
                pass
            assert len(calls) == 3
            # no GPU here: the modules' load (after every record) is not reached
            loaded = []
            try:
                preload([ghost] + mine, lambda: loaded.append(1))
            except Exception:
                pass
            assert len(loaded) == len(mine) + 2, (len(loaded), len(mine))
            assert "sympy" not in sys.modules, "preloading traced"
            # each kernel read from the cache, none compiled (a record's options are the cache's)
            assert set(os.listdir(cache)) == on_disk
            compiled = []
            knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
            args = EngineArgs(
                model=sys.argv[1], dtype="bfloat16", max_model_len=128, max_num_seqs=4
            )
            config = ModelConfig.from_dir(sys.argv[1])
            model = meta_model(config, torch.bfloat16, split_target(count))
            trace(model, steps_for(args, 128), 16, 128, [])
            assert compiled == [], compiled
        print("ok")
    """)
    for count in ("132", "114"):
        run_script_ok(script, tiny_llama, tmp_path / "tc", str(found), count)


def test_the_warm_ups_pause_waits_while_requests_run_and_counts_the_wait():
    """warmup.ready's pause for a serving engine: it polls the engine's counters (as
    AsyncLLM.stats_nowait gives them) until no request runs or waits, and the time it waited is
    what the start-up log reports as waiting for requests."""
    from types import SimpleNamespace

    from warmup import ready

    class Busy:
        def __init__(self) -> None:
            self.polls = 0

        def stats_nowait(self):
            self.polls += 1  # a request runs for the first three polls
            return SimpleNamespace(num_running=int(self.polls <= 3), num_waiting=0)

        def wait_stopped(self, timeout: float) -> bool:
            time.sleep(timeout)
            return False

    live, result = SimpleNamespace(serving=Busy()), ready.KernelWarmup()
    pause = ready._pause_for(live, result)
    pause()
    assert live.serving.polls == 4 and result.waited_s >= 3 * ready.IDLE_POLL_S
    pause()  # idle: no wait
    assert live.serving.polls == 5 and result.waited_s < 4 * ready.IDLE_POLL_S
    assert f"{result.waited_s:.2f} s waiting for requests" in result.summary()
