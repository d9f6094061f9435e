"""Shared by the tool-call and reasoning parsers: picking one by its setting's value, and cutting a
stream of text deltas at marker tags (`<tool_call>`, `</think>` ...): a tag split across two deltas
is held back until it is whole, so the parsers see the same pieces however the text arrives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tag:
    """A marker found in the stream (its text is `text`)."""

    text: str


Piece = str | Tag


def held_suffix_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of the tags (it may
    still grow into that tag, so it cannot be passed on yet)."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


class TagSplitter:
    """Feed text deltas, get back plain text and Tag pieces in order.

    Where two tags could start at one place, the longer wins; text that may be the start of a tag
    stays held until the next feed() decides it, or finish() hands it out as text."""

    def __init__(self, tags: Sequence[str]):
        if not tags or any(not t for t in tags):
            raise ValueError("tags: need at least one non-empty tag")
        self._tags = sorted(set(tags), key=len, reverse=True)
        self._held = ""

    def feed(self, text: str) -> list[Piece]:
        buf = self._held + text
        pieces: list[Piece] = []
        start = 0
        while True:
            found = -1
            found_tag = ""
            for tag in self._tags:  # the earliest tag; at one place the longest
                i = buf.find(tag, start)
                if i >= 0 and (found < 0 or i < found):
                    found, found_tag = i, tag
            if found < 0:
                break
            if found > start:
                pieces.append(buf[start:found])
            pieces.append(Tag(found_tag))
            start = found + len(found_tag)
        rest = buf[start:]
        keep = held_suffix_len(rest, self._tags)
        if len(rest) > keep:
            pieces.append(rest[: len(rest) - keep])
        self._held = rest[len(rest) - keep :] if keep else ""
        return pieces

    def finish(self) -> list[Piece]:
        """The held text, as plain text: the stream ended before it became a tag."""
        held, self._held = self._held, ""
        return [held] if held else []


def named_parser(parsers: Mapping[str, type], setting: str, name: str) -> Any:
    """An instance of parsers[name]; ValueError naming the setting and the known names otherwise."""
    cls = parsers.get(name)
    if cls is None:
        raise ValueError(f"{setting}: unknown parser {name!r}; known: {', '.join(parsers)}")
    return cls()
