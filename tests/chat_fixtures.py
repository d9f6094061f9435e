"""Model directories for the tool-call, reasoning and structured-output tests: a small byte-level
BPE tokenizer trained here with `tokenizers`, the chat templates of tests/templates/ (Hermes and
Llama 3.1 JSON tool formats, both with thinking), and optionally random weights of a tiny model
sized to that tokenizer.

    write_chat_model(out_dir, "hermes")            # tokenizer + template only
    write_chat_model(out_dir, "llama3_json", weights=True)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"

# The control tokens of both formats (special: dropped from decoded text unless asked), then the
# marker tokens the models write as text (not special, as in Qwen's and DeepSeek's tokenizers: they
# stay in the output).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
MARKER_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

FORMATS = {
    # format -> (template file, tokenizer_config special tokens, end-of-turn tokens, tiny_models
    # family)
    "hermes": (
        "hermes_tools_thinking.jinja",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        ["<|im_end|>", "<|endoftext|>"],
        "qwen3",
    ),
    "llama3_json": (
        "llama3_json_tools_thinking.jinja",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"],
        "llama",
    ),
}

_WORDS = (
    "the weather in paris is sunny today and the time in tokyo is nine in the evening; what is the "
    "temperature in san francisco now? how about tomorrow? i will check the forecast for you. "
    "okay, the user wants to know the weather, so i should call the tool first and then answer. "
    "celsius fahrenheit city date location unit result error value name arguments parameters"
).split()


def _corpus() -> list[str]:
    """Training text: English, JSON and the call formats, so pieces of all three become tokens."""
    lines = [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 3)]
    calls = [
        {"name": "get_weather", "arguments": {"city": c, "unit": u}}
        for c in ("Paris", "Tokyo", "San Francisco")
        for u in ("celsius", "fahrenheit")
    ]
    for call in calls:
        args = json.dumps(call["arguments"])
        lines.append(
            f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {args}}}\n</tool_call>'
        )
        lines.append(f'{{"name": "{call["name"]}", "parameters": {args}}}')
        lines.append(
            json.dumps(
                {"temperature": 21.5, "unit": call["arguments"]["unit"], "ok": True, "n": None}
            )
        )
    lines += [
        "<think>\nOkay, let me think about it.\n</think>\n\nThe answer is 42.",
        "0123456789 {}[],:\"'",
    ]
    return lines * 4


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (any text encodes) with both formats' tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return tok


def write_chat_model(
    out_dir: str | os.PathLike, fmt: str, *, weights: bool = False, seed: int = 0
) -> Path:
    """A model directory for format `fmt` ("hermes" or "llama3_json"): tokenizer.json,
    tokenizer_config.json, chat_template.jinja, and with weights=True a tiny random model
    (config.json, model.safetensors) whose vocabulary is the tokenizer's and whose end-of-turn ids
    are the format's."""
    template, special, stops, family = FORMATS[fmt]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({**special, "tokenizer_class": "TokenizersBackend"})
    )
    (out / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    if weights:
        _write_weights(out, family, tok, stops, special, seed)
    return out


def _write_weights(out: Path, family: str, tok, stops: list[str], special: dict, seed: int) -> None:
    import torch
    import transformers

    from tests.tiny_models import FAMILIES, _randomize, hf_config

    cfg = hf_config(family, max_position_embeddings=4096)  # room for prompts that list tools
    cfg.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    cfg.eos_token_id = [tok.token_to_id(t) for t in stops]
    cfg.bos_token_id = tok.token_to_id(special.get("bos_token", stops[0]))
    cfg.pad_token_id = None
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][0])(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(str(out))
