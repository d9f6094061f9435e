"""The Triton paged attention backend against the torch reference backend, on CUDA (and tiny cases
in the interpreter).

Random ragged batches over shuffled block tables, with never-written cache memory set to NaN so a
stray read shows: decodes (split-KV), prefills, chunks after a cached prefix, mixed steps, sliding
windows, padded rows, CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import math
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from child_process import run_in_triton_interpreter
from engine.attention import AttentionMetadata, RotaryTables, kv_cache_shape, select_backend
from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import RopeConfig
from engine.layers.norm import OffsetRMSNorm, RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, norm_operands
from tiny_models import host_metadata

REPO = Path(__file__).resolve().parent.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton"
)
# Max abs error against the float32 reference on the same (rounded) inputs.
BOUND = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    # [2, blocks, block_size, Hkv, D], the prefix written and everything else NaN
    cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    num_real: int  # sequences before the padded rows


def unpadded(case: Case) -> Case:
    """The same step without its padded rows (one token each, at the end)."""
    n = case.num_real
    t = case.meta.query_start_loc_cpu[n]
    meta = replace(
        case.meta,
        slot_mapping=case.meta.slot_mapping[:t],
        query_start_loc=case.meta.query_start_loc[: n + 1],
        seq_lens=case.meta.seq_lens[:n],
        block_tables=case.meta.block_tables[:n],
        query_start_loc_cpu=case.meta.query_start_loc_cpu[: n + 1],
        seq_lens_cpu=case.meta.seq_lens_cpu[:n],
    )
    return replace(case, q=case.q[:t], k=case.k[:t], v=case.v[:t], meta=meta)


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    padded_rows: int = 0,
) -> Case:
    """A random step: sequence i has seq_lens[i] - query_lens[i] cached tokens and query_lens[i] new
    ones.

    padded_rows extra one-token rows with seq_len 0 and slot -1 follow, as a CUDA-graph batch is
    padded.
    """
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous block ids
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.full(
        kv_cache_shape(1, num_blocks, block_size, num_kv_heads, head_dim), float("nan")
    )[0]
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    slots, starts = [], [0]
    for i, (s, n) in enumerate(zip(seq_lens, query_lens)):
        seq_slots = [tables[i][p // block_size] * block_size + p % block_size for p in range(s)]
        prefix = torch.tensor(seq_slots[: s - n], dtype=torch.long)
        flat[:, prefix] = torch.randn(2, s - n, num_kv_heads, head_dim, generator=gen)
        slots += seq_slots[s - n :]
        starts.append(starts[-1] + n)
    seq_lens = seq_lens + [0] * padded_rows
    slots += [-1] * padded_rows
    for _ in range(padded_rows):
        starts.append(starts[-1] + 1)
        tables.append([])
    num_tokens = starts[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    meta = host_metadata(slots, starts, seq_lens, tables, block_size, device)
    return Case(
        rand(num_tokens, num_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        cache.to(dtype).to(device),
        meta,
        head_dim**-0.5,
        len(query_lens),
    )


def check_tokens_of_no_sequence(backend, dtype: torch.dtype, device: str) -> None:
    """A mixed step with 5 tokens of no sequence after its real ones (slot -1, outside
    query_start_loc: a piecewise graph's padding), written into a given `out`: the real rows and
    the cache as the step without them gives, the other rows of `out` untouched."""
    case = make_case([9, 40, 37, 1, 50], [1, 1, 11, 1, 23], 2, 3, 24, 4, dtype, device)
    t, extra = case.q.shape[0], 5

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(extra, *x.shape[1:]).to(x)])

    meta = replace(
        case.meta,
        slot_mapping=torch.cat([case.meta.slot_mapping, -case.meta.slot_mapping.new_ones(extra)]),
    )
    cache, plain_cache = case.cache.clone(), case.cache.clone()
    q = padded(case.q)
    out = torch.full_like(q, 7.0)
    got = backend.forward(q, padded(case.k), padded(case.v), cache, meta, case.scale, out=out)
    plain = backend.forward(case.q, case.k, case.v, plain_cache, case.meta, case.scale)
    assert got is out
    torch.testing.assert_close(out[:t], plain, rtol=0, atol=0)
    assert torch.equal(out[t:], torch.full_like(out[t:], 7.0))
    torch.testing.assert_close(cache, plain_cache, rtol=0, atol=0, equal_nan=True)


def test_reference_leaves_tokens_of_no_sequence_alone() -> None:
    check_tokens_of_no_sequence(TorchAttentionBackend(), torch.float32, "cpu")


def run_both(case: Case, backend, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output, float32 reference output on the same inputs); also checks both caches end up
    equal.

    The reference runs without the padded rows (it has no notion of them); their expected output is
    zeros.
    """
    cache = case.cache.clone()
    out = backend.forward(
        case.q, case.k, case.v, cache, case.meta, case.scale, sliding_window=window
    )
    real = unpadded(case)
    ref_cache = case.cache.float()
    ref = torch.zeros(case.q.shape, dtype=torch.float32, device=case.q.device)
    ref[: real.q.shape[0]] = TorchAttentionBackend().forward(
        real.q.float(),
        real.k.float(),
        real.v.float(),
        ref_cache,
        real.meta,
        real.scale,
        sliding_window=window,
    )
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(cache.float(), ref_cache, rtol=0, atol=0, equal_nan=True)
    return out.float(), ref


def check_rotated_in_kernel(
    backend, case: Case, norm_class=None, window: int | None = None, seed: int = 0
) -> float:
    """A decode step (case: one query token per sequence) given to the backend unrotated, with the
    RoPE tables (and per-head q/k norms of norm_class): its output against the float32 reference
    over q and k normed (norm_class.reference) and rotated by torch (apply_rotary), its cache
    against the reference's (the rotated K and the V at each token's slot, nothing else written);
    padded rows give zeros. Returns the largest output error."""
    gen = torch.Generator().manual_seed(seed)
    dtype, device, head_dim = case.q.dtype, case.q.device, case.q.shape[2]
    rope = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0), 2048, dtype, device)
    positions = (case.meta.seq_lens.long() - 1).clamp(min=0)  # padded rows (seq_len 0): 0
    q, k, norms = case.q, case.k, {}
    if norm_class is not None:
        q_norm, k_norm = (norm_class(head_dim, 1e-6, dtype, device) for _ in range(2))
        for norm in (q_norm, k_norm):
            norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(norm.weight)
        norms = norm_operands(q_norm, k_norm)
        q, k = q_norm.reference(q), k_norm.reference(k)
    cos, sin = rope.cos[positions], rope.sin[positions]
    real = unpadded(replace(case, q=apply_rotary(q, cos, sin), k=apply_rotary(k, cos, sin)))
    ref_cache = case.cache.float()
    ref = TorchAttentionBackend().forward(
        real.q.float(), real.k.float(), real.v.float(), ref_cache, real.meta, real.scale,
        sliding_window=window,
    )  # fmt: skip
    cache = case.cache.clone()
    tables = RotaryTables(rope.cos, rope.sin, **norms)
    assert backend.rotates_in_kernel(case.q, cache, case.meta)
    out = backend.forward(
        case.q, case.k, case.v, cache, case.meta, case.scale, sliding_window=window, rotary=tables
    ).float()
    exact = dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if exact else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cache.float(), ref_cache, equal_nan=True, **tol)
    n = real.q.shape[0]
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padded rows must be zeros"
    err = (out[:n] - ref).abs().max().item()
    assert err < BOUND[dtype], (dtype, norm_class, window, err)
    return err


def assert_matches(case: Case, backend, window: int | None = None) -> None:
    out, ref = run_both(case, backend, window)
    assert torch.isfinite(out).all()
    err = (out - ref).abs().max().item()
    assert err < BOUND[case.q.dtype], f"max abs error {err} over {BOUND[case.q.dtype]}"


def triton_backend(**kwargs):
    from engine.attention.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend(torch.device("cuda"), **kwargs)


# A mixed step: a decode, a full prefill, a chunk after a cached prefix, a 1-token prompt, a long
# decode, a chunk that crosses many blocks after a long prefix.
MIXED_SEQ_LENS = [9, 77, 300, 1, 530, 700]
MIXED_QUERY_LENS = [1, 77, 45, 1, 1, 260]


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_bf16(head_dim: int, group: int, block_size: int) -> None:
    case = make_case(
        MIXED_SEQ_LENS,
        MIXED_QUERY_LENS,
        2,
        group,
        head_dim,
        block_size,
        torch.bfloat16,
        "cuda",
        seed=head_dim + group + block_size,
    )
    assert_matches(case, triton_backend())


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("num_decodes", [1, 3, 64])
def test_mixed_batch_with_decodes_first(num_decodes: int) -> None:
    """The runner's order: one-token sequences first (their own launch, decode tiles), then prompt
    chunks, one of them after a cached prefix."""
    seq_lens = [700 - 9 * i for i in range(num_decodes)] + [77, 300, 1, 530]
    query_lens = [1] * num_decodes + [77, 45, 1, 260]
    case = make_case(seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16, "cuda", seed=num_decodes)
    assert case.meta.num_decode_seqs == num_decodes
    assert_matches(case, triton_backend())


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (96, 3)])
def test_mixed_batch_other_dtypes(dtype: torch.dtype, head_dim: int, group: int) -> None:
    case = make_case(
        MIXED_SEQ_LENS, MIXED_QUERY_LENS, 2, group, head_dim, 16, dtype, "cuda", seed=head_dim
    )
    assert_matches(case, triton_backend())


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5, 64, 256])
def test_decode_split_kv(dtype: torch.dtype, batch: int) -> None:
    """Decode only: few sequences get many splits each, a big batch none; both must match."""
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 1500 if batch <= 5 else 300, (batch,), generator=gen).tolist()
    case = make_case(seq_lens, [1] * batch, 8, 4, 128, 16, dtype, "cuda", seed=batch)
    assert_matches(case, triton_backend())


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("seed", range(6))
def test_random_prefix_hits(seed: int) -> None:
    """Chunked prefill over cached prefixes of random length, mixed with decodes, random GQA and
    block size."""
    gen = torch.Generator().manual_seed(1000 + seed)
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    seq_lens = torch.randint(1, 900, (batch,), generator=gen).tolist()
    query_lens = [
        int(torch.randint(1, s + 1, (1,), generator=gen)) if seed % 2 or i else 1
        for i, s in enumerate(seq_lens)
    ]
    group = [1, 2, 4, 8][seed % 4]
    block_size = [16, 32][seed % 2]
    case = make_case(
        seq_lens, query_lens, 2, group, 64, block_size, torch.float32, "cuda", seed=seed
    )
    assert_matches(case, triton_backend())


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("window", [1, 7, 64, 200])
@pytest.mark.parametrize("decode_only", [False, True])
def test_sliding_window(window: int, decode_only: bool) -> None:
    query_lens = [1] * len(MIXED_SEQ_LENS) if decode_only else MIXED_QUERY_LENS
    case = make_case(MIXED_SEQ_LENS, query_lens, 2, 4, 128, 16, torch.float32, "cuda", seed=window)
    assert_matches(case, triton_backend(), window=window)


@pytest.mark.gpu
@needs_cuda_triton
def test_padded_decode_rows_give_zeros_and_write_nothing() -> None:
    """Rows of seq_len 0 and slot -1 (a CUDA-graph batch padded up): zeros out, nothing written
    (run_both checks)."""
    for batch in (3, 200):  # with and without split-KV
        seq_lens = torch.randint(
            1, 500, (batch,), generator=torch.Generator().manual_seed(batch)
        ).tolist()
        case = make_case(
            seq_lens, [1] * batch, 8, 4, 128, 16, torch.bfloat16, "cuda", seed=batch, padded_rows=5
        )
        out, ref = run_both(case, triton_backend())
        assert torch.equal(out[batch:], torch.zeros_like(out[batch:]))
        assert (out - ref).abs().max().item() < BOUND[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [None, RMSNorm, OffsetRMSNorm])
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_decode_rotated_in_the_kernel(dtype: torch.dtype, norm, batch: int) -> None:
    """RoPE, the q/k norms and the KV write inside the decode kernel: short contexts (one
    program), long ones (split, the last split writing the key), padded rows, views into qkv."""
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 1500 if batch <= 5 else 300, (batch,), generator=gen).tolist()
    case = make_case(seq_lens, [1] * batch, 4, 8, 128, 16, dtype, "cuda", seed=batch, padded_rows=3)
    fused = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
    q, k, v = fused.split([case.q[0].numel(), case.k[0].numel(), case.v[0].numel()], dim=1)
    case = replace(case, q=q.view(case.q.shape), k=k.view(case.k.shape), v=v.view(case.v.shape))
    for window in (None, 64):
        check_rotated_in_kernel(triton_backend(), case, norm, window, seed=batch)


@pytest.mark.gpu
@needs_cuda_triton
def test_non_contiguous_qkv_views() -> None:
    """q/k/v as the model makes them: views into one fused qkv row."""
    case = make_case(MIXED_SEQ_LENS, MIXED_QUERY_LENS, 2, 4, 64, 16, torch.float32, "cuda", seed=11)
    fused = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
    q, k, v = fused.split([case.q[0].numel(), case.k[0].numel(), case.v[0].numel()], dim=1)
    view_case = replace(
        case, q=q.view(case.q.shape), k=k.view(case.k.shape), v=v.view(case.v.shape)
    )
    assert not view_case.k.is_contiguous()
    assert_matches(view_case, triton_backend())


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_replayed_from_cuda_graph(dtype: torch.dtype) -> None:
    """Capture one decode, then change seq_lens, block tables, slots and q/k/v in place: the replay
    equals eager."""
    backend = triton_backend()
    first = make_case(
        [40, 900, 3, 17], [1] * 4, 8, 4, 128, 16, dtype, "cuda", seed=1, padded_rows=2
    )
    second = make_case(
        [700, 2, 1200, 64], [1] * 4, 8, 4, 128, 16, dtype, "cuda", seed=2, padded_rows=2
    )
    width = max(first.meta.block_tables.shape[1], second.meta.block_tables.shape[1])
    num_blocks = max(first.cache.shape[1], second.cache.shape[1])

    def widen(case: Case) -> Case:  # the same shapes for both steps, as a captured graph needs
        table = torch.zeros(
            (case.meta.block_tables.shape[0], width), dtype=torch.int32, device="cuda"
        )
        table[:, : case.meta.block_tables.shape[1]] = case.meta.block_tables
        cache = torch.full(
            (2, num_blocks, *case.cache.shape[2:]), float("nan"), dtype=dtype, device="cuda"
        )
        cache[:, : case.cache.shape[1]] = case.cache
        return replace(case, cache=cache, meta=replace(case.meta, block_tables=table))

    first, second = widen(first), widen(second)
    static = replace(
        first,
        q=first.q.clone(),
        k=first.k.clone(),
        v=first.v.clone(),
        cache=first.cache.clone(),
        meta=replace(
            first.meta,
            **{
                f: getattr(first.meta, f).clone()
                for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
            },
        ),
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) off the capture
        backend.forward(
            static.q, static.k, static.v, static.cache.clone(), static.meta, static.scale
        )
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(
            static.q, static.k, static.v, static.cache, static.meta, static.scale
        )

    for case in (second, first):
        for name in ("q", "k", "v", "cache"):
            getattr(static, name).copy_(getattr(case, name))
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            getattr(static.meta, name).copy_(getattr(case.meta, name))
        graph.replay()
        eager_cache = case.cache.clone()
        eager = backend.forward(case.q, case.k, case.v, eager_cache, case.meta, case.scale)
        torch.testing.assert_close(graph_out, eager, rtol=0, atol=0)
        torch.testing.assert_close(static.cache, eager_cache, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(graph_out[4:], torch.zeros_like(graph_out[4:]))
        _, ref = run_both(case, backend)
        assert (graph_out.float() - ref).abs().max().item() < BOUND[dtype]


@pytest.mark.gpu
@needs_cuda_triton
def test_auto_picks_triton_on_cuda() -> None:
    assert select_backend("cuda").name == "triton"
    assert select_backend(torch.device("cuda:0"), "torch").name == "torch"


def test_select_backend_on_cpu() -> None:
    assert select_backend("cpu").name == "torch"
    assert select_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="'auto', 'torch', 'triton'"):
        select_backend("cpu", "flash")
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("cpu", "triton")


# run by tests/child_process.run_in_triton_interpreter
INTERPRETER_SCRIPT = """
import torch
from engine.layers.norm import OffsetRMSNorm, RMSNorm
from tests.test_attention_triton import (
    check_rotated_in_kernel, check_tokens_of_no_sequence, make_case, run_both,
)
from engine.attention import triton_attn
from engine.attention.triton_attn import TritonAttentionBackend

# on CPU tensors: 2 'SMs', so decode splits 4-ways here; merged in the attention kernel or by a
# second launch
backends = [
    TritonAttentionBackend(programs_per_sm=16),
    TritonAttentionBackend(programs_per_sm=16, fused_merge=False),
]
worst = 0.0
# a split of at least one key tile (every context of 2+ tiles merges) and of two (shorter ones are
# one program with no merge); fp32's decode tiles hold 32 keys
for (dtype, head_dim), backend, min_tiles in zip(
    ((torch.float32, 24), (torch.float16, 24), (torch.float32, 16), (torch.float32, 24)),
    backends + backends,
    (2, 2, 1, 1),
):
    triton_attn.MIN_SPLIT_TILES = min_tiles
    for seqs, qlens, window in (
        ([9, 40, 1, 70], [1, 1, 1, 1], None),
        ([9, 23, 37, 1, 50], [1, 23, 11, 1, 1], None),
        ([9, 40, 1, 70], [1, 1, 1, 1], 5),
        ([9, 23, 37, 1, 50], [1, 23, 11, 1, 1], 6),
        # decodes first, as the runner orders a mixed step: two launches
        ([9, 40, 37, 1, 50], [1, 1, 11, 1, 23], None),
        ([9, 40, 37, 1, 50], [1, 1, 11, 1, 23], 6),
    ):
        padded_rows = 2 if max(qlens) == 1 else 0
        case = make_case(seqs, qlens, 2, 3, head_dim, 4, dtype, "cpu", padded_rows=padded_rows)
        out, ref = run_both(case, backend, window)
        pad = out[case.meta.query_start_loc_cpu[case.num_real]:]
        assert torch.equal(pad, torch.zeros_like(pad)), "padded rows must be zeros"
        bound = 1e-5 if dtype == torch.float32 else 3e-3
        err = (out - ref).abs().max().item()
        assert err < bound, (dtype, seqs, window, err)
        worst = max(worst, err)
check_tokens_of_no_sequence(backends[0], torch.float32, "cpu")
# decode with RoPE (and q/k norms) inside the attention kernel, split so that the last split
# writes the new key
for backend, dtype, norm, window in (
    (backends[0], torch.float32, RMSNorm, None),
    (backends[1], torch.float32, None, 5),
    (backends[0], torch.float16, OffsetRMSNorm, None),
):
    case = make_case([9, 40, 1, 70], [1] * 4, 2, 3, 24, 4, dtype, "cpu", padded_rows=2)
    worst = max(worst, check_rotated_in_kernel(backend, case, norm, window))
assert backends[0].arrivals is not None and not backends[0].arrivals.any(), (
    "split arrival counts must reset to 0"
)
print("ok", worst)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_in_the_triton_interpreter() -> None:
    """The same kernels, run by triton's CPU interpreter on tiny odd shapes (head_dim 24 and 16,
    group 3, block 4)."""
    done = run_in_triton_interpreter(textwrap.dedent(INTERPRETER_SCRIPT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("ok")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_refuses_what_it_cannot_do() -> None:
    from engine.attention.triton_attn import TritonAttentionBackend

    case = make_case([4], [4], 1, 1, 512, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="head_dim=512"):
        TritonAttentionBackend().forward(case.q, case.k, case.v, case.cache, case.meta, case.scale)
    case = make_case([4], [4], 1, 2, 16, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="sliding_window=0"):
        TritonAttentionBackend().forward(
            case.q, case.k, case.v, case.cache, case.meta, case.scale, sliding_window=0
        )
