"""Online serving through the real entry point: `python -m handler serve` in a fresh process, and
closed-loop clients streaming `/v1/completions` over HTTP, the load `bench.serving` puts on the
engine in-process.

`python -m bench.serving_http --out DIR [--concurrency 64] [--env NAME=VALUE ...]` on a GPU machine:
synthesizes the model (`bench.cold_start.bench_model`: random weights, a word-level tokenizer) once,
starts the server on it (its first start writes the pack), sends `--warmup-requests` requests at
once, then runs `--concurrency` clients for `--online-warmup` + `--online-seconds` seconds. Each
client sends its next conv-trace request (bench.serving's online requests: a random token-id
prompt, exactly output_len tokens with ignore_eos, greedy) when its last one ends; past the window
it closes a stream once it has its first token. The statistics are bench.serving's
(`bench.timing.summarize_window`: tokens that arrived in the window, TTFT of requests sent in it,
ITL); each chunk's tokens are its words, one word per token id with this tokenizer. Writes
DIR/serving_http.json.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import threading
import time

from bench.cold_start import bench_model
from bench.compiled_start import Serve
from bench.serving import SEEDS
from bench.timing import RequestRecord, summarize_window
from bench.trace import random_prompt, sample_lengths


def stream_completion(
    port: int, ids: list[int], output_len: int, stop_at: float | None = None
) -> RequestRecord:
    """One streamed greedy /v1/completions of exactly output_len tokens, as bench.drivers forces
    them in-process, recorded as a client sees it. Past stop_at (if given) the connection is
    closed as soon as the request has its first token (the server aborts it)."""
    body = json.dumps(
        {
            "model": "bench",
            "prompt": ids,
            "max_tokens": output_len,
            "min_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    rec = RequestRecord(len(ids), output_len, time.perf_counter())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.finish_reason = f"http {resp.status}: {resp.read()[:300]!r}"
            return rec
        tokens = 0
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            tokens += len((choice.get("text") or "").split())  # one word per token id
            rec.add(time.perf_counter(), tokens)
            rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
            if stop_at is not None and rec.chunks and time.perf_counter() > stop_at:
                break
    finally:
        conn.close()
    return rec


def closed_loop(port: int, make_request, clients: int, warmup_s: float, seconds: float) -> dict:
    """`clients` threads, each sending its next request when the last one ends, for warmup_s +
    seconds; statistics over the last `seconds` (bench.timing.summarize_window, as the in-process
    online part)."""
    counter, lock = itertools.count(), threading.Lock()
    start = time.perf_counter()
    window = (start + warmup_s, start + warmup_s + seconds)
    records: list[RequestRecord] = []

    def client() -> None:
        while time.perf_counter() < window[1]:
            with lock:
                k = next(counter)
            ids, output_len = make_request(k)
            records.append(stream_completion(port, ids, output_len, stop_at=window[1]))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r.finish_reason for r in records if str(r.finish_reason).startswith("http")]
    return {
        "clients": clients,
        "requests": len(records),
        "errors": errors[:5],
        "error_count": len(errors),
        **summarize_window(records, *window),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--config", default="llama-3.1-8b.json", help="of bench/configs, or a path")
    ap.add_argument("--device", default="cuda", help="where the random weights are made")
    ap.add_argument("--model-root", default="/tmp/coldbrew-bench/model")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--online-warmup", type=float, default=5.0)
    ap.add_argument("--online-seconds", type=float, default=20.0)
    ap.add_argument("--warmup-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the server (e.g. MAX_NUM_BATCHED_TOKENS=1024, QUANTIZATION=fp8)",
    )
    a = ap.parse_args(argv)
    model_dir, cache_dir = bench_model(a.config, a.model_root, a.device)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    env = {
        "MODEL_NAME": model_dir,
        "CACHE_DIR": cache_dir,
        "MAX_MODEL_LEN": str(a.max_prompt + a.max_output),
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "bench",
        "GPU_MEMORY_UTILIZATION": "0.9",  # bench.serving's
        "LOG_LEVEL": "INFO",
    }
    env.update(item.split("=", 1) for item in a.env)
    lengths = sample_lengths(19365, SEEDS["online"], a.max_prompt, a.max_output)

    def make_request(k: int) -> tuple[list[int], int]:
        p, o = lengths[k % len(lengths)]
        return random_prompt(p, vocab, SEEDS["online"] * 1_000_003 + k), o

    spawned = time.perf_counter()
    server = Serve(env)
    try:
        first = stream_completion(server.port, make_request(10**6)[0][:128], 1)
        if not first.chunks:
            raise RuntimeError(f"first request failed: {first.finish_reason}\n{server.output()}")
        first_token_s = first.first_token_time - spawned
        warm = [
            threading.Thread(
                target=stream_completion, args=(server.port, *make_request(2 * 10**6 + i))
            )
            for i in range(a.warmup_requests)
        ]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        online = closed_loop(
            server.port, make_request, a.concurrency, a.online_warmup, a.online_seconds
        )
    finally:
        rc = server.stop()
    result = {
        "config": a.config,
        "env": {k: v for k, v in env.items() if k not in ("MODEL_NAME", "CACHE_DIR")},
        "first_token_s": first_token_s,
        "online": online,
        "server_exit": rc,
        "server_log_tail": server.output(40),
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "serving_http.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"python -m handler serve, {a.concurrency} clients: {online['output_tok_s']:.0f} output "
        f"tok/s over {a.online_seconds:.0f} s, TTFT p50 {online['ttft_ms']['p50']:.0f} ms, p99 "
        f"{online['ttft_ms']['p99']:.0f} ms, {online['error_count']} errors "
        f"({' '.join(f'{k}={v}' for k, v in result['env'].items())})",
        flush=True,
    )


if __name__ == "__main__":
    main()
