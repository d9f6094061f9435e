"""Text in and out of the engine: encode/decode with `tokenizers` directly (never transformers, too
slow to import) and the model's special tokens; chat prompts are rendered by
engine/chat_template.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import AddedToken, Tokenizer as _RawTokenizer

from engine.chat_template import (
    load_templates,
    prepare,
    read_json,
    render_chat,
    template_from_argument,
)

# The named special tokens transformers passes to every chat template (its
# SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with
    "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A model's tokenizer: encode/decode through `tokenizers`, chat prompts through its jinja chat
    template.

    Encoding follows tokenizer.json exactly (its post-processor decides whether add_special_tokens
    adds a BOS), as transformers 5 does for tokenizers it loads from tokenizer.json. Decoding never
    applies transformers' clean_up_tokenization_spaces (transformers itself skips it for BPE models,
    i.e. every model this engine runs).
    """

    def __init__(
        self,
        raw: _RawTokenizer,
        special_tokens: dict[str, str] | None = None,
        chat_templates: dict[str, str] | None = None,
        extra_special_tokens: Iterable[str] = (),
    ) -> None:
        self._raw = raw
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._templates: dict[str, str] = dict(chat_templates or {})
        self._ensure_special(list(self.special_tokens.values()) + list(extra_special_tokens))
        # The ids decode(skip_special_tokens=True) drops: the added tokens flagged special.
        self._skipped_ids = frozenset(
            i for i, t in raw.get_added_tokens_decoder().items() if t.special
        )
        named_ids = {self._raw.token_to_id(t) for t in self.special_tokens.values()}
        self._all_special_ids = frozenset(self._skipped_ids | (named_ids - {None}))
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: str, chat_template: str | None = None) -> Tokenizer:
        """Load tokenizer.json, the special tokens and chat templates of an HF model directory.

        `chat_template` (a template, or a path to a .jinja file) replaces whatever template the
        model ships. A tokenizer preload() made for the same arguments is handed out instead (once).
        """
        preloaded = _preloaded.pop(_preload_key(path, chat_template), None)
        if preloaded is not None:
            return preloaded
        return cls._load(path, chat_template)

    @classmethod
    def _load(cls, path: str, chat_template: str | None) -> Tokenizer:
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(
                f"no tokenizer.json in {path} (only fast tokenizers are supported)"
            )
        raw = _RawTokenizer.from_file(tokenizer_file)
        config = read_json(os.path.join(path, "tokenizer_config.json"))
        # older repos keep them here only
        legacy_map = read_json(os.path.join(path, "special_tokens_map.json"))

        special: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(config.get(name))
            if content is None:
                content = _token_content(legacy_map.get(name))
            if content is not None:
                special[name] = content
        if (
            "pad_token" not in special
            and isinstance(raw.padding, dict)
            and raw.padding.get("pad_token")
        ):
            special["pad_token"] = raw.padding["pad_token"]

        extra: list[str] = []
        for key in ("extra_special_tokens", "additional_special_tokens"):
            for source in (config, legacy_map):
                value = source.get(key)
                values = (
                    value.values()
                    if isinstance(value, Mapping)
                    else value
                    if isinstance(value, list)
                    else ()
                )
                extra += [c for c in map(_token_content, values) if c is not None]

        templates = load_templates(path, config)
        if chat_template is not None:
            templates = {"default": template_from_argument(chat_template)}
        return cls(raw, special, templates, extra)

    def _ensure_special(self, contents: list[str]) -> None:
        """Make every named special token an added special token, as transformers does on load.

        Tokens tokenizer.json already lists as special are left untouched (with their lstrip/rstrip
        flags).
        """
        added = {t.content: t for t in self._raw.get_added_tokens_decoder().values()}
        missing = [
            c for c in dict.fromkeys(contents) if c and not (c in added and added[c].special)
        ]
        if missing:
            self._raw.add_special_tokens(
                [AddedToken(c, special=True, normalized=False) for c in missing]
            )

    # ---- vocabulary ------------------------------------------------------------------------------

    @property
    def backend(self) -> _RawTokenizer:
        """The underlying tokenizers.Tokenizer."""
        return self._raw

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (transformers' len(tokenizer))."""
        return self._raw.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._raw.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._raw.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._raw.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def all_special_ids(self) -> set[int]:
        """Every special token id: the named ones (bos, eos, ...) and all added tokens flagged
        special.

        This is the set decode(skip_special_tokens=True) drops; transformers' all_special_ids lists
        only the named and extra special tokens, a subset of it.
        """
        return set(self._all_special_ids)

    # ---- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (e.g. a
        leading BOS)."""
        return self._raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """One token's own text, special tokens included (for Logprob.decoded_token). A token that
        is part of a multi-byte character decodes to U+FFFD on its own. Cached: logprobs ask for the
        same ids again and again."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._raw.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    # ---- chat ------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None."""
        return self._templates.get("default") if "default" in self._templates else None

    def prepare_chat_templates(self) -> None:
        """Compile the model's chat templates now (engine.chat_template.prepare), so that the first
        chat request does not."""
        for source in self._templates.values():
            prepare(source)

    def get_chat_template(
        self, chat_template: str | None = None, tools: list[dict] | None = None
    ) -> str:
        """The template to render: `chat_template` (a template or the name of one of the model's),
        else the model's "tool_use" template when tools are given and it has one, else its "default"
        template."""
        if chat_template is not None:
            return self._templates.get(chat_template) or template_from_argument(chat_template)
        if not self._templates:
            raise ValueError(
                "model has no chat template; pass chat_template=... "
                "(a jinja template or a .jinja file)"
            )
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise ValueError(
            "model has several chat templates and none is named 'default': "
            f"{sorted(self._templates)}; pass chat_template=<name>"
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt string, byte-identical to transformers'
        apply_chat_template(messages, tokenize=False, ...) for the same inputs.

        The template sees: messages, add_generation_prompt, tools, documents, the named special
        tokens (bos_token, eos_token, pad_token, unk_token, ...) and template_kwargs (e.g.
        enable_thinking=False for Qwen3), which may override the special tokens. Template errors,
        raise_exception(...) included, raise ValueError. Unlike transformers, add_generation_prompt
        defaults to True (the engine renders prompts to answer), tools must be JSON-schema dicts
        (not Python functions), and text content parts are joined for string templates.
        """
        source = self.get_chat_template(chat_template, tools)
        return render_chat(
            source,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            variables={**self.special_tokens, **template_kwargs},
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt token ids of a conversation: apply_chat_template, then
        encode(add_special_tokens=False).

        Special tokens are not added again because the template already writes them (BOS included);
        the result equals transformers' apply_chat_template(..., tokenize=True)["input_ids"].
        """
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)


# Tokenizers loaded ahead of the engine, by preload_key: from_dir hands each out once.
_preloaded: dict[tuple[str, str | None], Tokenizer] = {}


def _preload_key(path: str, chat_template: str | None) -> tuple[str, str | None]:
    return os.path.realpath(path), chat_template


def preload(path: str, chat_template: str | None = None) -> bool:
    """Load `path`'s tokenizer now, for the next Tokenizer.from_dir(path, chat_template) to take;
    True if one was loaded.

    The start (warmup.start) calls this before `import torch`, while the GPU's context is being
    made and the interpreter would otherwise wait: `tokenizers` parses tokenizer.json holding the
    interpreter's lock, which inside the engine's build is time on the way to the first token.
    Never raises: where there is nothing to load or the load fails, the engine's own load meets it
    and reports it in its place."""
    try:
        tokenizer = Tokenizer._load(path, chat_template)
    except Exception:  # noqa: BLE001 - no tokenizer.json, or a bad one: the engine's load says so
        return False
    _preloaded[_preload_key(path, chat_template)] = tokenizer
    return True


def load_if_present(path: str, chat_template: str | None = None) -> Tokenizer | None:
    """Tokenizer.from_dir(path, chat_template), or None where `path` has no tokenizer.json (a model
    served by token ids alone)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    return Tokenizer.from_dir(path, chat_template)


def discard_preload(path: str, chat_template: str | None = None) -> None:
    """Drop what preload(path, chat_template) left if no engine took it (a start that failed
    before its engine's build): nothing is held for the life of the process."""
    _preloaded.pop(_preload_key(path, chat_template), None)
