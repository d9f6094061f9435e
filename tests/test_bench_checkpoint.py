"""The benchmark checkpoints carry exactly the tensors transformers expects for each real
architecture."""

from __future__ import annotations

import json

import pytest
import torch

from bench.checkpoint import CONFIGS, hf_tensor_shapes


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_tensor_names_and_shapes_match_transformers(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((CONFIGS / name).read_text())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        expected.pop("lm_head.weight")
    assert hf_tensor_shapes(config) == expected
