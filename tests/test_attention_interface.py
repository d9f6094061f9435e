"""The attention-backend interface declared once (engine.attention.AttentionBackend): both backends
implement it with its exact forward signature, and the torch reference honours `kv_written` (the
caller stored this step's K/V) by attending over the cache without writing it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionBackend, kv_cache_shape, select_backend
from engine.attention.torch_ref import TorchAttentionBackend, write_kv
from tiny_models import host_metadata

ATTENTION = Path(__file__).resolve().parent.parent / "engine" / "attention"
BACKENDS = {"torch_ref.py": "TorchAttentionBackend", "triton_attn.py": "TritonAttentionBackend"}


def forward_params(func_args: ast.arguments) -> list[tuple[str, str | None]]:
    """(name, default source) of each parameter, in order."""
    names = [a.arg for a in func_args.args]
    defaults = [None] * (len(names) - len(func_args.defaults))
    defaults += [ast.unparse(d) for d in func_args.defaults]
    return list(zip(names, defaults))


def interface_forward() -> list[tuple[str, str | None]]:
    sig = inspect.signature(AttentionBackend.forward)
    return [
        (name, None if p.default is inspect.Parameter.empty else repr(p.default))
        for name, p in sig.parameters.items()
    ]


@pytest.mark.parametrize("module,cls", sorted(BACKENDS.items()))
def test_each_backend_subclasses_the_interface_with_its_forward_signature(module, cls):
    # Read from the source: the triton backend's module needs triton to import.
    tree = ast.parse((ATTENTION / module).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    assert [ast.unparse(b) for b in node.bases] == ["AttentionBackend"]
    forward = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert forward_params(forward.args) == interface_forward()
    name = next(
        n
        for n in node.body
        if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["name"]
    )
    assert ast.literal_eval(name.value) in ("torch", "triton")


def test_select_backend_returns_the_interface_and_a_backend_must_define_forward():
    backend = select_backend("cpu")
    assert isinstance(backend, AttentionBackend) and isinstance(backend, TorchAttentionBackend)
    assert not backend.supports_cuda_graphs and not backend.accepts_written_kv

    class NoForward(AttentionBackend):
        name = "none"

    with pytest.raises(TypeError, match="forward"):
        NoForward()


def test_the_reference_with_kv_written_reads_the_cache_and_leaves_it_alone():
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, group, head_dim, block_size = 2, 2, 16, 4
    seq_lens, query_lens, tables = [6, 3], [2, 3], [[3, 0], [1]]
    starts = [0, 2, 5]
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, s, n in zip(tables, seq_lens, query_lens)
        for p in range(s - n, s)
    ]
    meta = host_metadata(slots, starts, seq_lens, tables, block_size)
    cache = torch.randn(kv_cache_shape(1, 4, block_size, num_kv_heads, head_dim), generator=gen)[0]
    q = torch.randn(5, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    backend, scale = TorchAttentionBackend(), head_dim**-0.5

    written = cache.clone()
    expected = backend.forward(q, k, v, written, meta, scale)  # writes k, v itself

    stored = cache.clone()
    write_kv(k, v, stored, meta.slot_mapping)  # the caller stores them, then passes shapes only
    before = stored.clone()
    out = backend.forward(
        q, torch.zeros_like(k), torch.zeros_like(v), stored, meta, scale, kv_written=True
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(stored, before, rtol=0, atol=0)
    torch.testing.assert_close(stored, written, rtol=0, atol=0)
