"""Which scales an FP8 KV cache should use, measured on the real SmolLM2-135M on CPU (fp32 weights
and math, the torch reference attention): tests/accuracy.py's perplexity over 2,048 tokens of fixed
text prefilled in 256-token chunks, and leading greedy agreement of 8 prompts x 32 tokens, against
the fp32 cache, for:

- e4m3 with scale 1.0 for every layer's K and V (vLLM's default without a scales file);
- e4m3 with a scale per layer, amax / 448 of the K and V of a first prefill: the text's first 256
  tokens, or the first greedy prompt (a short one, as a server's first request may be); with 2x
  headroom; and an oracle amax over the whole text (no value ever clamped);
- e5m2 with scale 1.0.

`python -m bench.kv_scales --model DIR --out DIR` (DIR: the converted SmolLM2, as tests/conftest.py
makes it) writes kv_scales.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from engine import LLM, SamplingParams
from engine.attention.torch_ref import TorchAttentionBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import accuracy  # noqa: E402  (the tests' shared accuracy helper)

CHUNK = 256
E4M3_MAX = 448.0


def make(model: str, kv: str) -> LLM:
    return LLM(
        model,
        dtype="float32",
        device="cpu",
        kv_cache_dtype=kv,
        max_num_batched_tokens=CHUNK,
        enable_prefix_caching=False,
    )


def layer_amax(llm: LLM, prompt) -> list[tuple[float, float]]:
    """Per layer, the largest |K| and |V| the attention saw while prefilling `prompt`."""
    seen: list[tuple[float, float]] = []
    forward = TorchAttentionBackend.forward

    def spy(self, q, k, v, *args, **kwargs):
        seen.append((k.abs().max().item(), v.abs().max().item()))
        return forward(self, q, k, v, *args, **kwargs)

    TorchAttentionBackend.forward = spy
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        TorchAttentionBackend.forward = forward
    layers = len(llm.engine.runner.model.layers)
    amax = [(0.0, 0.0)] * layers
    for i, (k, v) in enumerate(seen):
        amax[i % layers] = (max(amax[i % layers][0], k), max(amax[i % layers][1], v))
    return amax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=".cache/test-models/smollm2-135m-instruct")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    ref = make(args.model, "auto")
    ids = accuracy.fixed_text_ids(ref, args.tokens)
    first_chunk = layer_amax(ref, {"prompt_token_ids": ids[:CHUNK]})
    first_prompt = layer_amax(ref, accuracy.GREEDY_PROMPTS[0])
    whole_text = layer_amax(ref, {"prompt_token_ids": ids})
    ref_ppl = accuracy.perplexity(ref, ids)
    ref_tokens = accuracy.greedy_tokens(ref, accuracy.GREEDY_PROMPTS, 32)
    del ref

    def per_layer(amax, headroom=1.0):
        return [(headroom * k / E4M3_MAX, headroom * v / E4M3_MAX) for k, v in amax]

    schemes = [
        ("e4m3, scale 1.0", "fp8", None),
        ("e4m3, per layer amax/448 of the text's first 256 tokens", "fp8", per_layer(first_chunk)),
        (
            "e4m3, per layer 2*amax/448 of the text's first 256 tokens",
            "fp8",
            per_layer(first_chunk, 2.0),
        ),
        ("e4m3, per layer amax/448 of the first greedy prompt", "fp8", per_layer(first_prompt)),
        ("e4m3, per layer amax/448 of the whole text (oracle)", "fp8", per_layer(whole_text)),
        ("e5m2, scale 1.0", "fp8_e5m2", None),
    ]
    rows = []
    for name, kv, scales in schemes:
        t0 = time.perf_counter()
        llm = make(args.model, kv)
        if scales is not None:
            for layer, scale in zip(llm.engine.runner.model.layers, scales):
                layer.self_attn.kv_scale = scale
        ppl = accuracy.perplexity(llm, ids)
        tokens = accuracy.greedy_tokens(llm, accuracy.GREEDY_PROMPTS, 32)
        agreement = [accuracy.leading_agreement(a, b) for a, b in zip(tokens, ref_tokens)]
        rows.append(
            {
                "scheme": name,
                "kv_cache_dtype": kv,
                "perplexity": ppl,
                "perplexity_change": ppl / ref_ppl - 1,
                "leading_agreement": agreement,
                "prompts_at_24_of_32": sum(a >= 24 for a in agreement),
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"{name}: ppl {ppl:.4f} ({rows[-1]['perplexity_change']:+.3%}), agreement "
            f"{agreement}, {rows[-1]['prompts_at_24_of_32']} of 8 at >= 24",
            flush=True,
        )
        del llm
    result = {
        "model": "SmolLM2-135M-Instruct (tests/conftest.py's GGUF conversion), fp32, CPU",
        "tokens": args.tokens,
        "chunk": CHUNK,
        "reference_perplexity": ref_ppl,
        "amax_first_256_tokens": first_chunk,
        "amax_first_prompt": first_prompt,
        "amax_whole_text": whole_text,
        "rows": rows,
    }
    with open(os.path.join(args.out, "kv_scales.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
