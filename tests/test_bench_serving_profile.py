"""bench.serving_profile's tables on CPU: kernels grouped by the kind of step that launched them,
from a chrome trace laid out as torch.profiler exports it (launch events carry the kernel's
correlation id; Triton launches through the driver API, cuBLAS and graph replays through the
runtime), and the step table's shares and FLOP counts."""

from __future__ import annotations

import json

import pytest

from bench.serving_profile import (
    compare,
    kernel_group,
    kernel_table,
    linear_params,
    mixed_step_fit,
    render,
    step_table,
)


def _trace(path, events) -> str:
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_kernels_are_grouped_by_the_step_whose_launch_queued_them(tmp_path):
    host, stream = 11, 7
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "step/mixed",
            "tid": host,
            "ts": 0,
            "dur": 100,
        },
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "step/decode",
            "tid": host,
            "ts": 200,
            "dur": 50,
        },
        # launches inside the mixed step: Triton (driver API) and cuBLAS (runtime)
        {
            "ph": "X",
            "cat": "cuda_driver",
            "name": "cuLaunchKernelEx",
            "tid": host,
            "ts": 10,
            "dur": 2,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "tid": host,
            "ts": 20,
            "dur": 2,
            "args": {"correlation": 2},
        },
        # a graph replay inside the decode step
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaGraphLaunch",
            "tid": host,
            "ts": 210,
            "dur": 2,
            "args": {"correlation": 3},
        },
        # a launch on another thread at the same time belongs to no step
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "tid": 99,
            "ts": 15,
            "dur": 2,
            "args": {"correlation": 4},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "paged_attention_kernel",
            "tid": stream,
            "ts": 30,
            "dur": 40,
            "args": {"correlation": 1, "grid": [2, 8, 24]},  # a prompt launch: 24 query tiles
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "paged_attention_kernel",
            "tid": stream,
            "ts": 175,
            "dur": 10,
            "args": {"correlation": 1, "grid": [60, 32, 1]},  # the mixed step's decode launch
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "nvjet_sm90_tst_224x64_64x5_2x1_v_bz_TNN",
            "tid": stream,
            "ts": 70,
            "dur": 100,
            "args": {"correlation": 2},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "_rms_norm_kernel",
            "tid": stream,
            "ts": 215,
            "dur": 5,
            "args": {"correlation": 3},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "paged_attention_kernel",
            "tid": stream,
            "ts": 220,
            "dur": 20,
            "args": {"correlation": 3, "grid": [64, 24, 1]},
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "tid": stream,
            "ts": 241,
            "dur": 4,
            "args": {"correlation": 4},
        },
    ]
    out = kernel_table(_trace(tmp_path / "trace.json", events))
    seconds = {(r["kind"], r["group"]): r["s"] for r in out["by_kind_group"]}
    assert seconds == pytest.approx(
        {
            ("mixed", "attention"): 50e-6,
            ("mixed", "linears (cuBLAS)"): 100e-6,
            ("decode", "norm + activation"): 5e-6,
            ("decode", "attention"): 20e-6,
            ("outside steps", "copies"): 4e-6,
        }
    )
    assert out["span_s"] == pytest.approx(215e-6)
    assert out["top_kernels"][0]["name"].startswith("nvjet")
    assert out["steps"] == {"mixed": 1, "decode": 1}
    launches = {
        (r["kind"], r["launch"]): (r["s"], r["launches"]) for r in out["attention_launches"]
    }
    assert launches == {
        ("mixed", "query tiles"): (pytest.approx(40e-6), 1),
        ("mixed", "one query tile"): (pytest.approx(10e-6), 1),
        ("decode", "one query tile"): (pytest.approx(20e-6), 1),
    }
    assert "0.05 ms/step" in render(
        {
            "concurrency": 64,
            "serving": {"output_tok_s": 1.0},
            "window_s": 1.0,
            "steps": {},
            "kernels": out,
        }
    )


def test_kernel_names_fall_in_their_groups():
    assert kernel_group("_skinny_gemm_kernel") == "linears (Triton)"
    assert kernel_group("_row_gemv_kernel") == "linears (Triton)"
    assert kernel_group("sm90_xmma_gemm_bf16bf16_bf16f32") == "linears (cuBLAS)"
    assert kernel_group("merge_splits_kernel") == "attention"
    assert kernel_group("_rope_kernel") == "kv write + rope"
    assert kernel_group("void at::native::vectorized_elementwise_kernel") == "other torch ops"


def test_the_step_table_shares_and_flops():
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    layers, lm_head = linear_params(config)
    # per layer: qkv 64 x (4 + 2 x 2) x 16, o 64 x 64, gate_up + down 3 x 64 x 128
    assert layers == 2 * (64 * 8 * 16 + 64 * 64 + 3 * 64 * 128) and lm_head == 6400
    steps = [
        {
            "kind": "decode",
            "rows": 4,
            "decode_rows": 4,
            "prefill_tokens": 0,
            "pairs": 40,
            "host_s": 0.001,
            "device_s": 0.01,
            "gap_before_s": 0.0,
        },
        {
            "kind": "mixed",
            "rows": 3,
            "decode_rows": 2,
            "prefill_tokens": 30,
            "pairs": 500,
            "host_s": 0.02,
            "device_s": 0.03,
            "gap_before_s": 0.001,
        },
        {
            "kind": "decode",
            "rows": 4,
            "decode_rows": 4,
            "prefill_tokens": 0,
            "pairs": 44,
            "host_s": 0.001,
            "device_s": 0.01,
            "gap_before_s": 0.002,
        },
    ]
    table = step_table(steps, 0.1, config)
    assert set(table) == {"decode", "mixed"}
    assert table["decode"]["steps"] == 2 and table["decode"]["device_share"] == pytest.approx(0.2)
    assert table["decode"]["gap_s"] == pytest.approx(0.002)
    assert table["mixed"]["mean_prefill_tokens"] == 30
    assert table["mixed"]["linear_TFLOP"] == pytest.approx(2 * layers * 32 / 1e12)
    assert table["mixed"]["attention_TFLOP"] == pytest.approx(4 * 500 * 4 * 16 * 2 / 1e12)


def test_compare_fits_mixed_step_time_against_prompt_tokens(tmp_path):
    def result(path, rate, points):
        samples = [{"kind": "decode", "prefill_tokens": 0, "device_s": 0.011}] + [
            {"kind": "mixed", "prefill_tokens": t, "device_s": ms / 1e3} for t, ms in points
        ]
        path.write_text(json.dumps({"serving": {"output_tok_s": rate}, "step_samples": samples}))
        return str(path)

    # base: 12 ms + 25 ms per 1000 tokens; new: 10 ms + 25 ms per 1000, over two files
    a = result(tmp_path / "a.json", 3000.0, [(1000, 37.0), (2000, 62.0)])
    b = result(tmp_path / "b.json", 3100.0, [(1000, 35.0)])
    c = result(tmp_path / "c.json", 3050.0, [(3000, 85.0)])
    fit = mixed_step_fit([b, c])
    assert fit["mixed_steps"] == 2 and fit["output_tok_s"] == [3100.0, 3050.0]
    assert fit["ms"] == pytest.approx(10.0) and fit["ms_per_token"] == pytest.approx(0.025)
    table = compare([f"base={a}", f"new={b},{c}"], 1600)
    assert "base | 2 | 12.0 + 25.00 per 1000 | 52.0 ms | 3000" in table
    assert "new | 2 | 10.0 + 25.00 per 1000 | 50.0 ms | 3100, 3050" in table
