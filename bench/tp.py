"""Tensor-parallel benchmark for a machine with two GPUs (`bash bench/tp_gpu.sh` runs every part).

Parts (`python -m bench.tp PART --out DIR`), each writing DIR/tp-<part>.json as it finishes:
  env        GPUs, their links, software versions, the NVLink-multicast switches
  allreduce  the all-reduce choice: NCCL vs torch's symmetric-memory one-shot, eager and inside a
             CUDA graph, at decode and prefill sizes of a hidden size of 8192 (bf16), checked
             against the exact sum
  parity     TP=2 against TP=1 on a random-weight Llama-3.2-1B: greedy tokens and logprobs in
             float32 and bf16, and decode at batch 1 with each all-reduce
  serve70b   Llama-3.1-70B-shaped bf16, random weights made on the GPUs, TP=2: decode at batch 1
             against the 2-GPU roofline, then online serving at concurrency 64 on the conv trace
             (output and total tok/s, TTFT, ITL)
  symm70b    the same engine with the symmetric-memory all-reduce: decode at batch 1
  report     one table of whatever the parts wrote
`--device cpu` runs the code paths on CPU (gloo, tiny configs) as a smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("bench.tp")

HIDDEN = 8192
MESSAGE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)  # messages of [tokens, HIDDEN]
GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 128]
SEEDS = {"parity": 11, "warmup": 5, "decode": 6, "online": 3}
ONLINE_HOW = (
    "closed loop: 64 clients each send their next conv-trace request (prompt <= 4096, "
    "output <= 1024, random ids, output forced) when the last ends; window after the "
    "warm-up; total tok/s counts the prompt tokens of requests whose first token came in "
    "the window"
)


def write(out: str, part: str, data: dict) -> None:
    os.makedirs(out, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    path = os.path.join(out, f"tp-{part}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({**data, "date": now}, f, indent=1)
    os.replace(path + ".tmp", path)


def read(out: str, part: str) -> dict:
    try:
        with open(os.path.join(out, f"tp-{part}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def graphs_work(out: str) -> bool:
    """Whether the allreduce part captured NCCL inside a CUDA graph (unknown: assume so)."""
    return read(out, "allreduce").get("nccl_in_graph_ok", True)


def free_gpu() -> None:
    import torch

    gc.unfreeze()  # engines move their start-up objects out of the GC's reach
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- env -----------------------------------------------------------------------------------------
def env(opts) -> None:
    import torch

    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"failed: {e}"

    count = torch.cuda.device_count()
    switches = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    write(
        opts.out,
        "env",
        {
            "gpus": [torch.cuda.get_device_name(i) for i in range(count)],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if count else None,
            "p2p": torch.cuda.can_device_access_peer(0, 1) if count > 1 else None,
            "topology": sh(["nvidia-smi", "topo", "-m"]),
            "multicast_off": {k: os.environ.get(k) for k in switches},
        },
    )


# ---- allreduce -----------------------------------------------------------------------------------
def allreduce(opts) -> None:
    import torch.distributed as dist

    from engine.distributed.comm import STORE_TIMEOUT

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.tp",
            "allreduce-rank",
            "--port",
            str(store.port),
            "--out",
            opts.out,
            "--device",
            opts.device,
        ]
    )
    try:
        result = allreduce_rank(0, store, opts.device)
    finally:
        try:
            peer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            peer.kill()
    write(opts.out, "allreduce", result)


def allreduce_rank_main(opts) -> None:
    import torch.distributed as dist

    from engine.distributed.comm import STORE_TIMEOUT

    parent = os.getppid()

    def exit_with_parent() -> None:  # rank 0 killed for time would leave this one stuck otherwise
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    store = dist.TCPStore("127.0.0.1", opts.port, 2, False, timeout=STORE_TIMEOUT)
    allreduce_rank(1, store, opts.device)


def _wall_us(op, n: int = 20) -> float:
    """Microseconds per op on CPU (the smoke run): the mean of n after a warm-up."""
    op()
    t0 = time.perf_counter()
    for _ in range(n):
        op()
    return (time.perf_counter() - t0) * 1e6 / n


def allreduce_rank(rank: int, store, device_type: str = "cuda") -> dict:
    """Both ranks run this in lockstep; rank 0's result is what is written."""
    import torch
    import torch.distributed as dist

    from engine.distributed.comm import join

    cuda = device_type == "cuda"
    if cuda:
        from bench.attention_micro import time_call  # imports triton
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    comm = join(rank, 2, store, device, "symm_mem", torch.bfloat16).comm

    def nccl(x):
        dist.all_reduce(x)
        return x

    backends = {"nccl": nccl}
    if comm.symm is not None:
        backends["symm_mem"] = comm.symm
    rows, graph_ok, errors = [], {}, {}
    for tokens in MESSAGE_TOKENS:
        seeds = [torch.Generator().manual_seed(tokens * 10 + r) for r in range(2)]
        parts = [torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16) for g in seeds]
        expected = (parts[0].float() + parts[1].float()).to(device)
        mine = parts[rank].to(device)
        work = torch.empty_like(mine)
        row = {"tokens": tokens, "bytes": mine.numel() * 2}
        for name, fn in backends.items():
            if name == "symm_mem" and mine.numel() > comm.symm.buffer.numel():
                continue

            def op(fn=fn):
                work.copy_(mine)
                return fn(work)

            got = op().float()
            entry = {"rel_err": float((got - expected).norm() / expected.norm())}
            comm.min_int(0)  # both ranks start each timing together
            entry["eager_us"] = time_call(op, False) * 1e6 if cuda else _wall_us(op)
            comm.min_int(0)
            try:
                if cuda:  # as the engine captures under tensor parallelism
                    entry["graph_us"] = time_call(op, True, capture_error_mode="thread_local") * 1e6
                    graph_ok.setdefault(name, True)
            except Exception as e:  # noqa: BLE001 - recorded: the engine then runs eager
                graph_ok[name] = False
                errors[f"{name}-graph"] = f"{type(e).__name__}: {e}"[:500]
                torch.cuda.synchronize()
            row[name] = entry
            comm.min_int(0)
        rows.append(row)
        log.info("all-reduce %s", row)
    comm.min_int(0)
    return {
        "hidden": HIDDEN,
        "dtype": "bfloat16",
        "rows": rows,
        "backends": list(backends),
        "symm_mem_buffer_bytes": comm.symm.buffer.numel() * 2 if comm.symm else None,
        "nccl_in_graph_ok": graph_ok.get("nccl", False),
        "symm_mem_in_graph_ok": graph_ok.get("symm_mem"),
        "errors": errors,
        "how": "each op copies the rank's [tokens, 8192] bf16 input into a work buffer and "
        "all-reduces it; bench.attention_micro.time_call: median of 7 runs of 20 ops "
        "back to back, eager or captured in one graph (CUDA events)",
    }


# ---- parity --------------------------------------------------------------------------------------
def decode_ms(
    llm, vocab: int, prompt_len: int = 128, new_tokens: int = 64, repeats: int = 3
) -> float:
    """Median ms per decode step of one request alone (engine first-token and finish times)."""
    from bench.drivers import forced_params
    from bench.trace import random_prompt

    times = []
    for i in range(repeats):
        prompt = random_prompt(prompt_len, vocab, SEEDS["decode"] * 100 + i)
        m = llm.generate([prompt], forced_params(new_tokens))[0].metrics
        times.append((m.finished_time - m.first_token_time) / (new_tokens - 1) * 1e3)
    return statistics.median(times)


def _spread(diffs: list[float]) -> dict:
    return {"max": max(diffs, default=0.0), "median": statistics.median(diffs) if diffs else 0.0}


def _compare(ref, got) -> dict:
    """Greedy sequences of TP=1 (ref) and TP=2 (got): how many match, where they part, how far
    logprobs move (of the generated tokens before any divergence, and of every prompt token)."""
    same, first_diff, decode_diff, prompt_diff = 0, [], [], []
    for a, b in zip(ref, got):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        same += n == len(ta)
        first_diff.append(n)
        for la, lb, tok in zip(a.outputs[0].logprobs[:n], b.outputs[0].logprobs[:n], ta[:n]):
            decode_diff.append(abs(la[tok].logprob - lb[tok].logprob))
        for pos, (pa, pb) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])):
            tok = a.prompt_token_ids[pos + 1]
            prompt_diff.append(abs(pa[tok].logprob - pb[tok].logprob))
    return {
        "sequences": len(ref),
        "identical": same,
        "first_divergence": first_diff,
        "decode_logprob_absdiff": _spread(decode_diff),
        "prompt_logprob_absdiff": _spread(prompt_diff),
    }


def parity(opts) -> None:
    from bench.checkpoint import synthesize
    from bench.trace import random_prompt
    from engine import LLM, SamplingParams
    from engine.config import ModelConfig

    t0 = time.perf_counter()
    name = Path(opts.parity_config).stem
    model_dir = synthesize(
        opts.parity_config, f"/tmp/coldbrew-bench/model/{name}", device=opts.device
    )
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = [
        random_prompt(16 + (37 * i) % 300, vocab, SEEDS["parity"] * 1000 + i) for i in range(16)
    ]
    params = SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    eager = not graphs_work(opts.out)
    result: dict = {
        "model": f"{name} (random weights)",
        "prompts": len(prompts),
        "new_tokens": 64,
        "synthesize_s": time.perf_counter() - t0,
        "cases": {},
    }
    cases = [
        ("bfloat16 graphs", "bfloat16", eager, "nccl"),
        ("float32 eager", "float32", True, "nccl"),
        ("bfloat16 graphs symm_mem", "bfloat16", eager, "symm_mem"),
        ("float32 graphs", "float32", eager, "nccl"),
    ]
    cases = [c for c in cases if c[0] in opts.cases.split(",")]
    reference: dict = {}  # dtype -> TP=1 outputs and decode ms
    for label, dtype, enforce_eager, all_reduce in cases:
        case: dict = {"enforce_eager": enforce_eager, "all_reduce_backend": all_reduce}
        outs = {}
        for tp in (1, 2):
            if tp == 1 and dtype in reference:
                outs[1], case["tp1_decode_ms"] = reference[dtype]
                continue
            t1 = time.perf_counter()
            llm = LLM(
                model=model_dir,
                dtype=dtype,
                tensor_parallel_size=tp,
                enforce_eager=enforce_eager,
                all_reduce_backend=all_reduce,
                num_kv_blocks=4096,
                max_model_len=1024,
                max_num_seqs=32,
                load_format="safetensors",
                device=opts.device,
            )
            case[f"tp{tp}_start_s"] = time.perf_counter() - t1
            outs[tp] = llm.generate(prompts, params)
            case[f"tp{tp}_decode_ms"] = decode_ms(llm, vocab)
            if tp == 2:
                case["all_reduce_used"] = llm.engine.runner.tp.comm.all_reduce_name
            llm.shutdown()
            del llm
            free_gpu()
        reference[dtype] = (outs[1], case["tp1_decode_ms"])
        case.update(_compare(outs[1], outs[2]))
        result["cases"][label] = case
        write(opts.out, "parity", result)
        log.info("parity %s: %s", label, {k: v for k, v in case.items() if k != "first_divergence"})


# ---- 70B -----------------------------------------------------------------------------------------
async def _online_c64(engine, vocab: int, opts) -> dict:
    from bench.drivers import run_online
    from bench.timing import summarize_window
    from bench.trace import BenchRequest, random_prompt, sample_lengths

    trace = sample_lengths(19365, SEEDS["online"], 4096, 1024)

    def make_request(k: int) -> BenchRequest:
        p, o = trace[k % len(trace)]
        return BenchRequest(random_prompt(p, vocab, SEEDS["online"] * 1_000_003 + k), o)

    records, w0, w1, poller = await run_online(
        engine,
        make_request,
        64,
        opts.online_warmup,
        opts.online_seconds,
        "online-c64",
        iter(range(10**9)),
    )
    level = summarize_window(records, w0, w1)
    prefilled = sum(
        r.prompt_len
        for r in records
        if r.first_token_time is not None and w0 <= r.first_token_time <= w1
    )
    level["total_tok_s"] = (level["output_tokens"] + prefilled) / (w1 - w0)
    return {**level, "kv": poller.kv(), "concurrency": 64, "how": ONLINE_HOW}


def serve70b(opts, all_reduce: str = "nccl", online: bool = True) -> None:
    import torch

    from bench.checkpoint import config_only_dir
    from bench.drivers import decode_step_times, run_offline
    from bench.roofline import copy_bandwidth, model_bytes
    from bench.serving import config_path
    from bench.trace import make_requests
    from engine import AsyncLLM, EngineArgs

    part = "serve70b" if all_reduce == "nccl" else "symm70b"
    name = Path(opts.serve_config).stem
    config = json.loads(config_path(opts.serve_config).read_text())
    vocab = config["vocab_size"]
    cuda = opts.device == "cuda"
    bandwidth = copy_bandwidth("cuda:0" if cuda else "cpu", (2 << 30) if cuda else (64 << 20))
    dtype = torch.bfloat16 if cuda else torch.float32
    nbytes = model_bytes(config, dtype)
    graphs = graphs_work(opts.out)
    args = EngineArgs(
        model=config_only_dir(config, name, "/tmp/coldbrew-bench/model"),
        dtype=str(dtype).removeprefix("torch."),
        tensor_parallel_size=2,
        load_format="dummy",
        max_model_len=4096 + 1024,
        max_num_seqs=128,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
        enforce_eager=not graphs,
        cuda_graph_sizes=GRAPH_SIZES,
        all_reduce_backend=all_reduce,
        device=opts.device,
    )
    result: dict = {
        "model": f"{name} shape, {dtype}, random weights",
        "tensor_parallel_size": 2,
        "enforce_eager": not graphs,
        "bandwidth_GBps_per_gpu": bandwidth / 1e9,
        "weights_GB": nbytes.weights / 1e9,
    }
    t0 = time.perf_counter()
    engine = AsyncLLM(engine_args=args)
    result["engine_init_s"] = time.perf_counter() - t0
    result["all_reduce_used"] = engine.engine.runner.tp.comm.all_reduce_name
    result["num_kv_blocks"] = engine.engine.num_kv_blocks

    async def run() -> None:
        t1 = time.perf_counter()
        n = 32 if online else 8
        lengths = [(1 + (16 + i * 37) % 512, 1 + i % 32) for i in range(n)]
        await run_offline(engine, make_requests(lengths, vocab, SEEDS["warmup"]), "warmup")
        if online:  # the serving part meets every batch size; decode alone needs size 1 only
            result["graph_capture_s"] = await engine.capture_cuda_graphs()
        result["warmup_s"] = time.perf_counter() - t1
        step_s, all_s = await decode_step_times(
            engine, 128, 128, vocab, repeats=3, seed=SEEDS["decode"] * 1000
        )
        floor_s = nbytes.decode_weights / 2 / bandwidth
        ar = read(opts.out, "allreduce").get("rows") or [{}]
        ar_us = (ar[0].get(all_reduce) or {}).get("graph_us" if graphs else "eager_us")
        per_step = 2 * config["num_hidden_layers"] + 1  # two a layer and the embedding's
        result["decode_b1"] = {
            "prompt_len": 128,
            "new_tokens": 128,
            "ms_per_token": step_s * 1e3,
            "tok_s": 1 / step_s,
            "repeats_ms": [s * 1e3 for s in all_s],
            "floor_ms": floor_s * 1e3,
            "roofline_frac": floor_s / step_s,
            "all_reduces_per_step": per_step,
            "all_reduce_ms_per_step": ar_us * per_step / 1e3 if ar_us else None,
            "how": "(finish - first token) / (tokens - 1), median of 3; floor: each GPU reads half "
            "the weights (all but the embedding table) at its measured copy bandwidth; "
            "all-reduces: their count times the allreduce part's 1-token latency",
        }
        write(opts.out, part, result)
        if online:
            result["online_c64"] = await _online_c64(engine, vocab, opts)
            write(opts.out, part, result)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


# ---- report --------------------------------------------------------------------------------------
def _f(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _report_allreduce(ar: dict) -> list[str]:
    lines = [
        f"all-reduce, us (NCCL in a graph: {ar.get('nccl_in_graph_ok')}, symm_mem in a "
        f"graph: {ar.get('symm_mem_in_graph_ok')})",
        f"{'tokens':>7} {'nccl eager':>11} {'nccl graph':>11} {'symm eager':>11} "
        f"{'symm graph':>11}",
    ]
    for row in ar.get("rows", []):
        cells = [
            row.get(b, {}).get(k) for b in ("nccl", "symm_mem") for k in ("eager_us", "graph_us")
        ]
        lines.append(f"{row['tokens']:>7} " + " ".join(f"{_f(c):>11}" for c in cells))
    return lines


def _report_serving(part: str, res: dict) -> list[str]:
    lines = []
    d = res.get("decode_b1")
    if d:
        lines.append(
            f"{part} ({res.get('all_reduce_used')}): decode b1 "
            f"{_f(d['ms_per_token'], '.2f')} ms/token, floor "
            f"{_f(d['floor_ms'], '.2f')} ms "
            f"({_f(100 * d['roofline_frac'], '.0f')}% of roofline), all-reduces "
            f"{_f(d.get('all_reduce_ms_per_step'), '.2f')} ms/step, engine init "
            f"{_f(res.get('engine_init_s'), '.0f')} s"
        )
    o = res.get("online_c64")
    if o:
        lines.append(
            f"{part} online c=64: {_f(o['output_tok_s'], '.0f')} output tok/s, "
            f"{_f(o['total_tok_s'], '.0f')} total tok/s, TTFT p50/p99 "
            f"{_f(o['ttft_ms']['p50'], '.0f')}/{_f(o['ttft_ms']['p99'], '.0f')} ms, "
            f"ITL p50/p99 {_f(o['itl_ms']['p50'])}/{_f(o['itl_ms']['p99'])} ms, "
            f"{o['requests_finished']} requests finished"
        )
    return lines


def report(opts) -> None:
    lines = []
    e = read(opts.out, "env")
    if e:
        lines.append(
            f"GPUs {e.get('gpus')} torch {e.get('torch')} NCCL {e.get('nccl')} p2p {e.get('p2p')}"
        )
    ar = read(opts.out, "allreduce")
    if ar:
        lines += _report_allreduce(ar)
    for label, case in read(opts.out, "parity").get("cases", {}).items():
        prompt = case.get("prompt_logprob_absdiff", {}).get("max")
        lines.append(
            f"parity {label}: {case.get('identical')}/{case.get('sequences')} identical, "
            f"prompt logprob |diff| max {_f(prompt, '.1e')}, decode ms TP1 "
            f"{_f(case.get('tp1_decode_ms'), '.2f')} TP2 "
            f"{_f(case.get('tp2_decode_ms'), '.2f')} ({case.get('all_reduce_used')})"
        )
    for part in ("serve70b", "symm70b"):
        lines += _report_serving(part, read(opts.out, part))
    print("\n".join(lines) if lines else "no results")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "part",
        choices=["env", "allreduce", "allreduce-rank", "parity", "serve70b", "symm70b", "report"],
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, help="allreduce-rank: rank 0's store")
    ap.add_argument("--online-seconds", type=float, default=45.0)
    ap.add_argument("--online-warmup", type=float, default=10.0)
    ap.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: a smoke run of the code paths",
    )
    ap.add_argument(
        "--cases",
        default="bfloat16 graphs,float32 eager,bfloat16 graphs symm_mem",
        help="parity: the cases to run, comma-separated (also: float32 graphs)",
    )
    ap.add_argument(
        "--parity-config", default="llama-3.2-1b.json", help="a bench/configs name or a path"
    )
    ap.add_argument(
        "--serve-config", default="llama-3.1-70b.json", help="a bench/configs name or a path"
    )
    opts = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if opts.part == "allreduce-rank":
        allreduce_rank_main(opts)
    elif opts.part == "symm70b":
        serve70b(opts, "symm_mem", online=False)
    else:
        globals()[opts.part](opts)
    # The results are written: end without the interpreter's teardown of CUDA and NCCL state, which
    # a part must not spend its time limit on.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
