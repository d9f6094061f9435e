"""Streaming text out of generated token ids: an incremental detokenizer that cuts the text at stop
strings and never shows part of a stop string or of a character split across byte tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine without a tokenizer (skip_tokenizer_init) never loads one
    from engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
# A character needs at most 4 byte tokens; tokens held longer than this can only be garbage, and are
# emitted as is.
_MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time, and stops at stop strings.

    Each add decodes only a short window of ids: the tokens of the last emitted chunk (context for
    decoders that treat a leading token specially, e.g. SentencePiece's leading space) plus the
    tokens not yet emitted. Text is emitted once it does not end in U+FFFD, so a character split
    over several byte tokens appears whole. tokenizers' own DecodeStream does the same but cannot
    flush at the end: a sequence ending in an incomplete character would lose its last bytes, where
    a full decode shows U+FFFD. Here output_text(finished=True) flushes.

    Special tokens are dropped before decoding when skip_special_tokens is set, so the window's
    context is always real text. The text equals tokenizer.decode(ids, skip_special_tokens) up to
    the held incomplete tail. Only degenerate output departs from that: after _MAX_HELD_TOKENS
    tokens that all end inside a character, the held text is emitted with its U+FFFD so the work per
    token stays bounded, and a later token can no longer complete that character. (The same goes for
    invalid byte runs with SentencePiece byte fallback, whose decoder turns a whole run of bytes
    into U+FFFDs when any of it is invalid.)
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # stop strings count only once this many tokens are out (as vLLM does)
        self.min_tokens = min_tokens
        self._raw = tokenizer.backend
        self.skip_special_tokens = skip_special_tokens
        self._dropped_ids = tokenizer._skipped_ids if skip_special_tokens else frozenset()
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids: list[
            int
        ] = []  # the ids that decode to text (special tokens removed when skipping)
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
        window = self._raw.decode(
            self._ids[self._prefix :], skip_special_tokens=self.skip_special_tokens
        )
        waiting = len(window) <= self._prefix_len or window.endswith(_REPLACEMENT_CHAR)
        if waiting and len(self._ids) - self._read < _MAX_HELD_TOKENS:
            return  # nothing new, or a character still waits for its remaining bytes
        new_text = window[self._prefix_len :]
        # The next window starts at the chunk just emitted; its standalone text length is what to
        # skip next time.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = len(
            self._raw.decode(
                self._ids[self._prefix : self._read], skip_special_tokens=self.skip_special_tokens
            )
        )
        self._append(new_text)

    def _append(self, new_text: str) -> None:
        old_len = len(self._text)
        self._text += new_text
        if self.stop and self.num_tokens >= self.min_tokens:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        """Find the stop string that completes first in the new text; cut the text there and stop.

        Only the tail that can hold a new match is searched. "First" is by end position (then by
        start), so the result does not depend on how the text was split into tokens: it is what
        reading one character at a time would find.
        """
        start = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, start)
            if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            _, i, s = best
            self._text = (
                self._text[: i + len(s)] if self.include_stop_str_in_output else self._text[:i]
            )
            self.stop_reason = s

    def _flush(self) -> None:
        """At the end, emit the held tail too, even an incomplete character (as U+FFFD, like a full
        decode)."""
        if self.done:
            return
        window = self._raw.decode(
            self._ids[self._prefix :], skip_special_tokens=self.skip_special_tokens
        )
        self._read = len(self._ids)
        if len(window) > self._prefix_len:
            self._append(window[self._prefix_len :])
        self._finished = True

    def output_text(self, finished: bool) -> str:
        """The text safe to show. While running with stop strings, the last max_stop_len - 1
        characters are held back (they could be the start of a stop string); once finished (or
        stopped) the whole text."""
        if finished:
            self._flush()
        if self.done or not self.stop:
            return self._text
        return self._text[: max(0, len(self._text) - (self._max_stop_len - 1))]
