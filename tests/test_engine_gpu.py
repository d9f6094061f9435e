"""GPU checks of the engine's own device path (run with `make gpu-check`): KV sizing from free
memory, and batched greedy decoding on a Llama-3.2-1B-shaped random bf16 checkpoint.
"""

from __future__ import annotations

import gc

import pytest
import torch

from bench.checkpoint import synthesize
from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return synthesize(
        "llama-3.2-1b.json", str(tmp_path_factory.mktemp("ckpt") / "llama-1b"), device="cuda"
    )


def test_kv_cache_takes_what_gpu_memory_utilization_leaves(llama_1b):
    torch.cuda.empty_cache()
    llm = LLM(
        model=llama_1b,
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        gpu_memory_utilization=0.5,
    )
    free, total = torch.cuda.mem_get_info()
    used = total - free
    assert llm.engine.num_kv_blocks > 1000
    assert 0.35 * total < used <= 0.5 * total + (1 << 30), (used / total, llm.engine.num_kv_blocks)
    prompts = [list(range(100 + i, 228 + i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_kv_blocks
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()


def test_bf16_prompt_logprobs_close_to_hf(llama_1b):
    from transformers import AutoModelForCausalLM

    llm = LLM(
        model=llama_1b,
        dtype="bfloat16",
        device="cuda",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
    )
    prompt = list(range(1000, 1100))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[
        0
    ]
    hf = AutoModelForCausalLM.from_pretrained(llama_1b, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0].float(), dim=-1)
    diffs = [
        abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item())
        for i in range(1, 100)
    ]
    assert max(diffs) < 0.1, max(diffs)  # bf16 rounding only
