"""A step that mixes decodes with prompt chunks: the runner orders its one-token sequences first
(each group keeping its order), and the stager counts them in AttentionMetadata.num_decode_seqs,
which the Triton backend runs apart with its decode tiles (tests/test_attention_triton.py checks
that launch against the reference)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.runner import _decodes_first
from engine.step_inputs import InputStager


@pytest.mark.parametrize(
    "lens,leading",
    [([1, 1, 5, 1], 2), ([1, 1, 1], 3), ([4, 1], 0), ([7], 0), ([1, 3], 1)],
)
def test_the_stager_counts_the_leading_one_token_sequences(lens, leading):
    stager = InputStager(torch.device("cpu"), block_size=4)
    starts = [10 * i for i in range(len(lens))]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(lens))]
    ids = [3] * sum(lens)
    positions = [s + j for s, n in zip(starts, lens) for j in range(n)]
    step = stager.stage(ids, positions, starts, lens, tables)
    assert step.meta.num_decode_seqs == leading
    assert step.meta.max_query_len == max(lens)


def test_graph_padding_rows_count_as_decodes():
    stager = InputStager(torch.device("cpu"), block_size=4)
    step = stager.stage([5, 6], [3, 9], [3, 9], [1, 1], [[0], [1, 2, 3]], pad_to=4)
    assert step.meta.num_decode_seqs == 4


def test_the_runner_puts_decodes_first_and_keeps_each_groups_order():
    def seq(name, n):
        return SimpleNamespace(name=name, num_new_tokens=n)

    mixed = [seq("a", 30), seq("b", 1), seq("c", 1), seq("d", 7), seq("e", 1)]
    assert [s.name for s in _decodes_first(mixed)] == ["b", "c", "e", "a", "d"]
    decodes = [seq("x", 1), seq("y", 1)]
    assert _decodes_first(decodes) is decodes  # a decode step is left as it is
