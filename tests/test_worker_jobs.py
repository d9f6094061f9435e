"""The worker's job handler in-process on the real engine: cancellation frees KV blocks, the SIGTERM
grace deadline aborts what is left, a dead engine fails the jobs in flight and exits 1, and
admission follows free KV capacity.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from engine import SamplingParams
from handler.admission import Admission
from handler.config import load_settings
from handler.engine_boot import EngineBoot
from handler.jobs import BatchSizes, EngineJob, JobInputError, parse_job
from handler.worker import Worker

LONG_JOB = {
    "prompt": "Count from one to a thousand:",
    "stream": True,
    "sampling_params": {"temperature": 0, "max_tokens": 1000, "ignore_eos": True},
}


class Exits:
    """Stands in for os._exit so a test can see the status the worker would exit with."""

    def __init__(self):
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def _boot(model_dir: str, **env) -> EngineBoot:
    settings = load_settings(
        {"MODEL_NAME": model_dir, "MAX_MODEL_LEN": "2048", "DEVICE": "cpu", **env}
    )
    return EngineBoot(settings)


@pytest.fixture(scope="module")
def boot(smollm2_dir):
    b = _boot(smollm2_dir)
    b.load_blocking()
    yield b
    b.engine_now().shutdown()


def _worker(boot: EngineBoot, **admission) -> tuple[Worker, Exits]:
    exits = Exits()
    adm = Admission(
        boot.settings.max_concurrency,
        boot,
        exit_fn=exits,
        occupancy=lambda: 0,
        exit_wait_s=2,
        **admission,
    )
    return Worker(boot.settings, boot, adm), exits


async def _wait_all_free(engine, timeout=30.0):
    total = engine.stats().num_kv_blocks
    for _ in range(int(timeout / 0.05)):
        stats = engine.stats()
        if stats.num_free_blocks == total and stats.num_running == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_closing_a_job_mid_stream_frees_its_blocks(boot):
    """The SDK cancels a stopped job's task; a generator left at a yield is closed: both end the
    engine request."""
    worker, _ = _worker(boot)
    engine = boot.engine_now()
    job = worker.handle({"id": "close-me", "input": LONG_JOB})
    first = await anext(job)
    assert first["choices"][0]["tokens"]
    assert engine.stats().num_running == 1
    await job.aclose()
    assert await _wait_all_free(engine)
    assert worker.admission.tickets == {}


async def test_cancelling_a_job_task_frees_its_blocks(boot):
    worker, _ = _worker(boot)
    engine = boot.engine_now()
    seen = asyncio.Event()

    async def consume():
        async for _ in worker.handle({"id": "cancel-me", "input": LONG_JOB}):
            seen.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(seen.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _wait_all_free(engine)


async def test_drain_deadline_aborts_what_is_left_then_exits_0(boot):
    worker, exits = _worker(boot, grace_s=0.5)
    engine = boot.engine_now()
    outputs = []

    async def consume():
        async for item in worker.handle({"id": "slow", "input": LONG_JOB}):
            outputs.append(item)
            if len(outputs) == 1:
                worker.admission.begin_drain()

    await asyncio.wait_for(consume(), 120)
    assert "did not finish within" in outputs[-1]["error"]
    assert await _wait_all_free(engine)
    for _ in range(100):
        if exits.codes:
            break
        await asyncio.sleep(0.05)
    assert exits.codes == [0]


async def test_admission_follows_free_kv_blocks(boot):
    worker, _ = _worker(boot)
    adm = worker.admission
    engine = boot.engine_now()
    stats = engine.stats()
    block = boot.settings.block_size
    adm.max_concurrency = 10_000
    adm.typical_tokens = 256
    # Idle: as many typical requests as the whole cache holds; also down from MAX_CONCURRENCY, the
    # value at start-up.
    assert adm.concurrency_modifier(1) == stats.num_kv_blocks // (256 // block)
    assert adm.concurrency_modifier(10_000) == stats.num_kv_blocks // (256 // block)
    # Bounded by MAX_CONCURRENCY; a typical request is never planned larger than the context limit.
    adm.max_concurrency = 3
    assert adm.concurrency_modifier(1) == 3
    adm.max_concurrency = 10_000
    adm.typical_tokens = 10**9
    assert adm.concurrency_modifier(5) == stats.num_kv_blocks // (2048 // block)
    # Requests served move the typical size: small ones raise the admitted count.
    adm.max_concurrency, adm.typical_tokens = 10_000, 2048
    before = adm.concurrency_modifier(1)
    for _ in range(50):
        adm.observe(16, 16)
    assert adm.concurrency_modifier(before) > before


async def test_admission_before_the_engine_is_up(smollm2_dir):
    boot = _boot(smollm2_dir, MAX_CONCURRENCY="7")  # never started: the engine is not there yet
    adm = Admission(7, boot, occupancy=lambda: 0)
    assert adm.concurrency_modifier(1) == 7


async def test_dead_engine_fails_jobs_in_flight_and_exits_1(smollm2_dir):
    boot = _boot(smollm2_dir)
    engine = boot.load_blocking()
    worker, exits = _worker(boot)
    core_step = engine.engine.step
    steps = 0

    def failing_step():
        nonlocal steps
        steps += 1
        if steps > 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return core_step()

    engine.engine.step = failing_step  # a fault of the machine, injected into the real engine loop
    outputs = [item async for item in worker.handle({"id": "doomed", "input": LONG_JOB})]
    assert "engine failed" in outputs[-1]["error"]
    later = [item async for item in worker.handle({"id": "after", "input": {"prompt": "hi"}})]
    assert "restarting" in later[-1]["error"]
    for _ in range(100):
        if exits.codes:
            break
        await asyncio.sleep(0.05)
    assert exits.codes == [1]


def test_batch_sizes_grow_to_the_cap():
    settings = load_settings({})
    sizes = BatchSizes.for_job(EngineJob(prompt="x"), settings).sizes()
    # DEFAULT_* of worker-vllm: 1, x3, 50
    assert [next(sizes) for _ in range(6)] == [1, 3, 9, 27, 50, 50]
    sizes = BatchSizes.for_job(
        EngineJob(prompt="x", min_batch_size=4, batch_size_growth_factor=2, max_batch_size=20),
        settings,
    ).sizes()
    assert [next(sizes) for _ in range(5)] == [4, 8, 16, 20, 20]


def _nested(depth: int) -> list:
    """A list nested `depth` levels deep."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


HI = [{"role": "user", "content": "x"}]
TOOL = {"type": "function"}


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"prompt": "x", "max_batch_size": 0}, "input.max_batch_size"),
        ({"prompt": "x", "stream": "yes"}, "input.stream"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "input.messages[0].role"),
        ({"messages": []}, "input.messages"),
        ({"prompt": [1, -2]}, "input.prompt"),
        ({"prompt": "x", "sampling_params": {"n": 0}}, "input.sampling_params.n"),
        (
            {"prompt": "x", "sampling_params": {"max_tokens": 10**9}},
            "input.sampling_params.max_tokens",
        ),
        (
            {"prompt": "x", "sampling_params": {"repetition_penalty": 1e-300}},
            "input.sampling_params.repetition_penalty",
        ),
        (
            {"prompt": "x", "sampling_params": {"logprobs": 2}},
            "input.sampling_params.logprobs: worker-vllm's",
        ),
        (
            {"prompt": "x", "sampling_params": {"best_of": 2}},
            "input.sampling_params.best_of: unknown field",
        ),
        ({"messages": HI, "tools": [TOOL]}, "input.tools[0].function: field required"),
        (
            {"messages": HI, "sampling_params": {"tool_choice": "auto"}},
            "input.sampling_params.tool_choice: needs tools",
        ),
        ({"prompt": "x", "tools": [TOOL]}, "input.tools: tools need a chat request"),
        (
            {"prompt": "x", "apply_chat_template": True, "sampling_params": {"stop": 5}},
            "input.sampling_params.stop",
        ),
        ({"prompt": "a\ud800", "apply_chat_template": True}, "input.prompt: invalid unicode"),
        ({"openai_route": 7}, "input.openai_route"),
        ({"openai_route": "/v1/models", "openai_input": []}, "input.openai_input"),
        (
            {"openai_route": "/v1/chat/completions", "openai_input": {}},
            "input.openai_input.messages: field required",
        ),
        ({"openai_route": "/v1/embeddings"}, "input.openai_route: unknown route"),
        ({"prompt": "x", "sampling_params": {"stop": [["a"]]}}, "input.sampling_params.stop"),
        (
            {"messages": [{"role": "user", "content": "x", "meta": _nested(100)}]},
            "input.messages: objects and lists nested deeper than the limit of 64",
        ),
        (
            {"prompt": "x", "sampling_params": {"stop": _nested(64)}},
            "input.sampling_params.stop: objects and lists",
        ),
        (
            {"prompt": "x", "min_batch_size": _nested(10_000)},
            "input.min_batch_size: objects and lists",
        ),
        (None, "input: must be an object"),
    ],
)
def test_bad_job_inputs_name_the_field(raw, field):
    with pytest.raises(JobInputError, match="^" + re.escape(field)):
        parse_job(raw)


@pytest.mark.parametrize(
    "raw, status, param, words",
    [
        ({"route": "/v1/chat/completions"}, 405, "method", ["GET", "POST", "send a body"]),
        ({"route": "/v1/models", "method": "post"}, 405, "method", ["POST", "GET"]),
        (
            {"route": "/v1/embeddings", "body": {"input": "x"}},
            404,
            "route",
            ["/v1/embeddings", "/v1/completions"],
        ),
        (
            {"route": "/v1/completions", "body": {"prompt": "x"}, "method": "PUT"},
            400,
            "method",
            ["PUT"],
        ),
        (
            {"route": "/v1/chat/completions", "body": {"messages": "hi"}},
            400,
            "messages",
            ["messages", "list"],
        ),
        (
            {"route": "/v1/chat/completions", "body": {"messages": HI, "tools": [{}]}},
            400,
            "tools[0].function",
            ["field required"],
        ),
        (
            {"route": "/v1/completions", "body": {"prompt": "x"}, "stream": True},
            400,
            "stream",
            ["unknown field"],
        ),
    ],
)
def test_route_form_errors_are_openai_error_objects(raw, status, param, words):
    """worker-vllm v2.24+ answers `{"error": {"message", "type", "code"}}` for this form; here the
    OpenAI error object the HTTP face sends (the same keys, with the field at fault as `param`)."""
    with pytest.raises(JobInputError) as err:
        parse_job(raw)
    error = err.value.error
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (status, param), error
    for word in words:
        assert word in error["message"], error


def test_route_form_method_follows_worker_vllm():
    """No method: a body POSTs, no body GETs (worker-vllm's _normalize_job_input); the method is
    case-insensitive; routes are taken as RunPod's /openai/v1 paths give them."""
    body = {"prompt": "x"}
    assert parse_job({"route": "/v1/models"}).method == "GET"
    assert parse_job({"route": "/openai/v1/completions/", "body": body}).route == "/v1/completions"
    assert parse_job({"route": "/v1/completions", "body": body}).method == "POST"
    assert parse_job({"route": "v1/models", "method": "get"}).method == "GET"


async def test_default_max_tokens_fills_in_within_the_context(boot, smollm2_dir):
    from handler.routes import OpenAIRoutes

    settings = load_settings(
        {
            "MODEL_NAME": smollm2_dir,
            "MAX_MODEL_LEN": "2048",
            "DEVICE": "cpu",
            "DEFAULT_MAX_TOKENS": "77",
        }
    )
    engine = boot.engine_now()
    routes = OpenAIRoutes(engine, settings, boot.served_names)
    job = parse_job({"prompt": "x"})
    assert (await routes.prepare(job.route, job.body)).params.max_tokens == 77
    job = parse_job({"prompt": "x", "sampling_params": {"max_tokens": 5}})
    assert (await routes.prepare(job.route, job.body)).params == SamplingParams(max_tokens=5)
    unset = OpenAIRoutes(engine, boot.settings, boot.served_names)
    never_16 = await unset.prepare(job.route, {"prompt": "x"})
    assert never_16.params.max_tokens is None
    # DEFAULT_MAX_TOKENS never goes past the context limit
    long = parse_job({"prompt": "hello " * 1980})
    request = await routes.prepare(long.route, long.body)
    assert request.params.max_tokens == 2048 - len(request.prompts[0]) < 77


async def test_use_openai_format_answers_as_the_openai_route(boot):
    """worker-vllm's use_openai_format: the same job, answered with the chat route's objects."""
    worker, _ = _worker(boot)
    job = {
        "messages": [{"role": "user", "content": "Name a color."}],
        "sampling_params": {"max_tokens": 6, "temperature": 0},
    }
    (batch,) = [c async for c in worker.handle({"id": "plain", "input": job})]
    as_openai = {**job, "use_openai_format": True}
    (whole,) = [c async for c in worker.handle({"id": "oa", "input": as_openai})]
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == batch["choices"][0]["tokens"][0]
    assert whole["usage"]["completion_tokens"] == batch["usage"]["output"]


async def test_openai_stream_as_chunk_objects_when_raw_output_is_off(boot, smollm2_dir):
    settings = load_settings(
        {
            "MODEL_NAME": smollm2_dir,
            "MAX_MODEL_LEN": "2048",
            "DEVICE": "cpu",
            "RAW_OPENAI_OUTPUT": "0",
        }
    )
    worker = Worker(settings, boot, Admission(8, boot, occupancy=lambda: 0))
    body = {
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = [
        c
        async for c in worker.handle(
            {"id": "a", "input": {"openai_route": "/v1/chat/completions", "openai_input": body}}
        )
    ]
    batches = [
        c
        async for c in worker.handle(
            {
                "id": "b",
                "input": {
                    "openai_route": "/openai/v1/chat/completions",
                    "openai_input": {**body, "stream": True},
                },
            }
        )
    ]
    assert all(isinstance(b, list) and all(isinstance(c, dict) for c in b) for b in batches)
    # Chunk counts per batch grow 1, 3, 9 ... (DEFAULT_MIN_BATCH_SIZE, x
    # DEFAULT_BATCH_SIZE_GROWTH_FACTOR); no [DONE].
    assert [len(b) for b in batches[:-1]] == [1, 3, 9][: len(batches) - 1]
    deltas = "".join(c["choices"][0]["delta"].get("content") or "" for b in batches for c in b)
    assert deltas == whole[0]["choices"][0]["message"]["content"]
