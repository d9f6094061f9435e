"""The serving benchmark end to end on CPU (a tiny random Llama, tiny counts, two calls merged into
one result), and the conv-trace sampler against the CSV read here with the csv module.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.roofline import ModelBytes, decode_window
from bench.timing import RequestRecord
from bench.trace import CONV_TRACE, conv_requests, running_contexts, sample_lengths

REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
CAPS = dict(max_prompt=48, max_output=12)
SIZES = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--num-requests",
    "16",
    "--max-prompt",
    "48",
    "--max-output",
    "12",
    "--fixed-requests",
    "6",
    "--fixed-prompt",
    "24",
    "--fixed-output",
    "20",
    "--concurrency",
    "1,3",
    "--online-seconds",
    "0.8",
    "--online-warmup",
    "0.3",
    "--decode-prompt",
    "16",
    "--decode-tokens",
    "12",
    "--hf-requests",
    "5",
    "--hf-batch-size",
    "2",
    "--warmup-requests",
    "8",
    "--num-kv-blocks",
    "128",
    "--bandwidth-bytes",
    str(8 << 20),
]


def _csv_rows() -> list[tuple[int, int]]:
    with open(CONV_TRACE, newline="") as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


def test_trace_sampler_respects_caps_and_is_deterministic():
    rows = _csv_rows()
    capped = {(min(p, 4096), min(o, 1024)) for p, o in rows}
    a = sample_lengths(1000, seed=1, max_prompt=4096, max_output=1024)
    assert a == sample_lengths(1000, seed=1, max_prompt=4096, max_output=1024)
    assert a != sample_lengths(1000, seed=2, max_prompt=4096, max_output=1024)
    assert all(1 <= p <= 4096 and 1 <= o <= 1024 for p, o in a)
    assert set(a) <= capped  # every pair is a real trace row, clamped
    assert max(p for p, _ in a) == 4096  # the trace has longer prompts: the cap bites
    # more than the trace holds
    tight = sample_lengths(len(rows) + 10, seed=3, max_prompt=64, max_output=8)
    assert len(tight) == len(rows) + 10 and all(p <= 64 and o <= 8 for p, o in tight)
    reqs = conv_requests(20, vocab_size=300, seed=1, **CAPS)
    assert [(r.prompt_len, r.output_len) for r in reqs] == sample_lengths(20, 1, **CAPS)
    assert all(0 <= t < 300 for r in reqs for t in r.prompt_token_ids)
    assert [r.prompt_token_ids for r in reqs] == [
        r.prompt_token_ids for r in conv_requests(20, 300, 1, **CAPS)
    ]


def test_running_contexts_are_caught_mid_output_and_weighted_by_it():
    rows = [(min(p, 4096), min(o, 1024)) for p, o in _csv_rows()]
    contexts = running_contexts(20000, seed=0)
    assert contexts == running_contexts(20000, seed=0) != running_contexts(20000, seed=1)
    assert min(contexts) >= 2 and max(contexts) <= max(p + o for p, o in rows)
    # A sequence is running in proportion to its output length and caught at a uniform point of
    # it: the mean context is E[o (p + (o + 1) / 2)] / E[o] over the trace's rows.
    expected = sum(o * (p + (o + 1) / 2) for p, o in rows) / sum(o for _, o in rows)
    mean = sum(contexts) / len(contexts)
    assert abs(mean / expected - 1) < 0.01, (mean, expected)
    # where the weighting shows: a 1,000-token output is running 1,000 times as often as a 1-token
    # one, and is caught anywhere in it
    two = running_contexts(4000, seed=0, trace=[(10, 1), (10, 1000)])
    assert sum(c == 11 for c in two) < 20
    assert abs(sum(two) / len(two) - 510.5) < 15


def test_decode_window_recovers_a_lockstep_schedule():
    """Four requests decoding in lockstep every 10 ms: the window finds the step time, the batch and
    the KV read."""
    prompts = [10, 20, 30, 40]
    records = []
    for i, p in enumerate(prompts):
        rec = RequestRecord(p, 30, 0.0)
        rec.add(1.0 + 0.001 * i, 1)  # staggered first tokens, then one token per 10 ms step
        for j in range(1, 30):
            rec.add(1.0 + 0.01 * j, j + 1)
        rec.finish_reason = "length"
        records.append(rec)
    mb = ModelBytes(weights=2000, decode_weights=1000, kv_per_token=10)
    win = decode_window(records, None, mb, bandwidth=1e6)
    assert win["valid"] and win["steps"] == 29 and win["mean_batch"] == 4
    assert abs(win["step_ms"] - 10) < 0.2
    assert win["kv_tokens_per_step"] == sum(prompts) + 4 * sum(range(1, 30)) / 29
    assert abs(win["floor_ms"] - (1000 + 10 * win["kv_tokens_per_step"]) / 1e6 * 1e3) < 1e-9
    # e.g. a preemption at t = 1.1 ends the window
    cut = decode_window(records, 1.1, mb, bandwidth=1e6)
    assert cut["steps"] == 10 and cut["kv_tokens_per_step"] == sum(prompts) + 4 * 5.5
    assert not decode_window(records, 1.01, mb, bandwidth=1e6)["valid"]


def run_bench(args: list[str], module: str = "bench.serving") -> str:
    """`python -m module args` from the repo root; its stdout once it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _ordered(lat: dict) -> bool:
    return lat["p50"] is not None and 0 <= lat["p50"] <= lat["p99"]


def test_online_clients_send_the_fixed_lengths_when_asked():
    from types import SimpleNamespace

    from bench import serving

    def first_requests(*flags: str) -> list:
        args = serving.parse_args(["--fixed-prompt", "30", "--fixed-output", "7", *flags])
        bench = SimpleNamespace(args=args, mc=SimpleNamespace(vocab_size=512))
        make_request = serving.Bench.online_request(bench)
        return [make_request(k) for k in range(5)]

    fixed = first_requests("--online-lengths", "fixed")
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(30, 7)] * 5
    assert len({tuple(r.prompt_token_ids) for r in fixed}) == 5  # each its own prompt
    conv = first_requests()  # the default stays the conv trace's lengths
    expected = sample_lengths(19365, serving.SEEDS["online"], 4096, 1024)[:5]
    assert [(r.prompt_len, r.output_len) for r in conv] == expected


@pytest.mark.slow
def test_serving_benchmark_end_to_end_on_cpu(tmp_path):
    config = tmp_path / "tiny-llama.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "out"
    common = [
        "--config",
        str(config),
        "--model-dir",
        str(tmp_path / "model"),
        "--out",
        str(out),
        *SIZES,
    ]
    run_bench([*common, "--parts", "decode,offline,online"])
    # a second call merges its section into the same serving.json
    stdout = run_bench([*common, "--parts", "hf"])
    res = json.loads((out / "serving.json").read_text())

    assert {"meta", "decode", "offline", "online", "hf", "kv", "ratios"} <= set(res)
    assert [c["parts"] for c in res["meta"]["calls"]] == [
        ["decode", "conv", "fixed", "online"],
        ["hf"],
    ]
    assert res["decode"]["tok_s"] > 0 and 0 < res["decode"]["roofline_frac"]

    # Forced lengths: every request got exactly the tokens the sampler asked for.
    conv, fixed = res["offline"]["conv"], res["offline"]["fixed"]
    lengths = sample_lengths(16, 1, **CAPS)
    assert conv["num_requests"] == 16
    assert conv["prompt_tokens"] == sum(p for p, _ in lengths)
    assert conv["output_tokens"] == sum(o for _, o in lengths) == conv["requested_output_tokens"]
    assert conv["all_lengths_as_requested"]
    assert (
        fixed["output_tokens"] == 6 * 20
        and fixed["prompt_tokens"] == 6 * 24
        and fixed["all_lengths_as_requested"]
    )
    for d in (conv, fixed):
        assert _ordered(d["ttft_ms"]) and _ordered(d["itl_ms"])
        assert 0 < d["output_tok_s"] < d["total_tok_s"]
    win = fixed["decode_window"]
    if win["valid"]:
        assert 0 < win["mean_batch"] <= 6 and win["steps"] < 20 and win["step_ms"] > 0

    levels = res["online"]["levels"]
    assert [lvl["concurrency"] for lvl in levels] == [1, 3]
    for lvl in levels:
        assert lvl["requests_finished"] >= 1 and lvl["finished_lengths_as_requested"]
        assert _ordered(lvl["ttft_ms"]) and _ordered(lvl["itl_ms"])
        assert lvl["kv"]["preemptions"] == 0
    # Every prompt is fresh random ids: nothing may be served from the prefix cache, across
    # workloads and levels.
    assert all(d["kv"]["prefix_cache_hit_tokens"] == 0 for d in (conv, fixed, *levels))

    hf = res["hf"]
    hf_lengths = lengths[:5]
    for mode in ("ours", "generate", "generate_batch"):
        assert isinstance(hf[mode], dict), hf[mode]
        assert hf[mode]["output_tokens"] == sum(o for _, o in hf_lengths), mode
        assert hf[mode]["all_lengths_as_requested"] and _ordered(hf[mode]["ttft_ms"])
    assert res["ratios"]["conv_subset_output_tok_s"] > 0 and res["ratios"]["decode_b1_tok_s"] > 0

    kv = next(iter(res["kv"].values()))
    assert kv["num_kv_blocks"] == 128 and 0 < kv["peak_used_blocks"] <= 128

    png = (out / "serving.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    # the table comes last, merged
    assert "offline conv x16" in stdout and "HF generate_batch" in stdout

    # --merge combines result files written elsewhere without running anything.
    merged_dir = tmp_path / "merged"
    run_bench(["--merge", str(out / "serving.json"), "--out", str(merged_dir)])
    again = json.loads((merged_dir / "serving.json").read_text())
    assert (
        again["offline"] == res["offline"]
        and again["hf"] == res["hf"]
        and (merged_dir / "serving.png").exists()
    )
