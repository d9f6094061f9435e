"""Text in and out of the engine: encode/decode with `tokenizers`, HF chat templates rendered with jinja2 (never
transformers, too slow to import), and an incremental detokenizer that streams text and cuts it at stop strings.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import AddedToken
from tokenizers import Tokenizer as _RawTokenizer

# The named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning arrives under; templates read `reasoning_content` (Qwen3), gpt-oss reads `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
# A character needs at most 4 byte tokens; tokens held longer than this can only be garbage, and are emitted as is.
_MAX_HELD_TOKENS = 8


# --------------------------------------------------------------------------------------------------------------------
# Chat template rendering
# --------------------------------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    """Templates call raise_exception('...') to reject a conversation they cannot format."""
    raise ValueError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """json.dumps as HF chat templates expect it: no HTML escaping (unlike jinja's own tojson), non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes: {name!r}")


class _GuardedNamespace(Namespace):
    """jinja's namespace() without underscore-prefixed attributes, the way into interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace takes self this way too
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _plain_dict(*args: Any, **kwargs: Any) -> dict:
    """The dict() global, as a plain function so templates cannot reach the dict type itself."""
    return dict(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers: HF templates are written against trim_blocks/lstrip_blocks and loop controls.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _GuardedNamespace
    env.globals["dict"] = _plain_dict
    return env


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    """Compile a chat template once; a per-request template is compiled on first use and kept (LRU)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e.message} (line {e.lineno})") from e


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    """True for `x['content']` or `x.content`, looking through filters such as `x['content'] | selectattr(...)`."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


@lru_cache(maxsize=64)
def _template_iterates_content(source: str) -> bool:
    """Whether a template loops over a message's content, i.e. reads OpenAI-style content parts.

    Looks for `{% for part in message['content'] %}`, also through a variable set from the content first.
    """
    ast = _environment().parse(source)
    content_vars = {
        node.target.name
        for node in ast.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name) and _is_content_access(node.node)
    }
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter) and it.node is not None:
            it = it.node
        if _is_content_access(it) or (isinstance(it, jinja2.nodes.Name) and it.name in content_vars):
            return True
    return False


def _plain(value: Any) -> Any:
    """A copy of template input made of JSON types only, so a template never sees (or mutates) caller objects.

    Pydantic models are dumped; anything else that is not JSON-like becomes an inert "<TypeName>" placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (str enums, ...) may carry methods: keep only the text
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _text_of_parts(parts: list, index: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"messages[{index}]: only text content parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _prepare_messages(messages: Any, content_as_parts: bool) -> list[dict]:
    """Validate messages lightly and shape them the way transformers hands them to a template.

    Like transformers: keys whose value is None are dropped (OpenAI clients send content=None next to tool_calls)
    and reasoning given as `reasoning`/`thinking` is also exposed as `reasoning_content` (and vice versa).
    Unlike transformers, which passes content parts through untouched: when the template treats content as a string,
    a list of text parts is joined with "\\n" into one string (as vLLM does), so text-only templates accept
    OpenAI-style content; templates that loop over content get the parts list as is.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        msg = {k: _plain(v) for k, v in message.items() if v is not None}
        content = msg.get("content")
        if isinstance(content, list):
            text = _text_of_parts(content, i)
            if not content_as_parts:
                msg["content"] = text
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of text parts")
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        prepared.append(msg)
    return prepared


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _templates_from_value(value: Any) -> dict[str, str]:
    """A config's chat_template: one string, or a list of {"name", "template"} dicts (named templates)."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, Mapping) and "name" in t and "template" in t}
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items() if isinstance(v, str)}
    return {}


def _load_templates(path: str, config: dict) -> dict[str, str]:
    """The model's chat templates by name, in transformers 5's order of precedence.

    chat_template.jinja (plus additional_chat_templates/*.jinja, named by file) wins over tokenizer_config.json's
    "chat_template"; chat_template.json (the older processor file, {"chat_template": ...}) is the last resort.
    """
    templates: dict[str, str] = {}
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra_dir = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if templates:
        return templates
    templates = _templates_from_value(config.get("chat_template"))
    if templates:
        return templates
    return _templates_from_value(_read_json(os.path.join(path, "chat_template.json")).get("chat_template"))


def _template_from_argument(value: str) -> str:
    """A chat_template argument is a template, or the path of a file holding one."""
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if looks_like_path and value.endswith((".jinja", ".j2", ".jinja2")):
        raise ValueError(f"chat template file not found: {value}")
    return value


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """A model's tokenizer: encode/decode through `tokenizers`, chat prompts through its jinja chat template.

    Encoding follows tokenizer.json exactly (its post-processor decides whether add_special_tokens adds a BOS), as
    transformers 5 does for tokenizers it loads from tokenizer.json. Decoding never applies transformers'
    clean_up_tokenization_spaces (transformers itself skips it for BPE models, i.e. every model this engine runs).
    """

    def __init__(self, raw: _RawTokenizer, special_tokens: dict[str, str] | None = None,
                 chat_templates: dict[str, str] | None = None, extra_special_tokens: Iterable[str] = ()) -> None:
        self._raw = raw
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._templates: dict[str, str] = dict(chat_templates or {})
        self._ensure_special(list(self.special_tokens.values()) + list(extra_special_tokens))
        # The ids decode(skip_special_tokens=True) drops: the added tokens flagged special.
        self._skipped_ids = frozenset(i for i, t in raw.get_added_tokens_decoder().items() if t.special)
        named_ids = {self._raw.token_to_id(t) for t in self.special_tokens.values()}
        self._all_special_ids = frozenset(self._skipped_ids | (named_ids - {None}))
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: str, chat_template: str | None = None) -> Tokenizer:
        """Load tokenizer.json, the special tokens and chat templates of an HF model directory.

        `chat_template` (a template, or a path to a .jinja file) replaces whatever template the model ships.
        """
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {path} (only fast tokenizers are supported)")
        raw = _RawTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        legacy_map = _read_json(os.path.join(path, "special_tokens_map.json"))  # older repos keep them here only

        special: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(config.get(name))
            if content is None:
                content = _token_content(legacy_map.get(name))
            if content is not None:
                special[name] = content
        if "pad_token" not in special and isinstance(raw.padding, dict) and raw.padding.get("pad_token"):
            special["pad_token"] = raw.padding["pad_token"]

        extra: list[str] = []
        for key in ("extra_special_tokens", "additional_special_tokens"):
            for source in (config, legacy_map):
                value = source.get(key)
                values = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
                extra += [c for c in map(_token_content, values) if c is not None]

        templates = _load_templates(path, config)
        if chat_template is not None:
            templates = {"default": _template_from_argument(chat_template)}
        return cls(raw, special, templates, extra)

    def _ensure_special(self, contents: list[str]) -> None:
        """Make every named special token an added special token, as transformers does on load.

        Tokens tokenizer.json already lists as special are left untouched (with their lstrip/rstrip flags).
        """
        added = {t.content: t for t in self._raw.get_added_tokens_decoder().values()}
        missing = [c for c in dict.fromkeys(contents) if c and not (c in added and added[c].special)]
        if missing:
            self._raw.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in missing])

    # ---- vocabulary -------------------------------------------------------------------------------------------------

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
        """Every special token id: the named ones (bos, eos, ...) and all added tokens flagged special.

        This is the set decode(skip_special_tokens=True) drops; transformers' all_special_ids lists only the named
        and extra special tokens, a subset of it.
        """
        return set(self._all_special_ids)

    # ---- encode / decode --------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (e.g. a leading BOS)."""
        return self._raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """One token's own text, special tokens included (for Logprob.decoded_token). A token that is part of a
        multi-byte character decodes to U+FFFD on its own. Cached: logprobs ask for the same ids again and again."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._raw.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    # ---- chat -------------------------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None."""
        return self._templates.get("default") if "default" in self._templates else None

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template to render: `chat_template` (a template or the name of one of the model's), else the model's
        "tool_use" template when tools are given and it has one, else its "default" template."""
        if chat_template is not None:
            return self._templates.get(chat_template) or _template_from_argument(chat_template)
        if not self._templates:
            raise ValueError("model has no chat template; pass chat_template=... (a jinja template or a .jinja file)")
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise ValueError(f"model has several chat templates and none is named 'default': {sorted(self._templates)}; "
                         "pass chat_template=<name>")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template: str | None = None, **template_kwargs: Any) -> str:
        """Render a conversation to the prompt string, byte-identical to transformers'
        apply_chat_template(messages, tokenize=False, ...) for the same inputs.

        The template sees: messages, add_generation_prompt, tools, documents, the named special tokens (bos_token,
        eos_token, pad_token, unk_token, ...) and template_kwargs (e.g. enable_thinking=False for Qwen3), which may
        override the special tokens. Template errors, raise_exception(...) included, raise ValueError.
        Unlike transformers, add_generation_prompt defaults to True (the engine renders prompts to answer), tools
        must be JSON-schema dicts (not Python functions), and text content parts are joined for string templates.
        """
        source = self.get_chat_template(chat_template, tools)
        template = _compile(source)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema dicts")
        if documents is not None and not (isinstance(documents, list)
                                          and all(isinstance(d, Mapping) for d in documents)):
            raise ValueError("documents must be a list of dicts (e.g. with 'title' and 'text')")
        chat = _prepare_messages(messages, _template_iterates_content(source))
        variables = {**self.special_tokens, **_plain(template_kwargs)}
        try:
            return template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except ValueError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    documents: list[dict] | None = None, chat_template: str | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Prompt token ids of a conversation: apply_chat_template, then encode(add_special_tokens=False).

        Special tokens are not added again because the template already writes them (BOS included); the result
        equals transformers' apply_chat_template(..., tokenize=True)["input_ids"].
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        documents=documents, chat_template=chat_template, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------------------------------------------------
# Incremental detokenizer
# --------------------------------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time, and stops at stop strings.

    Each add decodes only a short window of ids: the tokens of the last emitted chunk (context for decoders that
    treat a leading token specially, e.g. SentencePiece's leading space) plus the tokens not yet emitted. Text is
    emitted once it does not end in U+FFFD, so a character split over several byte tokens appears whole.
    tokenizers' own DecodeStream does the same but cannot flush at the end: a sequence ending in an incomplete
    character would lose its last bytes, where a full decode shows U+FFFD. Here output_text(finished=True) flushes.

    Special tokens are dropped before decoding when skip_special_tokens is set, so the window's context is always
    real text. The text equals tokenizer.decode(ids, skip_special_tokens) up to the held incomplete tail. Only
    degenerate output departs from that: after _MAX_HELD_TOKENS tokens that all end inside a character, the held
    text is emitted with its U+FFFD so the work per token stays bounded, and a later token can no longer complete
    that character. (The same goes for invalid byte runs with SentencePiece byte fallback, whose decoder turns a
    whole run of bytes into U+FFFDs when any of it is invalid.)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._raw = tokenizer.backend
        self.skip_special_tokens = skip_special_tokens
        self._dropped_ids = tokenizer._skipped_ids if skip_special_tokens else frozenset()
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = []  # the ids that decode to text (special tokens removed when skipping)
        self._prefix = 0  # the decode window starts here: the ids of the last emitted chunk
        self._read = 0  # ids before this are in the text
        self._prefix_len = 0  # len(decode(ids[prefix:read]))
        self._text = ""
        self.num_tokens = 0
        self.stop_reason: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text decoded so far (cut at a stop string), without the stop-string hold-back."""
        return self._text

    @property
    def done(self) -> bool:
        """A stop string matched, or the text was finished; further adds are ignored."""
        return self.stop_reason is not None or self._finished

    def add(self, token_id: int) -> None:
        """Append one generated token and extend the text with whatever became decodable."""
        if self.done:
            return
        self.num_tokens += 1
        if token_id in self._dropped_ids:
            return
        self._ids.append(token_id)
        window = self._raw.decode(self._ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        waiting = len(window) <= self._prefix_len or window.endswith(_REPLACEMENT_CHAR)
        if waiting and len(self._ids) - self._read < _MAX_HELD_TOKENS:
            return  # nothing new, or a character still waits for its remaining bytes
        new_text = window[self._prefix_len:]
        # The next window starts at the chunk just emitted; its standalone text length is what to skip next time.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = len(self._raw.decode(self._ids[self._prefix:self._read],
                                                skip_special_tokens=self.skip_special_tokens))
        self._append(new_text)

    def _append(self, new_text: str) -> None:
        old_len = len(self._text)
        self._text += new_text
        if self.stop:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        """Find the stop string that completes first in the new text; cut the text there and stop.

        Only the tail that can hold a new match is searched. "First" is by end position (then by start), so the
        result does not depend on how the text was split into tokens: it is what reading one character at a time
        would find.
        """
        start = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, start)
            if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            _, i, s = best
            self._text = self._text[: i + len(s)] if self.include_stop_str_in_output else self._text[:i]
            self.stop_reason = s

    def _flush(self) -> None:
        """At the end, emit the held tail too, even an incomplete character (as U+FFFD, like a full decode)."""
        if self.done:
            return
        window = self._raw.decode(self._ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        self._read = len(self._ids)
        if len(window) > self._prefix_len:
            self._append(window[self._prefix_len:])
        self._finished = True

    def output_text(self, finished: bool) -> str:
        """The text safe to show. While running with stop strings, the last max_stop_len - 1 characters are held back
        (they could be the start of a stop string); once finished (or stopped) the whole text."""
        if finished:
            self._flush()
        if self.done or not self.stop:
            return self._text
        return self._text[: max(0, len(self._text) - (self._max_stop_len - 1))]
