"""How close a lower-precision engine stays to its full-precision reference on a real model:
perplexity over a fixed text and greedy agreement over fixed prompts, both read through the engine.

Perplexity comes from the engine's own prompt_logprobs; with a small max_num_batched_tokens the text
is prefilled in chunks, so every chunk after the first attends to keys and values read back from the
KV cache (what an FP8 KV cache changes).
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import NamedTuple

from conftest import free_gpu_memory
from engine import LLM, SamplingParams

# A fixed English text: this repo's docs/architecture.md, engine.md, cache.md, cold-start.md and
# api.md as they stood on 2026-11-26 (commit 7d485f2), joined by blank lines (prose, tables and
# code, as users' prompts hold). Frozen here, so a figure measured on it stays reproducible when the
# docs change.
CHUNK = 256  # prefill chunk: every later chunk reads earlier keys and values back from the cache
FIXED_TEXT = Path(__file__).resolve().parent / "fixtures" / "accuracy" / "docs-2026-11-26.md"

GREEDY_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Translate to French: I would like a cup of coffee, please.",
    "List three primary colors:",
    "Explain in one sentence why the sky is blue.",
]


def fixed_text_ids(llm: LLM, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of the fixed text; raises if the text is shorter."""
    ids = llm.get_tokenizer().encode(FIXED_TEXT.read_text())
    if len(ids) < num_tokens:
        raise ValueError(f"the fixed text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    """The engine's log-probability of each of ids[1:] given its prefix."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params)
    return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], ids[1:])]


def engine_prompt_logprobs(model_dir: str, ids: list[int], **engine) -> list[float]:
    """prompt_logprobs from a fresh engine reading `model_dir`'s safetensors (engine: LLM's
    keywords), shut down after and its GPU memory handed back (conftest.free_gpu_memory: a GPU
    engine's KV cache fills the GPU, and the tests after it in the process need room)."""
    llm = LLM(model=model_dir, load_format="safetensors", **engine)
    try:
        return prompt_logprobs(llm, ids)
    finally:
        llm.shutdown()
        del llm
        free_gpu_memory()


def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes, as the engine scores
    them."""
    nll = [-logprob for logprob in prompt_logprobs(llm, ids)]
    return math.exp(sum(nll) / len(nll))


def greedy_tokens(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def forced_agreement(llm: LLM, reference: list[list[int]]) -> list[int]:
    """For each of GREEDY_PROMPTS: of the reference's greedy tokens `reference[i]`, how many `llm`
    also ranks first when fed the prompt and the reference's tokens before it (teacher-forced
    top-1 agreement: one early near-tie does not decide the rest)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [o.prompt_token_ids for o in llm.generate(GREEDY_PROMPTS, params)]
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, reference)], scored)
    counts = []
    for p, r, out in zip(prompts, reference, outs):
        entries = out.prompt_logprobs[len(p) : len(p) + len(r)]
        counts.append(sum(entry[tok].rank == 1 for entry, tok in zip(entries, r)))
    return counts


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy outputs share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Measured(NamedTuple):
    ids: list[int]  # the scored text's token ids
    perplexity: float
    greedy: list[list[int]]  # greedy tokens of GREEDY_PROMPTS
    forced: list[int] | None  # teacher-forced agreement with the reference asked for, if any


def measure(
    model_dir: str,
    ids: list[int] | None,
    num_tokens: int,
    greedy: int,
    reference: list[list[int]] | None = None,
    **engine,
) -> Measured:
    """Perplexity over ids, greedy tokens and, given a reference's greedy tokens, the teacher-forced
    agreement with them (forced_agreement), from one float32 engine on the CPU prefilling in
    CHUNK-token chunks, with the `engine` arguments on top; ids default to the fixed text's first
    num_tokens. The engine is shut down after."""
    llm = LLM(
        model=model_dir, device="cpu", dtype="float32", max_num_batched_tokens=CHUNK, **engine
    )
    try:
        ids = ids or fixed_text_ids(llm, num_tokens)
        return Measured(
            ids,
            perplexity(llm, ids),
            greedy_tokens(llm, GREEDY_PROMPTS, greedy),
            forced_agreement(llm, reference) if reference is not None else None,
        )
    finally:
        llm.shutdown()
        del llm
        gc.collect()
