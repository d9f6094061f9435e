"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): config checks before download, the
real configs' sizes, HF parity under a skewed router, prefix-cache hits through the engine, the pack
round trip; the fused Triton kernels against the torch reference (interpreter on CPU, compiled on
GPU).

The logit parity of every tiny MoE family (prefill, 16 decodes, chunked prefill, the whole engine)
is in test_model_parity.py and test_engine_parity.py, which run every family of tiny_models.py.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from child_process import run_in_triton_interpreter, run_with_triton_cache
from conftest import triton_nvidia_backend
from engine.config import ModelConfig
from engine.distributed.sharding import Shard
from engine.layers.experts import experts_reference
from engine.layers.moe import SparseMoeBlock, route_reference
from engine.model_support import check_model_config
from engine.models import build_model, load_model
from test_model_parity import prefill_then_decode
from tiny_models import FAMILIES, hf_config, hf_logits, make_tiny_model

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "bench" / "configs"
BOUND = 1e-4
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _hf_dict(family: str, **extra) -> dict:
    cfg = hf_config(family, **extra).to_dict()
    cfg["architectures"] = [FAMILIES[family][0]]
    return cfg


# ---- config checks, before any weight moves ------------------------------------------------------
@pytest.mark.parametrize(
    "family,edit,field",
    [
        ("qwen3-moe", dict(hidden_act="gelu"), "hidden_act"),
        ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok"),
        ("qwen3-moe", dict(mlp_only_layers=[0, 7]), "mlp_only_layers"),
        ("qwen2-moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
        ("qwen3-moe", dict(use_sliding_window=True), "use_sliding_window"),
        ("qwen2-moe", dict(moe_intermediate_size=None, num_experts=-1), "num_experts"),
        ("qwen2-moe", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ],
)
def test_unrunnable_moe_config_is_refused_naming_the_field(family, edit, field):
    cfg = {**_hf_dict(family), **edit}
    with pytest.raises(ValueError, match=rf"^{field}: "):
        check_model_config(cfg)


def test_both_spellings_of_the_expert_count_read_the_same():
    """transformers 5 saves Qwen3-MoE's num_experts as num_local_experts; Hub configs say
    num_experts."""
    saved = _hf_dict("qwen3-moe")
    assert "num_local_experts" in saved and "num_experts" not in saved
    hub = {k: v for k, v in saved.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ModelConfig.from_dict(saved).moe == ModelConfig.from_dict(hub).moe
    assert ModelConfig.from_dict(hub).moe.num_experts == 8


def test_dense_layers_follow_sparse_step_and_mlp_only_layers():
    cfg = _hf_dict("qwen3-moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    moe = ModelConfig.from_dict(cfg).moe
    assert moe.dense_layers == (0, 2, 3, 4)
    model = build_model(ModelConfig.from_dict(cfg), torch.float32, "meta")
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    assert kinds == [False, True, False, False, False, True]


@pytest.mark.parametrize(
    "name,billions,experts,top_k",
    [
        ("qwen3-30b-a3b", 30.53, 128, 8),
        ("mixtral-8x7b", 46.70, 8, 2),
        ("qwen1.5-moe-a2.7b", 14.32, 60, 4),
    ],
)
def test_bench_configs_have_the_published_sizes(name, billions, experts, top_k):
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / f"{name}.json").read_text()))
    model = build_model(cfg, torch.bfloat16, "meta")
    params = sum(p.numel() for p in model.parameters())
    assert abs(params / 1e9 - billions) < 0.01
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (experts, top_k)
    gate_up = model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.shape == (experts, 2 * cfg.moe.expert_intermediate_size, cfg.hidden_size)


def test_bench_counts_the_published_active_parameters_per_token():
    """Qwen3-30B-A3B activates 3.3B parameters per token (its model card); a batch-1 decode step
    reads all of them but the embedding table, which is only gathered, plus the KV cache."""
    from bench.moe_decode import bytes_per_token

    cfg = ModelConfig.from_dict(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()))
    read = bytes_per_token(build_model(cfg, torch.bfloat16, "meta"), context=100)
    active = (read["dense"] + read["experts_selected"]) / 2 + cfg.vocab_size * cfg.hidden_size
    assert abs(active / 1e9 - 3.35) < 0.05
    assert read["experts_selected"] * cfg.moe.num_experts == read["experts_all"] * cfg.moe.top_k
    assert read["kv"] == 100 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def test_tensor_parallel_is_refused_for_moe():
    cfg = ModelConfig.from_dict(_hf_dict("mixtral"))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 2: mixture-of-experts"):
        Shard(0, 2).check(cfg)


# ---- parity with transformers --------------------------------------------------------------------
def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_skewed_router_matches_hf_and_loads_experts_unevenly(tmp_path):
    """Router rows of two experts pointed along the tokens' mean hidden state: most tokens pick
    them, the other experts share what is left."""
    hf = make_tiny_model("qwen3-moe", str(tmp_path))
    toks = _tokens(36, seed=4)
    router = hf.model.layers[0].mlp.gate
    seen = []
    hook = hf.model.layers[0].mlp.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    hf_logits(hf, toks)
    hook.remove()
    mean = seen[0].reshape(-1, seen[0].shape[-1]).mean(0)
    with torch.no_grad():
        router.weight[:2] += 4.0 * mean / mean.norm() ** 2
    hf.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_dir(str(tmp_path))
    model = load_model(str(tmp_path), cfg, torch.float32, "cpu", load_format="safetensors")
    counts = torch.zeros(cfg.moe.num_experts, dtype=torch.int64)
    block = model.layers[0].mlp
    route = block.route

    def counting_route(x):
        weights, ids = route(x)
        counts.add_(torch.bincount(ids.reshape(-1), minlength=cfg.moe.num_experts))
        return weights, ids

    block.route = counting_route

    ours = prefill_then_decode(model, cfg, toks)
    assert (ours - hf_logits(hf, toks)).abs().max().item() < BOUND
    assert counts.sum() == 36 * cfg.moe.top_k
    assert counts[:2].sum() > counts.sum() // 2  # the two hot experts take most of the load
    assert counts.max() >= 4 * counts[2:].min()


def test_prefix_cache_hits_match_hf(tmp_path):
    """A second prompt sharing 24 tokens with the first reuses its cached blocks; logprobs still
    match HF."""
    from engine import LLM, SamplingParams

    hf = make_tiny_model("qwen2-moe", str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    shared = _tokens(24, seed=5)
    # (prompt_logprobs would recompute the whole prompt: no cache hit)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    first = llm.generate([shared + _tokens(5, seed=6)], params)[0]
    second_prompt = shared + _tokens(7, seed=7)
    second = llm.generate([second_prompt], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 20
    ref = torch.log_softmax(hf_logits(hf, second_prompt + second.outputs[0].token_ids), dim=-1)
    for s, (token, logprobs) in enumerate(
        zip(second.outputs[0].token_ids, second.outputs[0].logprobs)
    ):
        row = ref[len(second_prompt) - 1 + s]
        assert row[token].item() >= row.max().item() - BOUND  # greedy took HF's argmax
        for top, lp in logprobs.items():
            assert abs(lp.logprob - row[top].item()) < BOUND


def test_missing_expert_tensor_is_named(tmp_path):
    make_tiny_model("qwen2-moe", str(tmp_path / "m"))
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    # transformers' save_pretrained writes one tensor per expert and projection, as Hub repos do
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in tensors
    assert not any("gate_up_proj" in name for name in tensors)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_dir(str(tmp_path / "m"))
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight \(1"
    ):
        load_model(str(tmp_path / "m"), cfg, torch.float32, "cpu", load_format="safetensors")


def test_pack_round_trip_keeps_stacked_experts(tmp_path):
    make_tiny_model("mixtral", str(tmp_path / "m"))
    path = str(tmp_path / "m")
    cfg = ModelConfig.from_dir(path)
    first = load_model(path, cfg, torch.float32, "cpu", load_format="pack")
    assert first.load_stats["source"] == "safetensors" and first.load_stats["pack_written"]
    again = load_model(path, cfg, torch.float32, "cpu", load_format="pack")
    assert again.load_stats["source"] == "pack"
    ours, theirs = dict(first.named_parameters()), dict(again.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    assert theirs["layers.1.mlp.experts.down_proj"].shape == (4, 64, 48)


# ---- the fused kernels ---------------------------------------------------------------------------
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (CPU torch has none)",
)

# Interpreter scripts: wraps fused_experts' two paths to record which one each call took.
_RECORD_PATHS = """
import engine.layers.fused_moe as fm
import engine.layers.fused_moe_decode as fd
taken = []
def _recording(name):
    inner = getattr(fm, name)
    def call(*args, **kwargs):
        taken.append(name)
        return inner(*args, **kwargs)
    return call
for _name in ("decode_experts", "_sorted_experts"):
    setattr(fm, _name, _recording(_name))
"""


@needs_triton
def test_fused_moe_under_the_triton_interpreter_matches_torch():
    """Router top-k, both sorts by expert, the sorted path's GEMMs (forced at decode sizes, chosen
    past DECODE_MAX_TOKENS), on CPU in float32 under TRITON_INTERPRET."""
    script = _RECORD_PATHS + textwrap.dedent("""
        import torch
        from engine.layers.experts import experts_reference
        from engine.layers.moe import route_reference
        torch.manual_seed(0)
        big = fd.DECODE_MAX_TOKENS + 1
        for t, e, k, h, i, renorm, tiles in [
            (5, 8, 2, 32, 48, True, fm.moe_tiles(5, 8, 2)),
            (3, 16, 8, 40, 24, False, fm.MoeTiles(16, (16, 16), (16, 32), 4, 2)),
            (9, 4, 1, 64, 32, False, fm.moe_tiles(9, 4, 1)),
            (big, 8, 2, 32, 24, True, None),
        ]:
            x, logits = torch.randn(t, h), torch.randn(t, e)
            w_ref, i_ref = route_reference(logits, k, renorm)
            w, ids = fm.route_topk(logits, k, renorm)
            assert torch.equal(ids.long(), i_ref), (ids, i_ref)
            torch.testing.assert_close(w, w_ref)
            gu, dn = 0.2 * torch.randn(e, 2 * i, h), 0.2 * torch.randn(e, h, i)
            ref = experts_reference(x, gu, dn, w_ref, i_ref)
            for one_program in (True, False):
                fm.ONE_PROGRAM_PAIRS = 1 << 20 if one_program else 0
                out = fm.fused_experts(x, gu, dn, w, ids, tiles=tiles)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert set(taken) == {"_sorted_experts"}, taken
        # every pair to one expert; the two sorts agree on the blocks in use
        for ids in (torch.full((37,), 3, dtype=torch.int32), torch.randint(0, 8, (50,)).int()):
            a = fm.align_by_expert(ids, 8, 16, one_program=True)
            b = fm.align_by_expert(ids, 8, 16, one_program=False)
            used = int((a[1] < 8).sum()) * 16
            assert torch.equal(a[1], b[1]) and torch.equal(a[0][:used], b[0][:used])
            real = a[0][:used][a[0][:used] < ids.numel()]
            assert sorted(real.tolist()) == list(range(ids.numel()))
            assert torch.equal(ids[real.long()], ids[real.long()].sort().values)
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_triton
def test_decode_path_under_the_triton_interpreter_matches_torch():
    """The decode path (no sort, no reduction) at T 1 and 3, top_k 1, 2, 3, 8: float32 against
    the reference, with the default tiles (whose columns and K run past the shapes: masks) and
    with tiles that loop over K; then bfloat16 against the sorted path's rounding steps, each
    rounding done by the interpreter itself (which may truncate where a GPU rounds)."""
    script = _RECORD_PATHS + textwrap.dedent("""
        import torch
        import triton
        import triton.language as tl
        from engine.layers.experts import experts_reference

        @triton.jit
        def through_bf16_kernel(src, dst, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(src + offs, mask=offs < n)
            tl.store(dst + offs, v.to(tl.bfloat16).to(tl.float32), mask=offs < n)

        def through_bf16(v):
            v = v.float().contiguous()
            out = torch.empty_like(v)
            through_bf16_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
            return out

        def sorted_path_rounding(x, gu, dn, w, ids):
            # the sorted path in bfloat16: gate_up out, h, each expert's down out and its
            # weighted copy rounded, the sum over slots in float32, rounded once
            i, ids = gu.shape[1] // 2, ids.long()
            g = through_bf16(torch.einsum("tkoh,th->tko", gu[ids].float(), x.float()))
            gate, up = g[..., :i], g[..., i:]
            h = through_bf16(gate / (1 + torch.exp(-gate)) * up)
            y = through_bf16(torch.einsum("tkoi,tki->tko", dn[ids].float(), h))
            return through_bf16(through_bf16(y * through_bf16(w)[..., None]).sum(1))

        torch.manual_seed(0)
        looping = fd.DecodeTiles(fd.GemvTile(8, 16, 4), fd.GemvTile(2, 16, 4))
        h, i = 40, 24
        for t, e, k, tiles in [(1, 8, 1, None), (1, 16, 2, None), (1, 16, 8, None),
                               (3, 8, 1, None), (3, 12, 2, None), (3, 16, 8, None),
                               (1, 8, 1, looping), (3, 16, 8, looping), (3, 10, 3, looping)]:
            x, (w, ids) = torch.randn(t, h), fm.route_topk(torch.randn(t, e), k, True)
            gu, dn = 0.2 * torch.randn(e, 2 * i, h), 0.2 * torch.randn(e, h, i)
            out = fm.fused_experts(x, gu, dn, w, ids, tiles=tiles)
            ref = experts_reference(x, gu, dn, w, ids.long())
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert fd.uses_decode_path(fd.DECODE_MAX_TOKENS) and set(taken) == {"decode_experts"}

        for t, e, k in [(1, 8, 8), (3, 16, 8), (2, 12, 2)]:
            x, (w, ids) = torch.randn(t, 64).bfloat16(), fm.route_topk(torch.randn(t, e), k, True)
            gu = (0.2 * torch.randn(e, 64, 64)).bfloat16()
            dn = (0.2 * torch.randn(e, 64, 32)).bfloat16()
            out = fm.fused_experts(x, gu, dn, w, ids)
            assert out.dtype == torch.bfloat16
            out, expected = out.float(), sorted_path_rounding(x, gu, dn, w, ids)
            assert (out == expected).float().mean() > 0.95, (out - expected).abs().max()
            scale = expected.abs().max().item()
            torch.testing.assert_close(out, expected, atol=1e-2 * scale, rtol=1e-2)
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_triton
def test_routing_inside_the_gate_up_kernel_matches_the_separate_kernels():
    """routed_experts (the router's top-k, and optionally the RMSNorm, inside the decode path's
    gate_up kernel) against the torch reference of norm, route and experts, in float32 under
    TRITON_INTERPRET: T 1 and 3, top_k 1, 2, 6 and 8, renormalised or not, tiles that loop over K
    and FP8 experts; the ids and weights it leaves for the down kernel are the router's, and with
    bf16 logits full of ties, equal logits go to the lower expert id first."""
    script = textwrap.dedent("""
        import torch
        import engine.layers.fused_moe_decode as fd
        from engine.layers.experts import experts_reference
        from engine.layers.moe import route_reference
        from engine.layers.norm import RMSNorm
        from engine.quant.fp8_kernels import quantize_rows_reference

        torch.manual_seed(0)
        looping = fd.DecodeTiles(fd.GemvTile(8, 16, 4), fd.GemvTile(2, 16, 4))
        h, i = 40, 24
        norm = RMSNorm(h, 1e-5, torch.float32, "cpu")
        norm.weight.data = torch.rand(h) + 0.5
        cases = [
            (1, 8, 1, False, None, False), (1, 16, 8, True, None, False),
            (3, 12, 2, True, looping, False), (3, 16, 8, False, looping, False),
            (1, 16, 8, True, None, True), (1, 12, 6, False, None, False),
        ]
        for t, e, k, renorm, tiles, fp8 in cases:
            x, logits = 3 * torch.randn(t, h), torch.randn(t, e)
            gu, dn = 0.2 * torch.randn(e, 2 * i, h), 0.2 * torch.randn(e, h, i)
            scales = None
            if fp8:
                (gu, gu_s), (dn, dn_s) = quantize_rows_reference(gu), quantize_rows_reference(dn)
                scales = (gu_s.squeeze(-1).contiguous(), dn_s.squeeze(-1).contiguous())
            w_ref, i_ref = route_reference(logits, k, renorm)
            for normed_inside in (False, True):
                routing = fd.InKernelRouting(
                    logits, renorm, (norm.weight, norm.eps) if normed_inside else None
                )
                source = x if normed_inside else norm.reference(x)
                out = fd.routed_experts(source, gu, dn, routing, k, *(scales or ()), tiles=tiles)
                ref = experts_reference(norm.reference(x), gu, dn, w_ref, i_ref, scales)
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        # what the gate_up kernel leaves for the down kernel: the router's ids and weights
        captured = {}
        down = fd._decode_down_kernel
        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    captured["ids"], captured["route"] = args[4].clone(), args[5].clone()
                    return down[grid](*args, **kwargs)
                return launch
        fd._decode_down_kernel = Spy()
        logits = torch.randn(3, 16)
        fd.routed_experts(torch.randn(3, h), 0.2 * torch.randn(16, 2 * i, h),
                          0.2 * torch.randn(16, h, i), fd.InKernelRouting(logits, True, None), 4)
        w_ref, i_ref = route_reference(logits, 4, True)
        assert torch.equal(captured["ids"].view(3, 4).long(), i_ref)
        torch.testing.assert_close(captured["route"].view(3, 4), w_ref)
        # bf16 logits full of ties (and negative ones): the larger logit first, then the lower id
        # (route_topk's order), weights the float32 softmax of those logits
        tied = torch.randint(-3, 3, (3, 16)).to(torch.bfloat16) / 2
        order = tied.float() - torch.arange(16) * 1e-3
        for renorm in (True, False):
            fd.routed_experts(torch.randn(3, h, dtype=torch.bfloat16),
                              (0.2 * torch.randn(16, 2 * i, h)).to(torch.bfloat16),
                              (0.2 * torch.randn(16, h, i)).to(torch.bfloat16),
                              fd.InKernelRouting(tied, renorm, None), 8)
            ids = order.topk(8).indices
            assert torch.equal(captured["ids"].view(3, 8).long(), ids)
            probs = torch.softmax(tied.float(), dim=-1).gather(1, ids)
            if renorm:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            torch.testing.assert_close(captured["route"].view(3, 8), probs)
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_triton
def test_norms_split_around_the_experts_under_the_triton_interpreter():
    """One decode row, float32 on CPU. The down kernel begins the next norm (NormAfter: out +
    residual, w * it, its programs' sums of squares; Llama's norm and Gemma's (1 + w), tiles that
    loop over K); the gate_up kernel finishes a norm begun before it (InKernelRouting.squares, the
    sums split over any number of programs); then the sparse MLP between two split norms as the
    decoder runs it (o_proj's NormedRow in or not, the next layer's qkv finishing the norm its
    down began) against the layers one after the other. More than one row: the plain pair."""
    script = textwrap.dedent("""
        from types import SimpleNamespace
        import torch
        import engine.layers.fused_moe_decode as fd
        import engine.layers.moe as moe_layer
        import engine.layers.fused_linears as fl
        import engine.layers.row_gemv as rg
        from engine.layers import Linear
        from engine.layers.experts import experts_reference
        from engine.layers.moe import SparseMoeBlock, route_reference
        from engine.layers.norm import OffsetRMSNorm, RMSNorm

        torch.manual_seed(0)
        looping = fd.DecodeTiles(fd.GemvTile(8, 16, 4), fd.GemvTile(2, 16, 4))
        h, i, e = 40, 24, 16
        for k, renorm, tiles in [(8, True, None), (2, False, looping), (1, True, looping)]:
            gu, dn = 0.2 * torch.randn(e, 2 * i, h), 0.2 * torch.randn(e, h, i)
            s, logits, res = 3 * torch.randn(1, h), torch.randn(1, e), torch.randn(1, h)
            norm = RMSNorm(h, 1e-5, torch.float32, "cpu")
            norm.weight.data = torch.rand(h) + 0.5
            w_ref, i_ref = route_reference(logits, k, renorm)
            ref = experts_reference(norm.reference(s), gu, dn, w_ref, i_ref)
            # a norm begun before: the scaled row and its squares in 1, 3 or 5 parts
            for parts in (1, 3, 5):
                squares = torch.stack([c.square().sum() for c in s[0].chunk(parts)])
                routing = fd.InKernelRouting(logits, renorm, (norm.weight, norm.eps), squares)
                out = fd.routed_experts(norm.weight * s, gu, dn, routing, k, tiles=tiles)
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            # the next norm begun by the down kernel
            routing = fd.InKernelRouting(logits, renorm, (norm.weight, norm.eps))
            for after in (RMSNorm(h, 1e-6, torch.float32, "cpu"),
                          OffsetRMSNorm(h, 1e-6, torch.float32, "cpu")):
                after.weight.data = torch.rand(h) + 0.5
                offset = isinstance(after, OffsetRMSNorm)
                row = fd.routed_experts(s, gu, dn, routing, k, tiles=tiles,
                                        norm_after=fd.NormAfter(res, after.weight, offset))
                torch.testing.assert_close(row.summed, ref + res, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(row.squares.sum(), row.summed.square().sum())
                normed = fl.NormedRow(row.scaled, row.squares, row.summed, after)
                torch.testing.assert_close(normed.finish(), after.reference(ref + res),
                                           atol=1e-4, rtol=1e-4)
        try:
            fd.routed_experts(torch.randn(2, h), gu, dn, routing, 2,
                              norm_after=fd.NormAfter(torch.randn(2, h), norm.weight))
        except ValueError as exc:
            assert "1 token" in str(exc)
        else:
            raise AssertionError("two tokens took a norm split over the kernels")

        # the sparse MLP between two split norms, as DecoderLayer runs it
        # the CUDA checks answered yes on CPU
        fl.row_gemv_applies = lambda x: x.dim() == 2 and x.shape[0] == 1
        moe_layer.fused_kernels_available = lambda x: True
        cfg = SimpleNamespace(hidden_size=h, architecture="Qwen3MoeForCausalLM",
                              moe=SimpleNamespace(top_k=4, norm_topk_prob=True, num_experts=e,
                                                  expert_intermediate_size=i,
                                                  shared_expert_intermediate_size=0))
        block = SparseMoeBlock(cfg, torch.float32, "cpu")
        for p in block.parameters():
            p.data.normal_(0.0, 0.3)
        o_proj = Linear(24, h, False, torch.float32, "cpu")
        qkv = Linear(h, 56, False, torch.float32, "cpu")
        for p in (*o_proj.parameters(), *qkv.parameters()):
            p.data.normal_()
        norms = [RMSNorm(h, 1e-5, torch.float32, "cpu") for _ in range(2)]
        for norm in norms:
            norm.weight.data = torch.rand(h) + 0.5
        heads, res = torch.randn(1, 24), torch.randn(1, h)
        s1 = o_proj(heads) + res
        w_ref, i_ref = route_reference(block.gate(norms[0].reference(s1)), 4, True)
        s2 = experts_reference(norms[0].reference(s1), block.experts.gate_up_proj,
                               block.experts.down_proj, w_ref, i_ref) + s1
        for normed_input in (False, True):
            moe_layer.NORMED_INPUT = normed_input
            assert block.takes_normed_row(heads) is normed_input
            if normed_input:
                x, r = fl.linear_add_norm(o_proj, heads, res, norms[0])
                assert isinstance(x, fl.NormedRow) and r is None
            else:
                x, r = fl.one_row_linear(o_proj, heads), res
            out, none = block.norm_forward(norms[0], x, r, norms[1])
            assert isinstance(out, fl.NormedRow) and none is None
            torch.testing.assert_close(out.summed, s2, atol=1e-3, rtol=1e-3)
            y, summed = fl.norm_linear(norms[1], qkv, out, None)
            assert summed is out.summed
            torch.testing.assert_close(y, qkv(norms[1].reference(s2)), atol=1e-3, rtol=1e-3)
        # switched off, or several rows: the experts' output and the stream, as before
        moe_layer.NORM_AFTER = False
        out, stream = block.norm_forward(norms[0], heads @ o_proj.weight.t(), res, norms[1])
        assert not isinstance(out, fl.NormedRow)
        torch.testing.assert_close(out + stream, s2, atol=1e-3, rtol=1e-3)
        moe_layer.NORM_AFTER = True
        rows, rows_res = torch.randn(3, h), torch.randn(3, h)
        out, stream = block.norm_forward(norms[0], rows, rows_res, norms[1])
        assert not isinstance(out, fl.NormedRow)
        torch.testing.assert_close(stream, rows + rows_res)
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_triton
def test_fp8_experts_under_the_triton_interpreter_match_torch():
    """FP8 experts (e4m3 weights, one fp32 scale per expert and output row) through both paths
    of the fused kernels, in float32 under TRITON_INTERPRET: the same as the torch reference on
    the same quantized weights, at decode sizes (decode path, and the sorted path forced) and past
    them."""
    script = _RECORD_PATHS + textwrap.dedent("""
        import torch
        from engine.layers.experts import experts_reference
        from engine.quant.fp8_kernels import quantize_rows_reference

        def quantized(stacked):
            q, scale = quantize_rows_reference(stacked)
            return q, scale.squeeze(-1).contiguous()

        torch.manual_seed(0)
        big = fd.DECODE_MAX_TOKENS + 3
        looping = fd.DecodeTiles(fd.GemvTile(8, 16, 4), fd.GemvTile(2, 16, 4))
        for t, e, k, h, i, tiles in [
            (1, 8, 2, 32, 48, None),
            (3, 16, 8, 40, 24, looping),
            (3, 8, 2, 32, 24, fm.moe_tiles(3, 8, 2)),
            (big, 8, 2, 32, 24, None),
        ]:
            x = torch.randn(t, h)
            w, ids = fm.route_topk(torch.randn(t, e), k, True)
            gu, gu_scale = quantized(0.2 * torch.randn(e, 2 * i, h))
            dn, dn_scale = quantized(0.2 * torch.randn(e, h, i))
            assert gu.dtype == torch.float8_e4m3fn and gu_scale.shape == (e, 2 * i)
            ref = experts_reference(x, gu, dn, w, ids.long(), (gu_scale, dn_scale))
            out = fm.fused_experts(x, gu, dn, w, ids, tiles, gu_scale, dn_scale)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert set(taken) == {"decode_experts", "_sorted_experts"}, taken
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(not triton_nvidia_backend(), reason="triton without its CUDA backend (ptxas)")
def test_fused_moe_kernels_compile_for_hopper(tmp_path):
    """Each kernel compiled ahead of time for sm_90 (no GPU needed): what the interpreter cannot
    catch (types across branches, shared memory, ptxas) fails here, in CI."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import engine.layers.fused_moe as fm
        import engine.layers.fused_moe_decode as fd
        from engine.layers.moe_kernel_math import routing_slots

        def build(fn, signature, constexprs, tiles=None):
            # launched early on Hopper (engine.pdl)
            options = {"launch_pdl": True}
            if tiles:
                options["num_warps"] = tiles.num_warps
                options["num_stages"] = getattr(tiles, "num_stages", 3)
            signature = dict(signature, PDL="constexpr")
            source = ASTSource(fn=fn, signature=signature, constexprs=dict(constexprs, PDL=True))
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared

        i32 = "i32"
        build(
            fm._route_topk_kernel,
            dict(logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i32", num_experts=i32,
                 stride_lm=i32, TOP_K="constexpr", K_P2="constexpr", E_P2="constexpr",
                 RENORMALISE="constexpr"),
            dict(TOP_K=8, K_P2=8, E_P2=128, RENORMALISE=True),
        )
        build(
            fm._moe_align_kernel,
            dict(ids_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32", num_pairs=i32,
                 num_blocks=i32, BLOCK_M="constexpr", E_P2="constexpr", CHUNK="constexpr"),
            dict(BLOCK_M=16, E_P2=128, CHUNK=64),
        )
        # bf16 experts, and FP8 ones (e4m3 weights, fp32 scales per expert and row)
        for w_type in ("*bf16", "*fp8e4nv"):
            fp8 = w_type != "*bf16"
            gemm = dict(a_ptr="*bf16", w_ptr=w_type, ws_ptr="*fp32", c_ptr="*bf16",
                        sorted_ptr="*i32", block_expert_ptr="*i32", route_weights_ptr="*fp32",
                        num_pairs=i32, N=i32, K=i32, num_experts=i32, stride_am=i32,
                        stride_we=i32, stride_wn=i32, stride_se=i32, stride_cm=i32,
                        TOP_K="constexpr", GATE_UP="constexpr", HAS_SCALE="constexpr",
                        BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr",
                        EVEN_K="constexpr", IEEE="constexpr")
            for tiles, gate_up, even in [
                (fm.moe_tiles(1, 128, 8), True, True), (fm.moe_tiles(8192, 128, 8), False, False)
            ]:
                block_n, block_k = tiles.gate_up if gate_up else tiles.down
                build(fm._moe_gemm_kernel, gemm, dict(TOP_K=8, GATE_UP=gate_up, HAS_SCALE=fp8,
                      BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=even,
                      IEEE=False), tiles)
            decode_gate_up = dict(x_ptr="*bf16", w_ptr=w_type, ws_ptr="*fp32", h_ptr="*bf16",
                                  ids_ptr="*i32", route_ptr="*fp32", logits_ptr="*bf16",
                                  g_ptr="*bf16", sq_ptr="*fp32", N=i32, K=i32,
                                  num_experts=i32, n_sq=i32, stride_xm=i32,
                                  stride_we=i32, stride_wn=i32, stride_se=i32, stride_hm=i32,
                                  stride_lm=i32, eps="fp32", TOP_K="constexpr",
                                  HAS_SCALE="constexpr", BLOCK_N="constexpr",
                                  BLOCK_K="constexpr", EVEN_K="constexpr", ROUTE="constexpr",
                                  NORM="constexpr", NORMED="constexpr", SQ_P2="constexpr",
                                  E_P2="constexpr",
                                  RENORMALISE="constexpr", K_P2="constexpr")
            decode_down = dict(h_ptr="*bf16", w_ptr=w_type, ws_ptr="*fp32", out_ptr="*bf16",
                               ids_ptr="*i32", route_weights_ptr="*fp32", res_ptr="*bf16",
                               g_ptr="*bf16", summed_ptr="*bf16", sq_ptr="*fp32", N=i32,
                               K=i32, stride_hm=i32, stride_we=i32, stride_wn=i32,
                               stride_se=i32, stride_om=i32, TOP_K="constexpr",
                               HAS_SCALE="constexpr", K_P2="constexpr", BLOCK_N="constexpr",
                               BLOCK_K="constexpr", EVEN_K="constexpr",
                               NORM_AFTER="constexpr", OFFSET="constexpr")
            # the norms split around the experts: begun before (NORMED) and after (NORM_AFTER)
            for top_k, even, routed, split in [
                (8, True, True, True), (6, False, False, False), (1, True, True, False)
            ]:
                tiles = fd.decode_tiles(top_k)
                route = dict(ROUTE=routed, NORM=routed and not split, NORMED=split,
                             SQ_P2=1024 if split else 1, E_P2=128, RENORMALISE=top_k > 1,
                             K_P2=routing_slots(top_k))
                for kernel, signature, tile, extra in [
                    (fd._decode_gate_up_kernel, decode_gate_up, tiles.gate_up, route),
                    (fd._decode_down_kernel, decode_down, tiles.down,
                     dict(K_P2=triton.next_power_of_2(top_k), NORM_AFTER=split, OFFSET=False)),
                ]:
                    build(kernel, signature, dict(TOP_K=top_k, HAS_SCALE=fp8,
                          BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=even, **extra),
                          tile)
        print("ok")
    """)
    done = run_with_triton_cache(script, tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _routing(m: int, e: int, k: int, spread: str, gen: torch.Generator):
    """Router logits [m, e]: "all" spreads tokens over every expert, "few" sends every token to the
    same k experts (the first ones)."""
    logits = torch.randn(m, e, device="cuda", generator=gen)
    if spread == "few":
        logits[:, :k] += 20.0
    return logits


GPU_CASES = [  # (experts, top_k, tokens): the decode path up to DECODE_MAX_TOKENS, the sorted past
    (8, 2, 1),
    (8, 2, 16),
    (8, 2, 17),
    (8, 2, 8192),
    (8, 1, 37),
    (64, 8, 1),
    (64, 6, 8),
    (64, 6, 512),
    (128, 8, 1),
    (128, 8, 2),
    (128, 8, 4),
    (128, 8, 8),
    (128, 8, 9),
    (128, 8, 16),
    (128, 8, 17),
    (128, 8, 64),
    (128, 8, 1000),
    (128, 8, 8192),
    (60, 4, 3),
    (16, 1, 2),
    (16, 1, 2048),
]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spread", ["all", "few"])
@pytest.mark.parametrize("experts,top_k,tokens", GPU_CASES)
def test_fused_experts_match_torch_reference(experts, top_k, tokens, spread):
    from engine.layers.fused_moe import fused_experts, route_topk

    hidden, inter = 1024, 352  # inter not a multiple of the tiles: masked columns
    gen = torch.Generator(device="cuda").manual_seed(experts * 1000 + top_k * 10 + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    gu = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(
        torch.bfloat16
    )
    dn = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(
        torch.bfloat16
    )
    logits = _routing(tokens, experts, top_k, spread, gen)  # float32: no ties among the top k
    w_ref, i_ref = route_reference(logits, top_k, True)
    w, ids = route_topk(logits, top_k, True)
    assert torch.equal(ids.long().sort(-1).values, i_ref.sort(-1).values)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    out = fused_experts(x, gu, dn, w, ids)
    ref = experts_reference(x.float(), gu.float(), dn.float(), w_ref, i_ref)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "experts,top_k,tokens",
    [(8, 2, 1), (8, 2, 17), (64, 6, 8), (128, 8, 1), (128, 8, 8), (128, 8, 64), (128, 8, 2048)],
)
def test_fp8_experts_match_torch_reference(experts, top_k, tokens):
    """FP8 experts (e4m3, a scale per expert and row) with bf16 activations, both paths, against
    the fp32 product of the same quantized weights."""
    from engine.layers.fused_moe import fused_experts, route_topk
    from engine.quant.fp8_kernels import quantize_rows_reference

    hidden, inter = 1024, 352
    gen = torch.Generator(device="cuda").manual_seed(experts * 1000 + top_k * 10 + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    gu, gu_scale = quantize_rows_reference(
        torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
    )
    dn, dn_scale = quantize_rows_reference(
        torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
    )
    scales = (gu_scale.squeeze(-1).contiguous(), dn_scale.squeeze(-1).contiguous())
    w, ids = route_topk(_routing(tokens, experts, top_k, "all", gen), top_k, True)
    out = fused_experts(x, gu, dn, w, ids, None, *scales)
    ref = experts_reference(x.float(), gu, dn, w, ids.long(), scales)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (64, 6), (8, 2), (16, 1)])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_decode_path_rounds_as_the_sorted_path(experts, top_k, tokens):
    """At decode sizes both paths run (tiles pick the path): the same rounding steps, so they
    differ only where float32 sums in another order round to a neighbouring bf16 value."""
    from engine.layers.fused_moe import fused_experts, moe_tiles, route_topk
    from engine.layers.fused_moe_decode import decode_tiles

    hidden, inter = 1024, 352
    gen = torch.Generator(device="cuda").manual_seed(experts + top_k + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    gu = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(
        torch.bfloat16
    )
    dn = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(
        torch.bfloat16
    )
    w, ids = route_topk(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, True)
    by_decode = fused_experts(x, gu, dn, w, ids, tiles=decode_tiles(top_k))
    by_sort = fused_experts(x, gu, dn, w, ids, tiles=moe_tiles(tokens, experts, top_k))
    scale = by_sort.abs().max().item()
    torch.testing.assert_close(by_decode.float(), by_sort.float(), atol=1e-2 * scale, rtol=1e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (8, 2), (16, 1)])
def test_router_picks_what_torch_picks_up_to_ties(experts, top_k, renormalise):
    """bf16 router logits tie often; where torch and the kernel pick different experts, the picks
    have equal probability, and so the same weights."""
    from engine.layers.fused_moe import route_topk

    gen = torch.Generator(device="cuda").manual_seed(experts + top_k)
    logits = torch.randn(4096, experts, device="cuda", generator=gen).to(torch.bfloat16)
    w_ref, i_ref = route_reference(logits, top_k, renormalise)
    w, ids = route_topk(logits, top_k, renormalise)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    probs = torch.softmax(logits.float(), dim=-1)
    assert (ids.long().sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts
    picked = probs.gather(1, ids.long())
    assert (picked.diff(dim=-1) <= 0).all()  # in descending order
    torch.testing.assert_close(picked, probs.gather(1, i_ref), atol=0, rtol=0)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    same = (ids.long().sort(-1).values == i_ref.sort(-1).values).all(-1)
    assert same.float().mean() > 0.5


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens", [1, 16, 300, 2048])
def test_both_sorts_by_expert_agree_on_gpu(tokens):
    from engine.layers.fused_moe import align_by_expert

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randint(0, 128, (tokens * 8,), device="cuda", generator=gen, dtype=torch.int32)
    for block_m in (16, 64):
        a = align_by_expert(ids, 128, block_m, one_program=True)
        b = align_by_expert(ids, 128, block_m, one_program=False)
        used = int((a[1] < 128).sum()) * block_m
        assert torch.equal(a[1], b[1]) and torch.equal(a[0][:used], b[0][:used])


def _random_block(config: str, seed: int = 0) -> tuple[ModelConfig, SparseMoeBlock]:
    """A sparse MLP of a bench config's shape on the GPU, bf16, N(0, 0.02) weights."""
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / config).read_text()))
    block = SparseMoeBlock(cfg, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for p in block.parameters():
        p.data.normal_(0.0, 0.02, generator=gen)
    return cfg, block


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "config", ["qwen3-30b-a3b.json", "mixtral-8x7b.json", "qwen1.5-moe-a2.7b.json"]
)
@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_moe_block_at_real_shapes_matches_torch_reference(config, tokens):
    """Router, experts (and Qwen2-MoE's shared expert) at the real models' widths, whose tiles
    differ from the small shapes'."""
    cfg, block = _random_block(config, seed=tokens)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        out = block(x)
        weights, ids = block.route(x)  # (bf16 logits tie often: the router is checked apart)
        ref = experts_reference(
            x.float(),
            block.experts.gate_up_proj.float(),
            block.experts.down_proj.float(),
            weights,
            ids,
        )
        if block.shared_expert is not None:
            ref = ref + torch.sigmoid(block.shared_expert_gate(x)).float() * block.shared_expert(x)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * scale, rtol=3e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", ["qwen3-30b-a3b.json", "mixtral-8x7b.json"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_norm_and_router_inside_the_kernels_match_torch_where_no_tie(config, tokens):
    """SparseMoeBlock.norm_forward at decode batches (the top-k inside the experts' gate_up
    kernel; at one row the norm inside the router's and the experts' kernels) against float32
    torch: the norm of x + residual, the router's softmax top-k of the same logits, the experts.
    Tokens whose k-th and (k+1)-th probabilities tie (bf16 logits tie often) may pick either
    expert and are left out; at least 8 tokens are compared."""
    from engine.layers.fused_linears import one_row_norm_linear
    from engine.layers.norm import RMSNorm

    cfg, block = _random_block(config, seed=tokens)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.bfloat16, "cuda")
    compared, seed = 0, 0
    while compared < 8:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        seed += 1
        x, res = (torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen) for _ in "xr")
        x, res = x.to(torch.bfloat16), res.to(torch.bfloat16)
        norm.weight.data = (torch.rand(cfg.hidden_size, device="cuda", generator=gen) + 0.5).to(
            torch.bfloat16
        )
        with torch.inference_mode():
            out, summed = block.norm_forward(norm, x, res)
            if tokens == 1:
                logits = one_row_norm_linear(norm, block.gate, x, res)[0]
            else:
                logits = block.gate(norm(x, res)[0])
        assert torch.equal(summed, x + res)
        s = summed.float()
        normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
        weights, ids = route_reference(logits, block.top_k, block.renormalise)
        picked = ids.unique()  # only these in float32 (all of Mixtral's: 5.6 GB a layer)
        ref = experts_reference(
            normed,
            block.experts.gate_up_proj[picked].float(),
            block.experts.down_proj[picked].float(),
            weights,
            torch.searchsorted(picked, ids),
        )
        probs = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        no_tie = probs[:, block.top_k - 1] > probs[:, block.top_k]
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.float()[no_tie], ref[no_tie], atol=2e-2 * scale, rtol=3e-2)
        compared += int(no_tie.sum())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("normed_input", [False, True])
def test_norms_split_around_the_experts_match_the_plain_block(normed_input, monkeypatch):
    """Qwen3-30B-A3B's shapes, bf16, one decode row: the experts' down kernel begins the next norm
    (and, normed_input, o_proj begins this one): the residual stream equals the plain block's
    output plus its stream bit for bit (without normed_input; within bf16 rounding with it), and
    the norm the down kernel began, finished, matches the next norm of that stream."""
    import engine.layers.fused_linears as fl
    import engine.layers.moe as moe_layer
    from engine.layers.linear import Linear
    from engine.layers.norm import RMSNorm

    cfg, block = _random_block("qwen3-30b-a3b.json", seed=1)
    hidden, dt = cfg.hidden_size, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    # router logits far apart: rounding differences between the paths pick the same experts
    block.gate.weight.data.normal_(0.0, 0.5, generator=gen)
    norms = [RMSNorm(hidden, cfg.rms_norm_eps, dt, "cuda") for _ in range(2)]
    for norm in norms:
        norm.weight.data = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dt)
    o_proj = Linear(4096, hidden, False, dt, "cuda")
    o_proj.weight.data.normal_(0.0, 0.02, generator=gen)
    heads = torch.randn(1, 4096, device="cuda", generator=gen).to(dt)
    res = torch.randn(1, hidden, device="cuda", generator=gen).to(dt)
    monkeypatch.setattr(moe_layer, "NORMED_INPUT", normed_input)
    with torch.inference_mode():
        plain, stream = block.norm_forward(norms[0], fl.one_row_linear(o_proj, heads), res)
        if normed_input:
            x, r = fl.linear_add_norm(o_proj, heads, res, norms[0])
            assert isinstance(x, fl.NormedRow)
        else:
            x, r = fl.one_row_linear(o_proj, heads), res
        row, none = block.norm_forward(norms[0], x, r, norms[1])
        assert isinstance(row, fl.NormedRow) and none is None
        want = plain + stream
        if normed_input:
            scale = want.abs().max().item()
            torch.testing.assert_close(row.summed, want, atol=2e-2 * scale, rtol=3e-2)
        else:
            assert torch.equal(row.summed, want)
        torch.testing.assert_close(
            row.finish().float(), norms[1](row.summed).float(), atol=3e-2, rtol=2e-2
        )


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens", [1, 2048, 8192])
def test_moe_layer_stays_within_its_memory_bound(tokens):
    """The KV cache is sized with engine.memory_budget's bound: the fused layer's peak stays under
    it."""
    from engine.memory_budget import moe_mlp_bytes

    cfg, block = _random_block("qwen3-30b-a3b.json")
    x = torch.randn(tokens, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        block(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= moe_mlp_bytes(cfg, 2, tokens)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens", [1, 256])
def test_moe_block_replays_from_a_cuda_graph(tokens):
    """The decode path reads nothing back to the host (either sort by expert): a captured step
    equals eager."""
    cfg, block = _random_block("qwen3-30b-a3b.json")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        eager = block(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(x)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x)
        x.copy_(torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen))
        graph.replay()
        torch.testing.assert_close(captured, block(x), atol=0, rtol=0)
        assert not torch.equal(captured, eager)
        ref = experts_reference(
            x.float(),
            block.experts.gate_up_proj.float(),
            block.experts.down_proj.float(),
            *block.route(x),
        )
        scale = ref.abs().max().item()
        torch.testing.assert_close(captured.float(), ref, atol=2e-2 * scale, rtol=3e-2)
