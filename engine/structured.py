"""Structured outputs in the engine: a grammar as a sampling parameter, compiled off the step loop
and cached per spec, a matcher per sequence that accepts its tokens and fills its row of a token
bitmask (engine/token_bitmask.py carries it to the logits). The grammar engine is llguidance
(docs/structured-outputs.md).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from engine.structured_outputs import StructuredOutputs  # noqa: F401 - the spec, re-exported

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (least recently used first out)


class CompiledGrammar:
    """A spec compiled against the model's tokenizer; matcher(): one per sequence.

    llguidance's matchers copied from one template share its lexer behind one lock, so a batch's
    rows of one template fill one after another however many threads fill them. A grammar that
    more sequences use at once than it has copies is therefore built again (families), in the
    background, one copy at a time, up to max_families; matcher() deals sequences round the
    families that exist, so rows of different families fill in parallel while each family's lexer
    states stay shared by its own rows. A grammar one sequence at a time uses stays one copy.

    build_family: builds one more template (a new LLMatcher with its own lexer); schedule runs the
    build off the caller's thread (GrammarBackend: on its compile threads) and says False once it
    cannot."""

    def __init__(
        self,
        spec: StructuredOutputs,
        template: Any,
        max_families: int = 1,
        schedule: Callable[[Callable[[], None]], bool] | None = None,
        build_family: Callable[[], Any] | None = None,
    ):
        self.spec = spec
        # LLMatchers at the grammar's start, never advanced themselves; appended to, never changed
        self._templates = [template]
        self._dealt = itertools.count()
        self._max_families = max_families
        self._schedule = schedule
        self._build_family = build_family
        self._lock = threading.Lock()
        self._live = 0  # matchers not yet garbage (sequences using the grammar now)
        self._growing = False  # a family is being built

    @property
    def families(self) -> int:
        """How many independent copies of the grammar (each with its own lexer) exist now."""
        return len(self._templates)

    @property
    def live(self) -> int:
        """Matchers of this grammar still held (by sequences running or waiting)."""
        return self._live

    def matcher(self, start_after_token: int | None = None) -> GrammarMatcher:
        """A matcher at the grammar's start. start_after_token: the grammar applies only to the
        tokens after this one (e.g. the end of a model's reasoning); until then the row is left
        unconstrained."""
        with self._lock:
            templates = self._templates
            family = next(self._dealt) % len(templates)
            self._live += 1
        matcher = GrammarMatcher(templates[family].deep_copy(), start_after_token, family)
        weakref.finalize(matcher, self._release)
        self._grow_if_needed()
        return matcher

    def _release(self) -> None:
        with self._lock:
            self._live -= 1

    def _grow_if_needed(self) -> None:
        with self._lock:
            if (
                self._growing
                or self._schedule is None
                or len(self._templates) >= min(self._live, self._max_families)
            ):
                return
            self._growing = True
        if not self._schedule(self._add_family):
            with self._lock:
                self._growing = False

    def _add_family(self) -> None:
        try:
            template = self._build_family()
        except Exception:  # compiled once already: never expected; the families built serve
            template = None
        with self._lock:
            self._growing = False
            if template is None or template.is_error():
                self._schedule = None  # no more tries
                return
            self._templates.append(template)
        self._grow_if_needed()


class GrammarMatcher:
    """One sequence's place in its grammar: accept() each sampled token, fill() its mask row before
    sampling.

    Once the grammar is complete the mask allows only the end-of-sequence tokens; a token the mask
    would not have allowed puts the matcher in an error state (error names it) and accept() returns
    False."""

    def __init__(self, matcher: Any, start_after_token: int | None = None, family: int = 0):
        self._matcher = matcher
        self._waiting_for = start_after_token
        # which of its grammar's copies (CompiledGrammar) it shares a lexer with
        self.family = family

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (not before start_after_token)."""
        return self._waiting_for is None

    def accept(self, token_id: int) -> bool:
        if self._waiting_for is not None:
            if token_id == self._waiting_for:
                self._waiting_for = None
            return True
        if self._matcher.is_stopped():
            # Past the grammar's end only end-of-sequence tokens were allowed; one arrives here when
            # the engine samples on (ignore_eos) or reads a step late (async scheduling). Nothing
            # more to match.
            return True
        return self._matcher.consume_token(token_id)

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return all(self.accept(t) for t in token_ids)

    @property
    def is_finished(self) -> bool:
        """The grammar matched completely and no text may follow (only end-of-sequence tokens)."""
        return self.active and self._matcher.is_stopped()

    @property
    def can_end(self) -> bool:
        """What was accepted so far is a complete match (an end-of-sequence token is allowed)."""
        return self.active and self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None

    def fill(self, bitmask_row: np.ndarray | torch.Tensor) -> None:
        """Fill a contiguous int32 CPU row with the allowed next tokens (bit t%32 of word t//32)."""
        row = _host_row(bitmask_row)
        if not self.active:
            row.fill(-1)
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens accepted tokens (tokens matched by the grammar only)."""
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.error}")


def _host_row(row: np.ndarray | torch.Tensor) -> np.ndarray:
    array = row.numpy() if isinstance(row, torch.Tensor) else row
    if array.dtype != np.int32 or array.ndim != 1 or not array.flags.c_contiguous:
        raise ValueError(
            f"bitmask row: expected a contiguous 1-D int32 CPU array, got {array.dtype} "
            f"{array.shape}"
        )
    return array


class GrammarBackend:
    """The model's grammar engine: compiles specs on worker threads (never on the engine's step
    loop), caches the compiled grammars per spec, and fills a batch's bitmask rows in parallel.

    vocab_size is the width of the model's logits (the tokenizer may have fewer tokens: the rest are
    never allowed). eos_token_ids: the tokens that end a sequence once its grammar is complete.
    fill_threads: the batch fill's threads (default: default_fill_threads()); families: the most
    copies of one grammar built to fill in parallel, grown while sequences use it (CompiledGrammar;
    default: default_families())."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        compile_threads: int = 2,
        fill_threads: int | None = None,
        families: int | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        if not eos_token_ids:
            raise ValueError("eos_token_ids: a grammar needs at least one end-of-sequence token")
        self._tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._fill_threads = fill_threads or default_fill_threads()
        self._families = families or default_families(self._fill_threads)
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the cache
        self._build_lock = threading.Lock()  # the tokenizer table and the fill executor, built once
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._tokenizer: Any = None
        self._executor: Any = None

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], **kwargs: Any
    ) -> GrammarBackend:
        """From the engine's Tokenizer (engine/tokenizer.py): its tokenizers JSON, added tokens
        included (without padding or truncation, which would change how the grammar engine
        tokenizes)."""
        from tokenizers import Tokenizer as RawTokenizer

        raw = RawTokenizer.from_str(tokenizer.backend.to_str())
        raw.no_padding()
        raw.no_truncation()
        return cls(raw.to_str(), vocab_size, eos_token_ids, **kwargs)

    @property
    def fill_threads(self) -> int:
        return self._fill_threads

    @property
    def families(self) -> int:
        """The most copies a grammar compiled from now on grows to (CompiledGrammar)."""
        return self._families

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: one bit per token of the logits."""
        return (self.vocab_size + 31) // 32

    def _ll_tokenizer(self) -> Any:
        with self._build_lock:
            if self._tokenizer is None:
                import llguidance

                # Built once, on first use (about a second for a 128k vocabulary): never on the
                # start path.
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        import llguidance

        def refuse(
            message: str,
        ) -> ValueError:  # one line: llguidance's messages draw carets on several
            return ValueError(f"structured_outputs.{spec.kind}: {' '.join(message.split())}")

        tokenizer = self._ll_tokenizer()
        try:
            grammar = spec.grammar_text()
        except (ValueError, TypeError) as exc:
            raise refuse(str(exc)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise refuse(error)
        template = self._template(grammar)
        if template.is_error():
            raise refuse(template.get_error())
        return CompiledGrammar(
            spec,
            template,
            max_families=self._families,
            schedule=self._schedule,
            build_family=functools.partial(self._template, grammar),
        )

    def _template(self, grammar: str) -> Any:
        """A new LLMatcher at the grammar's start, with a lexer of its own."""
        import llguidance

        # Quiet and terse: a matcher's errors name the token, never dump the schema or parser state
        # to logs.
        limits = llguidance.LLParserLimits(verbose_errors=False)
        return llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0, limits=limits)

    def _schedule(self, task: Callable[[], None]) -> bool:
        """Run task on a compile thread, behind the compiles asked before it; False once closed."""
        try:
            self._pool.submit(task)
        except RuntimeError:
            return False
        return True

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """The compiled grammar of spec, as a future: from the cache, or compiled on a worker
        thread. A spec the engine cannot compile ends its future in ValueError naming
        structured_outputs.<kind>."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """submit(spec) and wait for it."""
        return self.submit(spec).result()

    def fill_bitmask(
        self, bitmask: np.ndarray | torch.Tensor, matchers: Sequence[GrammarMatcher | None]
    ) -> bool:
        """Fill rows [0, len(matchers)) of a CPU int32 [rows, bitmask_words] bitmask: a row without
        a matcher (or one not active yet) allows every token; the others are computed in parallel.
        Returns whether any row constrains its token (when not, the logits need no masking)."""
        array = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
        if array.dtype != np.int32 or array.ndim != 2 or not array.flags.c_contiguous:
            raise ValueError(
                f"bitmask: expected a contiguous 2-D int32 CPU array, got {array.dtype} "
                f"{array.shape}"
            )
        if array.shape[1] != self.bitmask_words or array.shape[0] < len(matchers):
            raise ValueError(
                f"bitmask: expected at least [{len(matchers)}, {self.bitmask_words}], "
                f"got {list(array.shape)}"
            )
        active = []
        for i, m in enumerate(matchers):
            if m is None or not m.active:
                array[i].fill(-1)
            else:
                active.append((m, i))
        if len(active) == 1:
            matcher, row = active[0]
            matcher.fill(array[row])
        elif active:
            # Rows of one family wait on one lexer: given in family order, the executor's threads,
            # which split the list into runs, mostly take a family each.
            active.sort(key=lambda pair: pair[0].family)
            pairs = [(m._matcher, i) for m, i in active]
            self._fill_executor().unsafe_compute_mask_ptr(
                pairs, array.ctypes.data, array.shape[1] * 4, array.shape[0]
            )
        return bool(active)

    def use_fill_threads(self, threads: int | None, families: int | None = None) -> None:
        """The batch fill's thread count from the next fill on (None: default_fill_threads()), and
        the families of the grammars compiled from now on (None: default_families())."""
        with self._build_lock:
            self._fill_threads = threads or default_fill_threads()
            self._families = families or default_families(self._fill_threads)
            self._executor = None

    def _fill_executor(self) -> Any:
        with self._build_lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(num_threads=self._fill_threads)
            return self._executor

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def default_fill_threads() -> int:
    """The batch fill's threads by default: llguidance's own rule, 80 % of the cores this process
    may run on, 1 to 32."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(32, (cores or 1) * 80 // 100))


def default_families(fill_threads: int) -> int:
    """Copies of each grammar (CompiledGrammar) for a fill on fill_threads threads: two per thread,
    so that a thread rarely waits on a lexer another thread holds (docs/structured-outputs.md has
    the sweep); one when the fill has one thread."""
    return 1 if fill_threads <= 1 else 2 * fill_threads
