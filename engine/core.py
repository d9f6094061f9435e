"""The engine core: requests in, one scheduled model step at a time, cumulative outputs back.

It validates requests, turns each into n sequences, runs scheduler -> runner -> sampler, applies the
stop rules and detokenizes. The sync LLM and the AsyncLLM fronts (engine/llm.py) drive it; it knows
no threads or asyncio.
"""

from __future__ import annotations

import gc
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Union

import torch

from engine.config import EngineArgs, ModelConfig, resolve_dtype
from engine.detokenizer import IncrementalDetokenizer
from engine.kv import KVCacheManager
from engine.outputs import (
    CompletionOutput,
    EngineStats,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from engine.runner import LaunchedStep, ModelRunner
from engine.sampling import SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Request, Sequence, SequenceStatus

if TYPE_CHECKING:  # the engine without a tokenizer (skip_tokenizer_init) never loads one
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids" (as vLLM accepts).
PromptType = Union[str, list[int], dict[str, Any]]


class RequestFailed(RuntimeError):
    """One request failed (and was aborted) while the engine stays healthy; the others go on."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


def model_limits(args: EngineArgs, device: torch.device) -> tuple[ModelConfig, int, torch.dtype]:
    """The model's config, context limit and dtype with which the engine runs `args` on `device`."""
    m = ModelConfig.from_dir(args.model)
    max_model_len = args.max_model_len or m.max_position_embeddings
    if max_model_len > m.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"({m.max_position_embeddings})"
        )
    m = m.serving(max_model_len)  # longrope picks its factors by the context served
    return m, max_model_len, resolve_dtype(args.dtype, m, device)


class EngineCore:
    def __init__(self, args: EngineArgs):
        args.validate()
        self.args = args
        self.device = args.torch_device()
        self.model_config, self.max_model_len, self.dtype = model_limits(args, self.device)
        m = self.model_config
        self.tokenizer = self._load_tokenizer()
        self.ranks = None  # tensor parallelism: the other ranks' processes (distributed.launch)
        try:
            tp = self._connect_ranks()  # rank 0 of several: self.device becomes cuda:0
            self.runner = ModelRunner(args, m, self.dtype, self.device, self.max_model_len, tp)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = self.runner.num_blocks
        # A sequence can grow to max_model_len, or to what the whole cache holds if that is less.
        self.context_limit = min(self.max_model_len, self.num_kv_blocks * args.block_size)
        self.kv = KVCacheManager(self.num_kv_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        self.eos_token_ids = set(m.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        # Async scheduling (default on a GPU): step N+1 is scheduled and launched before step N's
        # tokens are read.
        self.async_scheduling = (
            args.async_scheduling
            if args.async_scheduling is not None
            else self.device.type == "cuda"
        )
        self._in_flight: LaunchedStep | None = None  # launched, its tokens not read yet
        self._undelivered: list[
            RequestOutput
        ] = []  # outputs of a step read back when the next launch failed
        # A step read back early, inside the next step's launch (its grammar rows needed its
        # tokens): its outputs go out with that step's.
        self._read_early: list[RequestOutput] | None = None
        self._grammars = None  # engine.structured.GrammarBackend, made by the first grammar
        self._grammars_lock = threading.Lock()
        self._rng = random.Random(args.seed)
        self._next_seq_id = 0
        self._next_arrival = 0
        log.info(
            "engine ready: %s (%s) dtype=%s device=%s weights %.2fs, KV %d blocks x %d tokens, "
            "context limit %d",
            args.model,
            m.architecture,
            self.dtype,
            self.device,
            self.runner.load_seconds,
            self.num_kv_blocks,
            args.block_size,
            self.context_limit,
        )
        # What start-up built (modules, the model, tokenizer tables) lives as long as the process:
        # moved out of the cyclic GC's reach, a collection during serving walks only what serving
        # allocates (fewer step stalls).
        gc.freeze()

    def _connect_ranks(self):
        """Tensor parallelism: start (or take over) ranks 1..N-1 and join them; this process is rank
        0."""
        n = self.args.tensor_parallel_size
        if n == 1:
            return None
        from engine.distributed.launch import attach_ranks
        from engine.distributed.sharding import Shard

        Shard(0, n).check(self.model_config)
        if self.device.type == "cuda":
            if torch.cuda.device_count() < n:
                raise ValueError(
                    f"tensor_parallel_size: {n} needs {n} GPUs, this process sees "
                    f"{torch.cuda.device_count()}"
                )
            self.device = torch.device("cuda", 0)
        self.ranks = attach_ranks(n, self.device.type)
        tp = self.ranks.connect(self.args, self.device, self.dtype)
        # A collective waiting on a dead rank returns an error instead.
        self.ranks.on_death(lambda _: tp.comm.abort())
        return tp

    def on_rank_death(self, listener) -> None:
        """Tensor parallelism: call listener(exc) when another rank's process dies (the engine
        cannot go on)."""
        if self.ranks is not None:
            self.ranks.on_death(listener)

    def shutdown(self, idle: bool = True) -> None:
        """Stop the other ranks (tensor parallelism); nothing to do on one device. idle: no step is
        running (the ranks are told to stop; else they are only made to exit)."""
        ranks, self.ranks = self.ranks, None
        if ranks is None:
            return
        runner = getattr(self, "runner", None)
        if idle and ranks.dead is None and runner is not None:
            try:
                runner.close()
            except Exception as e:  # noqa: BLE001 - the ranks are stopped below either way
                log.debug("tensor parallel: could not send stop: %s", e)
        ranks.stop()
        from engine.distributed.comm import leave

        leave()

    def _load_tokenizer(self) -> Tokenizer | None:
        if self.args.skip_tokenizer_init:
            return None
        return self._read_tokenizer()

    def _read_tokenizer(self) -> Tokenizer | None:
        from engine.tokenizer import load_if_present

        path = self.args.tokenizer or self.args.model
        tokenizer = load_if_present(path, self.args.chat_template)
        if tokenizer is None:
            log.warning(
                "no tokenizer.json in %s: prompts must be token ids and outputs carry no text", path
            )
        return tokenizer

    # ---- requests
    # ------------------------------------------------------------------------------------------
    @property
    def grammars(self):
        """The model's engine.structured.GrammarBackend (made on first use; its tokenizer table on
        the first compile): `grammars.submit(spec)` compiles a request's grammar off the step loop.
        ValueError for a model without a tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                tokenizer = self.tokenizer
                if tokenizer is None and self.args.skip_tokenizer_init:
                    tokenizer = self._read_tokenizer()  # the caller detokenizes: loaded now
                if tokenizer is None:
                    raise ValueError(
                        "structured_outputs: this model has no tokenizer.json, so it has no grammar"
                    )
                from engine.structured import GrammarBackend

                self._grammars = GrammarBackend.from_tokenizer(
                    tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
                )
            return self._grammars

    def add_eos_token_ids(self, token_ids: list[int]) -> None:
        """More tokens that end a sequence: the tokenizer's own end-of-sequence token, from a caller
        that holds the tokenizer (skip_tokenizer_init). Before the first request."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"eos_token_ids: token ids must be in [0, {vocab}), got {bad}")
        self.eos_token_ids.update(token_ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt in any accepted form -> (text or None, token ids), validated against the
        vocabulary."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = next(
                (
                    t
                    for t in ids
                    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                ),
                None,
            )
            if bad is not None:
                raise ValueError(
                    f"prompt_token_ids: every id must be an integer in [0, {vocab}), got {bad!r}"
                )
        else:
            raise ValueError(
                f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt: must not be empty")
        return text, ids

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> Request:
        """Validate and queue a request. Raises ValueError naming the field for anything the engine
        can't serve."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        params.validate()
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop: stop strings need a tokenizer and this model has none; use stop_token_ids"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {bad}")
        # a grammar compiled already (AsyncLLM submits it first) is taken from the cache
        grammar = (
            self.grammars.compile(params.structured_outputs)
            if params.structured_outputs is not None
            else None
        )
        text, ids = self.tokenize(prompt)
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len} "
                f"(the prompt must be at most {self.max_model_len - 1} tokens)"
            )
        if len(ids) + 1 > self.context_limit:
            raise ValueError(
                f"prompt: {len(ids)} tokens need {self.kv.blocks_for(len(ids) + 1)} KV blocks "
                f"but the whole cache has {self.num_kv_blocks} (of {self.args.block_size} tokens); "
                f"at most {self.context_limit - 1} tokens fit"
            )
        req = Request(
            request_id=request_id,
            arrival_order=self._next_arrival,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time=time.time()),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        self._next_arrival += 1
        for index in range(params.n):
            seq = Sequence(
                seq_id=self._next_seq_id,
                request=req,
                index=index,
                token_ids=list(ids),
                num_prompt_tokens=len(ids),
                max_total_tokens=self.context_limit,
                generator=self._generator(params, index),
                detokenizer=self._detokenizer(params),
                parent=req.seqs[0] if index else None,
                logprobs=[] if params.logprobs is not None else None,
                grammar=grammar.matcher(params.structured_outputs.start_after_token)
                if grammar is not None
                else None,
            )
            self._next_seq_id += 1
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.is_greedy:
            return None
        # Seeded: sample i of a request uses seed + i. Unseeded: a seed drawn from the engine's own
        # seeded RNG.
        seed = params.seed + index if params.seed is not None else self._rng.getrandbits(63)
        return torch.Generator(device=self.device).manual_seed(seed & ((1 << 63) - 1))

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every sample of the request with reason "abort" and free its blocks now."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        req.metrics.finished_time = time.time()
        return self._output(req)

    def _fail_for_memory(self, scheduled) -> "RequestFailed":
        """A step ran out of device memory: abort the request that asked most of it (the largest
        chunk of new tokens, else the longest context) so the others go on; nothing was computed, so
        they just run again."""
        seq = max(scheduled, key=lambda s: (s.num_new_tokens, s.seq.num_computed_tokens)).seq
        victim = seq.request
        message = (
            f"out of device memory running this request ({seq.num_prompt_tokens} prompt tokens); "
            f"it was aborted and the engine goes on"
        )
        log.warning("request %s: %s", victim.request_id, message)
        self.abort(victim.request_id)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return RequestFailed(victim.request_id, message)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self._in_flight is not None
            or bool(self._undelivered)
        )

    # ---- the step
    # ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step whose tokens just became
        known.

        With async scheduling the step launched here is read back on the next call: its host work
        (scheduling, inputs) ran while the previous step was on the device, and that step's tokens
        are detokenized and checked for stops while this one is. A sequence that stops is found one
        step late; the token its extra step samples is dropped."""
        outputs, self._undelivered = self._undelivered, []
        in_flight = self._in_flight
        if in_flight is not None and in_flight.needs_host_tokens:
            # Penalties need every generated id on the host: finish the step in flight before
            # scheduling.
            self._in_flight = None
            outputs += self._finish_step(in_flight)
            in_flight = None
        sched = self.scheduler.schedule()
        try:
            launched = self._launch(sched) if sched else None
        except RequestFailed:
            if self._read_early is not None:  # the step in flight was read inside the failed launch
                self._in_flight = None
                outputs += self._read_early
                self._read_early = None
            # one request failed; the others' outputs go out with the next step
            self._undelivered = outputs
            raise
        if in_flight is not None:
            self._in_flight = None
            early, self._read_early = self._read_early, None
            outputs += early if early is not None else self._finish_step(in_flight)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                outputs += self._finish_step(launched)
        elif not outputs and in_flight is None and self.scheduler.has_unfinished():
            # A bug, never a state to wait out: fail loudly, don't spin.
            raise RuntimeError(f"scheduler stalled with unfinished requests: {self.stats()}")
        return outputs

    def _launch(self, sched) -> LaunchedStep:
        """Run the runner on a scheduled step (without waiting for the device) and advance the
        sequences' counters; a sequence that samples counts one pending token until the step's
        result is read."""
        rows: dict[int, SamplingRow] = {}
        needs_host_tokens = False
        grammar_rows = False
        for s in sched.scheduled:
            if s.completes:
                seq = s.seq
                row = rows[seq.seq_id] = self._sampling_row(seq)
                p = row.params
                if (
                    p.repetition_penalty != 1.0
                    or p.presence_penalty != 0
                    or p.frequency_penalty != 0
                ):
                    needs_host_tokens = True
                grammar_rows = grammar_rows or seq.grammar is not None
        if self.ranks is not None and self.ranks.dead is not None:
            raise self.ranks.dead
        fill_masks = self._fill_masks if grammar_rows else None
        try:
            launched = self.runner.execute(sched.scheduled, rows, self._in_flight, fill_masks)
        except torch.OutOfMemoryError as exc:
            if self.ranks is not None:  # the other ranks are in this step's collectives: no way out
                raise RuntimeError(
                    "out of device memory in a tensor-parallel step; the engine stops"
                ) from exc
            raise self._fail_for_memory(sched.scheduled) from exc
        launched.needs_host_tokens = needs_host_tokens
        now = time.time()
        for s in sched.scheduled:
            seq = s.seq
            req = seq.request
            if seq.status is SequenceStatus.FINISHED:
                continue  # stopped by the step read early inside this launch
            if req.metrics.first_scheduled_time is None:
                # first admission: what the prefix cache served
                req.metrics.first_scheduled_time = now
                req.num_cached_tokens = seq.num_computed_tokens
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(seq)
            if seq.seq_id in launched.prompt_logprobs:
                req.prompt_logprobs.extend(self._decoded(launched.prompt_logprobs[seq.seq_id]))
        for seq in launched.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.num_pending += 1
        return launched

    def _fill_masks(self, bitmask, matchers: list) -> bool:
        """The runner's call, once this step's model is queued: read the step in flight (its tokens
        are the grammars' next input), then fill the grammar rows of the host bitmask."""
        in_flight = self._in_flight
        if in_flight is not None and self._read_early is None:
            self._read_early = self._finish_step(in_flight)
        return self.grammars.fill_bitmask(bitmask, matchers)

    def _finish_step(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens back, append them, apply the stop rules and build the
        outputs."""
        sampled = launched.result()
        touched: dict[str, Request] = {}
        for seq, token, logprobs in zip(launched.seqs, sampled.token_ids, sampled.logprobs):
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted, or stopped by the step before: its extra token is dropped
            seq.num_pending -= 1
            self._append_token(seq, token, logprobs)
            if seq.status is not SequenceStatus.FINISHED:
                self.kv.cache_full_blocks(seq)  # blocks whose last token was pending until now
            touched[seq.request.request_id] = seq.request
        outputs = []
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = time.time()
                self.requests.pop(req.request_id, None)
            outputs.append(self._output(req))
        return outputs

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.request.params
        banned: list[int] = []
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids or [])
            if not p.ignore_eos:
                banned.extend(self.eos_token_ids)
        return SamplingRow(
            params=p,
            generator=seq.generator,
            # shared by the request's samples: no copy
            prompt_token_ids=seq.request.prompt_token_ids,
            output_token_ids=seq.output_token_ids
            if p.presence_penalty or p.frequency_penalty or (p.repetition_penalty != 1.0)
            else [],  # read only by the penalties
            banned_token_ids=banned,
            grammar=seq.grammar,
        )

    def _append_token(self, seq: Sequence, token: int, logprobs: PositionLogprobs | None) -> None:
        seq.token_ids.append(token)
        req = seq.request
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(self._decoded([logprobs])[0])
            seq.cumulative_logprob += logprobs[token].logprob
        if seq.grammar is not None and not seq.grammar.accept(token):
            log.warning(
                "request %s: token %d was allowed by its grammar's mask but refused by its "
                "matcher (%s); the rest of the reply is not constrained",
                req.request_id,
                token,
                seq.grammar.error,
            )
        detok = seq.detokenizer
        p = req.params
        ends = token in self.eos_token_ids and not p.ignore_eos
        if detok is not None and not (ends and not p.include_stop_str_in_output):
            # the end-of-sequence token that ends the output is not part of its text (as in vLLM),
            # whether or not special tokens are skipped
            detok.add(token)
        if detok is not None and detok.stop_reason is not None:
            self.scheduler.finish(seq, "stop", detok.stop_reason)
        elif ends:
            self.scheduler.finish(seq, "stop")
        elif p.stop_token_ids and token in p.stop_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif seq.at_length_limit(len(seq.token_ids)):
            self.scheduler.finish(seq, "length")

    def _decoded(self, positions: list[PositionLogprobs | None]) -> list[PositionLogprobs | None]:
        if self.tokenizer is not None:
            for pos in positions:
                for token_id, lp in (pos or {}).items():
                    lp.decoded_token = self.tokenizer.decode_token(token_id)
        return positions

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            done = seq.status is SequenceStatus.FINISHED
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.output_text(done) if seq.detokenizer is not None else "",
                    token_ids=seq.token_ids[
                        seq.num_prompt_tokens :
                    ],  # a new list: later tokens never show up in it
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            outputs=outs,
            finished=req.finished,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
        )

    def capture_cuda_graphs(self) -> float:
        """Capture every decode graph size not captured yet (lazy capture otherwise takes each on
        its first step); the seconds it took, 0 without graphs. Benchmarks call it before timing
        anything."""
        if self.runner.graphs is None:
            return 0.0
        t0 = time.perf_counter()
        self.runner.capture_graphs()
        return time.perf_counter() - t0

    def stats(self) -> EngineStats:
        kv = self.kv.stats()
        return EngineStats(
            num_kv_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            peak_used_blocks=kv.peak_used_blocks,
            prefix_cache_queried_tokens=kv.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=kv.prefix_cache_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
        )
