"""bench.serving_bound's arithmetic on stored H100 serving runs (bench/results): the load each run
carried, and the bound's terms."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bench.checkpoint import CONFIGS
from bench.serving_bound import bound, load_of
from bench.serving_profile import linear_params

RUNS = (
    Path(__file__).resolve().parent.parent
    / "bench/results/2026-11-27-h100-decode-splits-fp8-kv/serving/0934-medians"
)
CONFIG = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())


def _load(name: str):
    return load_of(json.loads((RUNS / name / "serving_profile.json").read_text()))


def test_load_read_off_a_run():
    bf16, fp8 = _load("bf16-b1024-1"), _load("fp8kv-b1024-1")
    assert (bf16.fp8_weights, bf16.fp8_kv, fp8.fp8_weights, fp8.fp8_kv) == (
        False,
        False,
        True,
        True,
    )
    for load in (bf16, fp8):
        assert 5 < load.prompt_per_decode_row < 8  # the conv trace: about 6 prompt tokens each
        assert 1000 < load.mean_context < 1600
        assert 55 < load.decode_rows_per_step < 64  # 64 clients, a few between requests
        assert 0.9 < load.output_per_decode_row < 1.1


def test_bound_terms():
    load = _load("bf16-b1024-1")
    terms = bound(load, CONFIG, copy_bw=3.0e12, gemm_flop_s=790e12)
    # the measured rate sits under its bound at this H100's ceilings
    assert 0.5 < terms["measured_of_bound"] < 1
    layer_params, _ = linear_params(CONFIG)
    assert terms["prompt_us_per_row"] == pytest.approx(
        load.prompt_per_decode_row * 2 * layer_params / 790e12 * 1e6
    )
    # FP8 linears read one byte per parameter; an FP8 cache half the KV
    fp8w = bound(dataclasses.replace(load, fp8_weights=True), CONFIG, 3.0e12, 790e12)
    assert terms["decode_us_per_row"] - fp8w["decode_us_per_row"] == pytest.approx(
        layer_params / load.decode_rows_per_step / 3.0e12 * 1e6
    )
    fp8kv = bound(dataclasses.replace(load, fp8_kv=True), CONFIG, 3.0e12, 790e12)
    kv_us = terms["decode_us_per_row"] - fp8kv["decode_us_per_row"]
    assert kv_us == pytest.approx(load.mean_context * 32 * 8 * 128 * 2 * 2 / 2 / 3.0e12 * 1e6)
    # a faster GEMM only shortens the prompt term
    fast = bound(load, CONFIG, 3.0e12, 2 * 790e12)
    assert fast["prompt_us_per_row"] == pytest.approx(terms["prompt_us_per_row"] / 2)
    assert fast["decode_us_per_row"] == terms["decode_us_per_row"]


def test_fixed_lengths_load_bound_and_read_ceiling(tmp_path):
    """`--fixed` on the H200 ceilings stored with the 70B FP8 run: the load of 64 clients at
    1,000 / 1,000 tokens, the bound (prompts as steps of their own) below the read ceiling (prompts
    inside the decode steps' reads), and the ceiling under what the weights' read alone allows."""
    from bench.roofline import model_bytes
    from bench.serving_bound import fixed_load, main

    stored = (
        Path(__file__).resolve().parent.parent
        / "bench/results/2026-11-27-h200-70b-fp8/serving_bound.json"
    )
    out = tmp_path / "bound.json"
    argv = ["--fixed", "1000:1000:64", "--config", "llama-3.1-70b.json", "--scheme", "fp8kv"]
    main([*argv, "--ceilings", str(stored), "--out", str(out)])
    got = json.loads(out.read_text())
    load = fixed_load(1000, 1000, 64, True, True)
    assert got["load"] == dataclasses.asdict(load)
    assert load.mean_context == 1500 and load.decode_rows_per_step == 64
    assert load.output_per_decode_row == pytest.approx(1000 / 999)
    assert got["bound_output_tok_s"] < got["ceiling_output_tok_s"]
    config = json.loads((CONFIGS / "llama-3.1-70b.json").read_text())
    layer_params, _ = linear_params(config)
    fp8_weights = model_bytes(config, torch.bfloat16).decode_weights - layer_params
    weights_only = 64 * (1000 / 999) / (fp8_weights / got["copy_bandwidth"])
    assert got["ceiling_output_tok_s"] < weights_only
    assert got["step_read_ms"] > got["step_compute_ms"]  # this load is bound by its reads
    with pytest.raises(SystemExit, match="OUTPUT >= 2"):
        main(["--fixed", "1000:1:64", "--ceilings", str(stored), "--out", str(out)])
    # the --fixed settings are refused by name where they would be ignored
    run = str(RUNS / "bf16-b1024-1" / "serving_profile.json")
    with pytest.raises(SystemExit, match="--scheme: only with --fixed"):
        main([run, "--scheme", "fp8kv", "--out", str(out)])
    with pytest.raises(SystemExit, match="--rows: with --ceilings nothing is timed"):
        main([*argv, "--ceilings", str(stored), "--rows", "512", "--out", str(out)])
    with pytest.raises(SystemExit, match="not both"):
        main([run, *argv, "--out", str(out)])
