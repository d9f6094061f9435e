"""engine/structured.py with the SmolLM2 demo's real tokenizer: specs, compile cache, matchers, the
batch bitmask and its application to logits. Outputs of grammar-constrained random "models" are
checked by references we did not write: jsonschema, re.fullmatch, json.loads.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import re
import textwrap
import threading
import time
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import torch

from child_process import run_in_triton_interpreter
from engine.structured import GrammarBackend, StructuredOutputs
from engine.token_bitmask import allocate_bitmask, apply_token_bitmask
from engine.tokenizer import Tokenizer

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 50},
        "color": {"enum": ["red", "green", "blue"]},
        "gift": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ship": {
            "type": "object",
            "properties": {
                "zone": {"$ref": "#/$defs/zone"},
                "floor": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
            },
            "required": ["zone", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "qty", "color", "gift", "tags", "ship"],
    "additionalProperties": False,
    "$defs": {"zone": {"enum": ["eu", "us", "asia"]}},
}


@pytest.fixture(scope="module")
def tok(smollm2_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def vocab(smollm2_dir: str) -> int:
    with open(f"{smollm2_dir}/config.json") as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module")
def backend(tok: Tokenizer, vocab: int):
    b = GrammarBackend.from_tokenizer(tok, vocab, [tok.eos_token_id])
    yield b
    b.close()


def allowed_ids(row: torch.Tensor) -> set[int]:
    """Token ids whose bit is set, read with numpy's own bit order (an independent unpacking)."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def random_walk(
    backend: GrammarBackend,
    tok: Tokenizer,
    spec: StructuredOutputs,
    seed: int,
    max_steps: int = 400,
) -> tuple[str, list[int]]:
    """A random-weight "model" under a grammar: random logits, the bitmask applied, argmax; until an
    end-of-sequence token. Returns the text and the tokens."""
    matcher = backend.compile(spec).matcher()
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, backend.vocab_size)
    out: list[int] = []
    for _ in range(max_steps):
        backend.fill_bitmask(bitmask, [matcher])
        logits = torch.randn(1, backend.vocab_size, generator=gen)
        token = int(apply_token_bitmask(logits, bitmask).argmax())
        assert matcher.accept(token), matcher.error
        if token in backend.eos_token_ids:
            return tok.decode(out), out
        out.append(token)
    raise AssertionError(f"no end of sequence in {max_steps} steps: {tok.decode(out)!r}")


# ---- the spec ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"json": {"type": "object"}, "regex": "a"}, "got json, regex"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json: a JSON schema must be an object"),
        ({"choice": []}, "structured_outputs.choice: must be a non-empty list"),
        ({"choice": ["a", 3]}, "structured_outputs.choice: each choice must be a non-empty string"),
        ({"regex": ""}, "structured_outputs.regex: must be a non-empty string"),
        ({"json_object": "yes"}, "structured_outputs.json_object: must be true"),
        (
            {"grammar": 'start: "a"', "disable_any_whitespace": 1},
            "structured_outputs.disable_any_whitespace: must be a bool",
        ),
        (
            {"json_object": True, "whitespace_pattern": " *", "disable_any_whitespace": True},
            "structured_outputs.whitespace_pattern: give it or disable_any_whitespace, not both",
        ),
    ],
)
def test_spec_refuses_bad_values_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputs(**kwargs)


def test_spec_key_separates_what_compiles_differently():
    a = StructuredOutputs(json={"type": "object"})
    # dict or its text: one grammar
    assert a.key == StructuredOutputs(json='{"type": "object"}').key
    assert a.key != StructuredOutputs(json={"type": "object"}, disable_any_whitespace=True).key
    assert a.key != StructuredOutputs(json={"type": "object"}, whitespace_pattern=" ?").key
    assert a.key != StructuredOutputs(regex='{"type": "object"}').key
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    assert len({a, StructuredOutputs(json='{"type": "object"}')}) == 1


# ---- compiling -----------------------------------------------------------------------------------


def test_compile_runs_on_a_worker_thread_and_is_cached(backend):
    spec = StructuredOutputs(json=ORDER_SCHEMA)
    future = backend.submit(spec)
    assert isinstance(future, Future)
    compiled = future.result(timeout=120)
    assert backend.submit(StructuredOutputs(json=json.dumps(ORDER_SCHEMA))) is future
    assert compiled.spec is spec

    seen: list[str] = []
    original = backend._compile

    def spy(s):
        seen.append(threading.current_thread().name)
        return original(s)

    backend._compile = spy
    try:
        backend.compile(StructuredOutputs(regex="[0-9]{1,4}"))
    finally:
        del backend._compile
    assert len(seen) == 1 and seen[0].startswith("grammar-compile")


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            StructuredOutputs(json={"type": "array", "uniqueItems": True}),
            "structured_outputs.json: .*uniqueItems",
        ),
        (StructuredOutputs(json={"type": "strin"}), "structured_outputs.json: .*strin"),
        (StructuredOutputs(regex="[a-"), "structured_outputs.regex: .*unclosed character class"),
        (
            StructuredOutputs(grammar="start: undefined_rule"),
            "structured_outputs.grammar: .*undefined_rule",
        ),
    ],
)
def test_what_the_engine_cannot_enforce_is_refused_not_ignored(backend, spec, message):
    with pytest.raises(ValueError, match=message):
        backend.compile(spec)


# ---- matching and masks
# ---------------------------------------------------------------------------


def test_a_valid_document_is_accepted_token_by_token_and_each_token_was_allowed(backend, tok):
    text = json.dumps(
        {
            "id": "AB123",
            "qty": 7,
            "color": "green",
            "gift": False,
            "tags": ["x", "yz"],
            "ship": {"zone": "asia", "floor": None},
        }
    )
    ids = tok.encode(text, add_special_tokens=False)
    matcher = backend.compile(StructuredOutputs(json=ORDER_SCHEMA)).matcher()
    bitmask = allocate_bitmask(1, backend.vocab_size)
    for t in ids:
        assert not matcher.can_end
        backend.fill_bitmask(bitmask, [matcher])
        assert t in allowed_ids(bitmask[0])
        assert matcher.accept(t), matcher.error
    assert matcher.can_end and matcher.is_finished
    backend.fill_bitmask(bitmask, [matcher])
    # complete: only the end of sequence is left
    assert allowed_ids(bitmask[0]) == {tok.eos_token_id}
    assert matcher.accept(tok.eos_token_id) and matcher.error is None


def test_a_token_outside_the_grammar_is_refused_with_an_error(backend, tok):
    matcher = backend.compile(StructuredOutputs(json=ORDER_SCHEMA)).matcher()
    assert matcher.accept_tokens(tok.encode('{"id": "AB123", "qty": ', add_special_tokens=False))
    assert not matcher.accept(tok.encode("true", add_special_tokens=False)[0])
    assert "true" in matcher.error


@pytest.mark.parametrize("seed", range(6))
def test_random_model_under_a_json_schema_always_yields_a_valid_document(backend, tok, seed):
    spec = StructuredOutputs(json=ORDER_SCHEMA, disable_any_whitespace=seed % 2 == 0)
    text, _ = random_walk(backend, tok, spec, seed)
    jsonschema.validate(json.loads(text), ORDER_SCHEMA)
    if spec.disable_any_whitespace:  # no whitespace outside the string literals
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), text


@pytest.mark.parametrize("seed", range(3))
def test_random_model_under_regex_choice_grammar_and_json_object(backend, tok, seed):
    text, _ = random_walk(backend, tok, StructuredOutputs(regex=r"(yes|no)-[0-9]{2,4}"), seed)
    assert re.fullmatch(r"(yes|no)-[0-9]{2,4}", text)
    choices = ["Paris", "Tokyo", "New York", "São Paulo"]
    text, _ = random_walk(backend, tok, StructuredOutputs(choice=choices), seed)
    assert text in choices
    lark = 'start: "(" num (op num)* ")"\nop: "+" | "-"\nnum: /[1-9]/'
    text, _ = random_walk(backend, tok, StructuredOutputs(grammar=lark), seed)
    assert re.fullmatch(r"\([1-9]([+-][1-9])*\)", text)
    spec = StructuredOutputs(json_object=True, disable_any_whitespace=True)
    matcher = backend.compile(spec).matcher()
    assert (
        matcher.accept_tokens(tok.encode('{"any": [1, {"thing": null}]}', add_special_tokens=False))
        is False
    )
    matcher = backend.compile(spec).matcher()
    assert matcher.accept_tokens(tok.encode('{"any":[1,{"thing":null}]}', add_special_tokens=False))
    assert matcher.can_end


@pytest.fixture(scope="module")
def family_backend(tok: Tokenizer, vocab: int):
    """Each grammar built three times (three lexers), filled by two threads."""
    b = GrammarBackend.from_tokenizer(tok, vocab, [tok.eos_token_id], fill_threads=2, families=3)
    yield b
    b.close()


def compiled_with_all_families(backend: GrammarBackend, spec: StructuredOutputs):
    """The spec compiled, used by more sequences at once than it has copies until it has all its
    families (built in the background, one at a time)."""
    compiled = backend.compile(spec)
    held = [compiled.matcher() for _ in range(backend.families + 1)]
    deadline = time.monotonic() + 60
    while compiled.families < backend.families and time.monotonic() < deadline:
        time.sleep(0.01)
    del held
    return compiled


def test_a_grammar_grows_a_copy_per_sequence_in_use_up_to_its_families(family_backend):
    spec = StructuredOutputs(json=ORDER_SCHEMA, whitespace_pattern=" ?")  # a spec of its own
    compiled = family_backend.compile(spec)
    one = compiled.matcher()
    time.sleep(0.3)
    assert compiled.families == 1 and compiled.live == 1  # one sequence at a time: one copy
    more = [compiled.matcher() for _ in range(6)]
    deadline = time.monotonic() + 60
    while compiled.families < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert compiled.families == 3  # family_backend's three, not one per sequence
    assert compiled.live == 7
    del one, more
    gc.collect()
    assert compiled.live == 0
    dealt = [compiled.matcher() for _ in range(6)]
    assert sorted(m.family for m in dealt) == [0, 0, 1, 1, 2, 2]
    assert family_backend.submit(spec).result() is compiled  # one compile, whatever its families


@pytest.mark.parametrize("which", ["backend", "family_backend"])
def test_batch_fill_matches_one_row_at_a_time_and_leaves_free_rows_open(which, tok, request):
    backend = request.getfixturevalue(which)
    compiled = compiled_with_all_families(backend, StructuredOutputs(json=ORDER_SCHEMA))
    prefixes = [
        '{"id": "AB',
        '{"id": "AB123", "qty": 4',
        "",
        '{"id": "ZZ999", "qty": 50, "color": "',
        '{"id": "AB123", "qty": 4, "color": "red", "gift": true, "tags": ["a',
    ]
    matchers = []
    for p in prefixes:
        m = compiled.matcher()
        assert m.accept_tokens(tok.encode(p, add_special_tokens=False))
        matchers.append(m)
    # rows out of family order: the fill sorts its work by family, each row must land in place
    rows = [matchers[0], None, matchers[1], matchers[4], matchers[2], None, matchers[3]]
    batch = allocate_bitmask(len(rows) + 2, backend.vocab_size)
    batch[:] = 0
    assert backend.fill_bitmask(batch, rows)
    one = allocate_bitmask(1, backend.vocab_size)
    for i, m in enumerate(rows):
        if m is None:
            assert (batch[i] == -1).all()
        else:
            m.fill(one[0])
            assert torch.equal(batch[i], one[0])
    assert len({bytes(batch[i].numpy()) for i in (0, 2, 3, 4, 6)}) == 5  # five different places
    assert (batch[len(rows) :] == 0).all()  # rows past the batch are left alone
    assert not backend.fill_bitmask(batch, [None, None])  # nothing constrained: skip the masking


def test_every_family_masks_the_same_tokens_along_a_document(family_backend, tok):
    compiled = compiled_with_all_families(family_backend, StructuredOutputs(json=ORDER_SCHEMA))
    matchers = [compiled.matcher() for _ in range(3)]
    assert sorted(m.family for m in matchers) == [0, 1, 2]
    text = '{"id": "QX042", "qty": 12, "color": "blue", "gift": false, "tags": [], '
    text += '"ship": {"zone": "eu", "floor": 3}}'
    batch = allocate_bitmask(3, family_backend.vocab_size)
    for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]:
        family_backend.fill_bitmask(batch, matchers)
        assert torch.equal(batch[0], batch[1]) and torch.equal(batch[0], batch[2])
        assert t in allowed_ids(batch[0])
        assert all(m.accept(t) for m in matchers)
    assert all(m.is_finished for m in matchers)


def test_start_after_token_leaves_the_row_free_until_that_token(backend, tok):
    # any single token stands for </think>
    end_think = tok.encode("</", add_special_tokens=False)[0]
    matcher = backend.compile(StructuredOutputs(choice=["yes", "no"])).matcher(
        start_after_token=end_think
    )
    bitmask = allocate_bitmask(1, backend.vocab_size)
    assert not matcher.active
    assert matcher.accept_tokens(tok.encode("free text, anything", add_special_tokens=False))
    backend.fill_bitmask(bitmask, [matcher])
    assert (bitmask == -1).all()
    assert matcher.accept(end_think) and matcher.active
    backend.fill_bitmask(bitmask, [matcher])
    assert tok.encode("yes", add_special_tokens=False)[0] in allowed_ids(bitmask[0])
    assert len(allowed_ids(bitmask[0])) < 10


def test_logit_columns_past_the_tokenizer_are_never_allowed(tok, vocab):
    padded = vocab + 64  # models often pad their embedding table past the tokenizer
    backend = GrammarBackend.from_tokenizer(tok, padded, [tok.eos_token_id])
    try:
        matcher = backend.compile(StructuredOutputs(json_object=True)).matcher()
        bitmask = allocate_bitmask(1, padded)
        matcher.accept_tokens(tok.encode('{"a": "', add_special_tokens=False))
        backend.fill_bitmask(bitmask, [matcher])
        allowed = allowed_ids(bitmask[0])
        assert allowed and max(allowed) < vocab
    finally:
        backend.close()


# ---- applying the bitmask ----------------------------------------------------------------------


@pytest.mark.parametrize("vocab, words", [(64, 2), (100, 4), (100, 3), (31, 1)])
def test_apply_token_bitmask_matches_a_bit_by_bit_reference(vocab, words):
    gen = torch.Generator().manual_seed(vocab * 10 + words)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bitmask[2] = -1  # a free row
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(5, words * 32)
    for i in range(5):
        for t in range(vocab):
            if t >= words * 32 or not bits[i, t]:
                expected[i, t] = float("-inf")
    out = apply_token_bitmask(logits, bitmask)
    assert out is logits
    assert torch.equal(logits, expected)
    assert torch.equal(logits[2, : words * 32], expected[2, : words * 32])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_cuda_masking_kernel_under_the_triton_interpreter_matches_torch():
    """The CUDA path's kernel, run on the CPU by Triton's interpreter, against the torch path: rows
    all ones, random bits, logits narrower and wider than the bitmask, a width not a multiple of
    the kernel's block."""
    script = textwrap.dedent("""
        import torch
        from engine import token_bitmask
        gen = torch.Generator().manual_seed(0)
        token_bitmask.MASK_BLOCK = 256
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 20), dtype=torch.int32, generator=gen)
        bitmask[1] = -1
        for vocab in (640, 600, 700):
            logits = torch.randn(3, vocab, generator=gen)
            expected = token_bitmask._apply_token_bitmask_torch(logits.clone(), bitmask)
            got = token_bitmask._apply_token_bitmask_triton(logits.clone(), bitmask)
            assert torch.equal(got, expected), vocab
            assert torch.isinf(got[1, 640:]).all() and torch.isfinite(got[1, :640]).all()
        print("ok")
    """)
    done = run_in_triton_interpreter(script)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_apply_token_bitmask_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="must be \\[N, V\\] and \\[N, W\\]"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))


def test_json_whitespace_is_bounded_so_a_document_must_end(backend, tok):
    def accepts(spec: StructuredOutputs, text: str) -> bool:
        matcher = backend.compile(spec).matcher()
        return matcher.accept_tokens(tok.encode(text, add_special_tokens=False)) and matcher.can_end

    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert accepts(spec, '{"a":' + " " * 32 + "1}")
    assert not accepts(spec, '{"a":' + " " * 33 + "1}")
    assert accepts(spec, '{\n  "a": 1\n}')
    custom = StructuredOutputs(json_object=True, whitespace_pattern=r"[ ]?")
    assert accepts(custom, '{"a": 1, "b": 2}')
    assert not accepts(custom, '{"a":  1}')
    assert not accepts(custom, '{\n"a": 1}')


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_engine_under_a_grammar_writes_schema_valid_json(smollm2_dir, async_scheduling):
    """The engine's own path (SamplingParams.structured_outputs): the real SmolLM2 model, sampling
    at temperature 1 with n=2 and with async scheduling (the step in flight is read inside the next
    launch) or without, ends every reply with a document the schema accepts."""
    from engine import LLM, SamplingParams

    llm = LLM(
        model=smollm2_dir,
        dtype="float32",
        device="cpu",
        max_model_len=1024,
        seed=0,
        async_scheduling=async_scheduling,
    )
    spec = StructuredOutputs(json=ORDER_SCHEMA, disable_any_whitespace=True)
    prompts = ["Write an order as JSON.", "Order:", "{"]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=200, n=2, structured_outputs=spec)
        for i in range(3)
    ]
    outs = llm.generate(prompts, params)
    texts = [c.text for out in outs for c in out.outputs]
    assert len(texts) == 6
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), ORDER_SCHEMA)
    # unconstrained, the same model and seeds write no such documents
    free = llm.generate(
        prompts, [SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(3)]
    )
    assert not any(_is_json(out.outputs[0].text) for out in free)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_logit_bias_makes_a_token_the_greedy_choice(smollm2_dir):
    """+100 on one token makes it the first token of a greedy reply; -100 on the greedy first token
    removes it."""
    from engine import LLM, SamplingParams

    llm = LLM(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=256)
    prompt = "The capital of France is"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    first = plain.outputs[0].token_ids[0]
    target = llm.engine.tokenizer.encode(" banana")[0]
    biased = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, logit_bias={target: 100})
    )[0]
    assert biased.outputs[0].token_ids == [target] != [first]
    banned = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100})
    )[0]
    assert banned.outputs[0].token_ids[0] != first
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, "):
        llm.generate([prompt], SamplingParams(logit_bias={10**9: 1}))
    with pytest.raises(ValueError, match=r"logit_bias\[5\]: must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})
