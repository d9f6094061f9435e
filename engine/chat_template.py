"""Chat templates: find a model's templates and render them with sandboxed jinja2, as transformers
does.

Byte-identical to transformers' apply_chat_template(tokenize=False) without importing it (its
import would cost a start more than everything else the engine imports).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Names a message's reasoning arrives under; templates read `reasoning_content` (Qwen3), gpt-oss
# reads `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    """Templates call raise_exception('...') to reject a conversation they cannot format."""
    raise ValueError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """json.dumps as HF chat templates expect it: no HTML escaping (unlike jinja's own tojson),
    non-ASCII kept."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not set underscore attributes: {name!r}"
        )


class _GuardedNamespace(Namespace):
    """jinja's namespace() without underscore-prefixed attributes, the way into interpreter
    internals."""

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
    # Same settings as transformers: HF templates are written against trim_blocks/lstrip_blocks and
    # loop controls.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _GuardedNamespace
    env.globals["dict"] = _plain_dict
    return env


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    """Compile a chat template once; a per-request template is compiled on first use and kept
    (LRU)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e.message} (line {e.lineno})") from e


def prepare(source: str) -> None:
    """Compile and analyse `source` now, as render_chat's first use would (both kept by source); a
    template that does not compile is left for render_chat to report."""
    try:
        _compile(source)
        _template_iterates_content(source)
    except (ValueError, jinja2.TemplateError):
        pass


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    """True for `x['content']` or `x.content`, looking through filters such as
    `x['content'] | selectattr(...)`."""
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

    Looks for `{% for part in message['content'] %}`, also through a variable set from the content
    first.
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
        if _is_content_access(it) or (
            isinstance(it, jinja2.nodes.Name) and it.name in content_vars
        ):
            return True
    return False


def _plain(value: Any) -> Any:
    """A copy of template input made of JSON types only, so a template never sees (or mutates)
    caller objects.

    Pydantic models are dumped; anything else that is not JSON-like becomes an inert "<TypeName>"
    placeholder.
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
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"messages[{index}]: only text content parts are supported, got {kind!r}"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _prepare_messages(messages: Any, content_as_parts: bool) -> list[dict]:
    """Validate messages lightly and shape them the way transformers hands them to a template.

    Like transformers: keys whose value is None are dropped (OpenAI clients send content=None next
    to tool_calls) and reasoning given as `reasoning`/`thinking` is also exposed as
    `reasoning_content` (and vice versa). Unlike transformers, which passes content parts through
    untouched: when the template treats content as a string, a list of text parts is joined with
    "\\n" into one string (as vLLM does), so text-only templates accept OpenAI-style content;
    templates that loop over content get the parts list as is.
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


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def render_chat(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None,
    documents: list[dict] | None,
    variables: dict[str, Any],
) -> str:
    """Render one conversation with template `source`; variables hold the special tokens and
    template kwargs.

    Template errors, raise_exception(...) included, raise ValueError."""
    template = _compile(source)
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
    ):
        raise ValueError("tools must be a list of JSON-schema dicts")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, Mapping) for d in documents)
    ):
        raise ValueError("documents must be a list of dicts (e.g. with 'title' and 'text')")
    chat = _prepare_messages(messages, _template_iterates_content(source))
    try:
        return template.render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except ValueError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _templates_from_value(value: Any) -> dict[str, str]:
    """A config's chat_template: one string, or a list of {"name", "template"} dicts (named
    templates)."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, Mapping) and "name" in t and "template" in t
        }
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items() if isinstance(v, str)}
    return {}


def load_templates(path: str, config: dict) -> dict[str, str]:
    """The model's chat templates by name, in transformers 5's order of precedence.

    chat_template.jinja (plus additional_chat_templates/*.jinja, named by file) wins over
    tokenizer_config.json's "chat_template"; chat_template.json (the older processor file,
    {"chat_template": ...}) is the last resort.
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
    return _templates_from_value(
        read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    )


def template_from_argument(value: str) -> str:
    """A chat_template argument is a template, or the path of a file holding one."""
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if looks_like_path and value.endswith((".jinja", ".j2", ".jinja2")):
        raise ValueError(f"chat template file not found: {value}")
    return value
