"""Reasoning parsers: a completion's `<think>...</think>` goes to reasoning_content, the rest to
content, by vLLM's REASONING_PARSER names:

- qwen3: the reply may open with `<think>`; it starts inside the thinking when the prompt left a
  `<think>` open (Qwen3.5 and the 2507 thinking models), and is all content when the prompt closed
  it (enable_thinking=False writes `<think>\\n\\n</think>\\n\\n` into the prompt);
- deepseek_r1: the template opens `<think>` in the prompt, so the reply starts inside the thinking
  (a `<think>` the model writes anyway is dropped) unless the prompt closed it.

Without `</think>` a reply that started thinking is all reasoning (it was cut short). The newlines
next to the tags are dropped, as the templates drop them when they render a reply back. Streaming
gives the same split as the whole-text parse, however the text is cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from handler.tag_stream import Tag, TagSplitter, named_parser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    """Text made final by one delta: reasoning first, then content (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def prompt_leaves_thinking_open(prompt: str) -> bool | None:
    """True when the prompt's last think tag is an open `<think>`, False when it is a `</think>`
    (thinking closed, e.g. enable_thinking=False), None when the prompt has neither."""
    opened, closed = prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)
    if opened < 0 and closed < 0:
        return None
    return opened > closed


class ReasoningStream:
    """The incremental split of one completion: feed() each text delta, then finish() once."""

    def __init__(self, starts_in_reasoning: bool, may_open: bool):
        # "open": a leading <think> may still start the reasoning; then "reasoning" until </think>;
        # "content" after it (or from the start when neither applies).
        self._state = "reasoning" if starts_in_reasoning else ("open" if may_open else "content")
        self._split = TagSplitter([THINK_OPEN, THINK_CLOSE])
        self._lead = ""  # "open": the whitespace seen before any text
        self._newlines = ""  # "reasoning": newlines held (they go if </think> comes next)
        # drop newlines at the start of the reasoning / content
        self._strip_leading = starts_in_reasoning

    def _lead_stripped(self, text: str) -> str:
        """text without the newlines that open the reasoning or the content."""
        if self._strip_leading:
            text = text.lstrip("\n")
            self._strip_leading = not text
        return text

    def _reasoning(self, text: str, out: ReasoningDelta) -> None:
        text = self._lead_stripped(text)
        if not text:
            return
        text = self._newlines + text
        core = text.rstrip("\n")
        self._newlines = text[len(core) :]
        out.reasoning += core

    def _content(self, text: str, out: ReasoningDelta) -> None:
        out.content += self._lead_stripped(text)

    def _piece(self, piece: str | Tag, out: ReasoningDelta) -> None:
        text = piece.text if isinstance(piece, Tag) else piece
        if self._state == "open":
            if piece == Tag(THINK_OPEN):
                self._state, self._lead, self._strip_leading = "reasoning", "", True
                return
            if isinstance(piece, str) and not piece.strip():
                self._lead += piece
                return
            self._state, text, self._lead = "content", self._lead + text, ""
        if self._state == "reasoning":
            if piece == Tag(THINK_CLOSE):
                self._state, self._newlines, self._strip_leading = "content", "", True
            elif piece == Tag(THINK_OPEN) and self._strip_leading:
                pass  # a <think> the model writes although the prompt opened one
            else:
                self._reasoning(text, out)
            return
        self._content(text, out)

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        for piece in self._split.feed(text):
            self._piece(piece, out)
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        for piece in self._split.finish():
            self._piece(piece, out)
        if self._state == "open" and self._lead:
            out.content += self._lead
        return out

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the thinking."""
        return self._state == "reasoning"


class ReasoningParser:
    """A REASONING_PARSER: for one request's rendered prompt, stream() splits its completion."""

    name = ""
    # the family's template opens <think> itself (the reply starts thinking)
    opens_in_prompt = False

    def stream(self, prompt: str = "") -> ReasoningStream:
        left_open = prompt_leaves_thinking_open(prompt)
        starts = self.opens_in_prompt if left_open is None else left_open
        return ReasoningStream(starts_in_reasoning=starts, may_open=left_open is not False)

    def parse(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole completion; None for an empty part."""
        s = self.stream(prompt)
        a, b = s.feed(text), s.finish()
        return (a.reasoning + b.reasoning) or None, (a.content + b.content) or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser a REASONING_PARSER value names; ValueError listing the known names otherwise."""
    return named_parser(REASONING_PARSERS, "REASONING_PARSER", name)


# A generation prompt that opens the thinking: `assistant` (a newline, as text or as `\n` in a jinja
# string) then <think>, or DeepSeek's `<｜Assistant｜><think>`.
_OPENS_THINKING = re.compile(r"(assistant(\\n|\n)|<｜Assistant｜>)<think>")


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """qwen3 for templates with an enable_thinking switch, deepseek_r1 for templates that always
    open `<think>` in the generation prompt, qwen3 for other templates that know think tags, else
    None."""
    if not chat_template or THINK_CLOSE not in chat_template:
        return None
    if "enable_thinking" in chat_template or not _OPENS_THINKING.search(chat_template):
        return "qwen3"
    return "deepseek_r1"
