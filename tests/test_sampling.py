"""Tests for engine.sampling_params (SamplingParams validation) and engine.sampling (the Sampler).

Each logits transformation is checked against transformers' own logits processors on random logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.outputs import Logprob
from engine.sampling import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_banned_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p_min_p,
    prompt_logprobs,
)
from engine.sampling_params import SamplingParams

VOCAB = 512


def row(
    params: SamplingParams | None = None,
    seed: int | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    banned: list[int] | None = None,
) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params or SamplingParams(), gen, prompt or [], output or [], banned or [])


# --------------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("n", 0),
    ("n", 129),
    ("n", 1.0),
    ("n", True),
    ("n", "2"),
    ("temperature", -1),
    ("temperature", -0.01),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", float("nan")),
    ("top_p", "1"),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", "0"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("repetition_penalty", False),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", "0"),
    ("frequency_penalty", -3),
    ("frequency_penalty", 2.0001),
    ("frequency_penalty", True),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("stop", 3),
    ("stop", [""]),
    ("stop", ["ok", 5]),
    ("stop", ["x"] * 65),
    ("stop", "x" * 1025),
    ("stop", {"a"}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("stop_token_ids", list(range(1025))),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 0.5),
    ("min_tokens", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", "3"),
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v!r}"[:40] for n, v in BAD_VALUES])
def test_bad_values_raise_naming_the_field(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    assert str(info.value).startswith(f"{name}: ")


def test_error_messages_state_the_range_and_value():
    with pytest.raises(ValueError, match=r"^temperature: must be >= 0, got -1$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"^top_p: .*\(0, 1\].*got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"^n: .*\[1, 128\].*got 0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"^stop: .*64.*got 65"):
        SamplingParams(stop=["a"] * 65)
    with pytest.raises(ValueError, match=r"^stop: .*1024.*got 1025"):
        SamplingParams(stop=["a" * 1025])
    with pytest.raises(ValueError, match=r"^stop_token_ids: .*1024.*got 1025"):
        SamplingParams(stop_token_ids=list(range(1025)))
    with pytest.raises(ValueError, match=r"^n: .*int.*got bool True"):
        SamplingParams(n=True)
    with pytest.raises(ValueError, match=r"^temperature: .*number.*got str 'hot'"):
        SamplingParams(temperature="hot")


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens: .*max_tokens.*got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=100).max_tokens is None


GOOD = [
    dict(),
    dict(n=128),
    dict(temperature=0),
    dict(temperature=2),
    dict(temperature=0.7),
    dict(top_p=1e-6),
    dict(top_p=1),
    dict(top_k=-1),
    dict(top_k=0),
    dict(top_k=1),
    dict(top_k=100000),
    dict(min_p=0),
    dict(min_p=1),
    dict(repetition_penalty=0.01),
    dict(repetition_penalty=5.0),
    dict(presence_penalty=-2),
    dict(frequency_penalty=2),
    dict(seed=0),
    dict(seed=-5),
    dict(seed=2**80),
    dict(stop="###"),
    dict(stop=["a", "b"]),
    dict(stop=("a",)),
    dict(stop=["x" * 1024] * 64),
    dict(stop_token_ids=[0, 2]),
    dict(stop_token_ids=list(range(1024))),
    dict(max_tokens=1),
    dict(min_tokens=0),
    dict(logprobs=0),
    dict(logprobs=20),
    dict(prompt_logprobs=0),
    dict(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True),
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[repr(k)[:40] for k in GOOD])
def test_good_values_pass(kwargs):
    params = SamplingParams(**kwargs)
    params.validate()  # re-validation of normalised values passes too


def test_normalisation_and_revalidation():
    p = SamplingParams(stop="END", stop_token_ids=(3, 4), temperature=1, seed=-1)
    assert p.stop == ["END"] and p.stop_token_ids == [3, 4]
    assert isinstance(p.temperature, float)
    assert p.seed == 2**64 - 1 and SamplingParams(seed=2**64 + 5).seed == 5
    torch.Generator().manual_seed(p.seed)  # accepted by torch
    d = SamplingParams()
    assert d.stop == [] and d.stop_token_ids == [] and d.max_tokens is None and d.logprobs is None
    d.temperature = -3
    with pytest.raises(ValueError, match="^temperature"):
        d.validate()


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.01, top_k=2).is_greedy


# --------------------------------------------------------------------------------------------------
# Transformations against transformers' processors
# --------------------------------------------------------------------------------------------------


def random_logits(n: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_banned_tokens():
    logits = random_logits(3)
    out = apply_banned_tokens(logits.clone(), [[1, 5], [], [VOCAB - 1, VOCAB + 10]])
    assert torch.isneginf(out[0, [1, 5]]).all() and torch.isneginf(out[2, VOCAB - 1])
    assert torch.isinf(out).sum() == 3
    assert torch.equal(out[1], logits[1])


def test_repetition_penalty_matches_transformers():
    logits = random_logits(4, seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (30,), generator=gen).tolist() for _ in range(4)]
    outputs = [torch.randint(0, VOCAB, (10,), generator=gen).tolist() for _ in range(4)]
    penalties = [1.3, 1.0, 0.7, 2.0]
    ours = apply_penalties(logits.clone(), prompts, outputs, penalties, [0.0] * 4, [0.0] * 4)
    for i, p in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(penalty=p)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref, rtol=0, atol=0)
    assert torch.equal(ours[1], logits[1])
    as_arrays = apply_penalties(
        logits.clone(),
        [np.asarray(p, dtype=np.int64) for p in prompts],
        outputs,
        penalties,
        [0.0] * 4,
        [0.0] * 4,
    )
    assert torch.equal(as_arrays, ours)  # a prompt kept as an int64 array gives the same result


def test_presence_frequency_penalties_follow_openai():
    logits = random_logits(3, seed=3)
    prompts = [[7, 7, 8], [1], [2]]
    outputs = [[1, 1, 1, 4], [9, 9], []]
    pres, freq = [0.5, -1.0, 2.0], [0.25, 0.0, 1.0]
    ours = apply_penalties(logits.clone(), prompts, outputs, [1.0] * 3, pres, freq)
    ref = logits.clone()
    for i in range(3):
        for t in set(outputs[i]):  # prompt tokens are not penalised
            ref[i, t] -= outputs[i].count(t) * freq[i] + pres[i]
    torch.testing.assert_close(ours, ref)
    assert ours[0, 7] == logits[0, 7]


def test_temperature_matches_transformers():
    logits = random_logits(3, seed=4)
    temps = [0.7, 1.0, 1.9]
    ours = apply_temperature(logits.clone(), temps)
    for i, t in enumerate(temps):
        torch.testing.assert_close(
            ours[i : i + 1], TemperatureLogitsWarper(t)(None, logits[i : i + 1].clone())
        )


def hf_warp(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    out = logits.clone()
    if top_k > 0:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1.0:
        out = TopPLogitsWarper(top_p)(None, out)
    if min_p > 0.0:
        out = MinPLogitsWarper(min_p)(None, out)
    return out


SETTINGS = [  # (top_k, top_p, min_p)
    (0, 1.0, 0.0),
    (1, 1.0, 0.0),
    (5, 1.0, 0.0),
    (50, 1.0, 0.0),
    (-1, 0.9, 0.0),
    (0, 0.5, 0.0),
    (0, 0.05, 0.0),
    (0, 1.0, 0.1),
    (0, 1.0, 0.5),
    (20, 0.8, 0.0),
    (40, 0.95, 0.05),
    (0, 0.7, 0.2),
    (10, 1.0, 0.3),
    (VOCAB + 5, 0.99, 0.01),
]


BATCHES = {
    "all": SETTINGS,
    # the top-k path without a full sort
    "top_k_and_min_p_only": [s for s in SETTINGS if s[1] == 1.0],
    "top_k_only": [(k, 1.0, 0.0) for k in (0, 3, 1, -1, 77, VOCAB, VOCAB - 1)],
    "top_p_only": [(0, p, 0.0) for p in (0.3, 1.0, 0.9, 0.999)],
    "min_p_only": [(0, 1.0, m) for m in (0.0, 0.01, 0.9, 1.0)],
}


@pytest.mark.parametrize("scale", [0.5, 3.0])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_top_k_top_p_min_p_match_transformers(batch, scale):
    """One batch mixes the settings; each row's allowed set and kept values equal transformers'
    chain."""
    settings = BATCHES[batch] * 3
    logits = random_logits(len(settings), seed=5, scale=scale)
    ours = apply_top_k_top_p_min_p(
        logits.clone(), [s[0] for s in settings], [s[1] for s in settings], [s[2] for s in settings]
    )
    for i, (k, p, m) in enumerate(settings):
        ref = hf_warp(logits[i : i + 1], k, p, m)[0]
        assert torch.equal(torch.isneginf(ours[i]), torch.isneginf(ref)), (k, p, m)
        kept = ~torch.isneginf(ref)
        assert torch.equal(ours[i][kept], logits[i][kept])
        if k == 1:
            assert kept.sum() == 1


def test_top_k_keeps_ties_like_transformers():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5, 2.0]])
    ref = TopKLogitsWarper(2)(None, logits.clone())
    for top_p in (1.0, 0.9999):  # the top-k-only path and the sorted path
        ours = apply_top_k_top_p_min_p(logits.clone(), [2], [top_p], [0.0])
        assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    assert torch.isneginf(ref).sum() == 2


def test_exact_boundaries_match_transformers():
    """Probabilities that are exact in binary: top_p stops once the kept mass reaches p; min_p keeps
    p == threshold."""
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    for p in (0.5, 0.6, 0.75):  # (beyond 0.75 the two tied 0.125 tokens make the choice arbitrary)
        ours = apply_top_k_top_p_min_p(logits.clone(), None, [p], None)
        assert torch.equal(
            torch.isneginf(ours), torch.isneginf(TopPLogitsWarper(p)(None, logits.clone()))
        ), p
    assert torch.isneginf(apply_top_k_top_p_min_p(logits.clone(), None, [0.75], None)).sum() == 2
    for m in (0.25, 0.5, 1.0):
        ours = apply_top_k_top_p_min_p(logits.clone(), None, None, [m])
        assert torch.equal(
            torch.isneginf(ours), torch.isneginf(MinPLogitsWarper(m)(None, logits.clone()))
        ), m
    assert not torch.isneginf(apply_top_k_top_p_min_p(logits.clone(), None, None, [0.25])).any()


def test_processed_logits_with_temperature_and_penalties_match_transformers_chain():
    """The full masking pipeline (penalty -> temperature -> top-k -> top-p -> min-p) against
    transformers."""
    logits = random_logits(6, seed=6)
    prompts = [[1, 2, 3, 4, 5]] * 6
    outputs = [[10, 11, 12]] * 6
    cfg = [
        (1.2, 0.7, 40, 0.9, 0.05),
        (1.0, 1.3, 0, 0.8, 0.0),
        (1.5, 0.5, 10, 1.0, 0.2),
        (0.9, 1.0, 0, 1.0, 0.0),
        (1.1, 0.8, 100, 0.6, 0.0),
        (1.0, 0.25, 3, 0.99, 0.5),
    ]
    ours = logits.clone()
    apply_penalties(ours, prompts, outputs, [c[0] for c in cfg], [0.0] * 6, [0.0] * 6)
    apply_temperature(ours, [c[1] for c in cfg])
    apply_top_k_top_p_min_p(ours, [c[2] for c in cfg], [c[3] for c in cfg], [c[4] for c in cfg])
    for i, (rp, t, k, p, m) in enumerate(cfg):
        ref = RepetitionPenaltyLogitsProcessor(rp)(
            torch.tensor([prompts[i] + outputs[i]]), logits[i : i + 1].clone()
        )
        ref = hf_warp(TemperatureLogitsWarper(t)(None, ref), k, p, m)[0]
        assert torch.equal(torch.isneginf(ours[i]), torch.isneginf(ref))
        torch.testing.assert_close(ours[i], ref)


# --------------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------------


def test_greedy_equals_argmax():
    logits = random_logits(5, seed=7)
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(top_k=1), seed=3),
        row(SamplingParams(temperature=0, top_p=0.1)),
        row(SamplingParams(temperature=0), seed=1),
        row(SamplingParams(top_k=1, temperature=1.7)),
    ]
    out = Sampler()(logits, rows)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_greedy_after_penalties_and_bans():
    logits = random_logits(2, seed=8)
    top = logits.argmax(dim=-1).tolist()
    rows = [
        row(SamplingParams(temperature=0), banned=[top[0]]),
        row(SamplingParams(temperature=0, repetition_penalty=1e6), output=[top[1]]),
    ]
    expected = [logits[0].topk(2).indices[1].item(), logits[1].topk(2).indices[1].item()]
    assert Sampler()(logits, rows).token_ids == expected


def test_mixed_batch_greedy_and_sampled():
    logits = random_logits(4, seed=9)
    rows = [
        row(SamplingParams(temperature=0)),
        row(seed=1),
        row(SamplingParams(temperature=0)),
        row(seed=2),
    ]
    out = Sampler()(logits, rows)
    assert (
        out.token_ids[0] == logits[0].argmax().item()
        and out.token_ids[2] == logits[2].argmax().item()
    )
    alone = Sampler()(logits[[1, 3]], [row(seed=1), row(seed=2)])
    assert [out.token_ids[1], out.token_ids[3]] == alone.token_ids


def test_seeded_rows_independent_of_batch():
    sampler = Sampler()
    target = random_logits(1, seed=10, scale=1.0)
    params = SamplingParams(temperature=0.9, top_p=0.95)

    def run(batch_others: int, seed: int, steps: int = 12) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        tokens = []
        for step in range(steps):
            others = random_logits(batch_others, seed=100 + step, scale=1.0)
            logits = torch.cat([others[: batch_others // 2], target, others[batch_others // 2 :]])
            rows = [
                row(SamplingParams(temperature=1.3, top_k=7, min_p=0.02), seed=step * 31 + j)
                for j in range(batch_others)
            ]
            rows.insert(batch_others // 2, SamplingRow(params, g, [1, 2], tokens[:], []))
            out = sampler(logits, rows)
            tokens.append(out.token_ids[batch_others // 2])
        return tokens

    alone = run(0, seed=1234)
    assert run(5, seed=1234) == alone
    assert run(17, seed=1234) == alone
    assert run(0, seed=99) != alone
    assert len(set(alone)) > 1  # really random, not stuck on one token


def test_rows_without_generator_use_torch_default_rng():
    logits = random_logits(3, seed=11, scale=0.5)
    rows = [row(), row(), row()]
    torch.manual_seed(5)
    a = Sampler()(logits, rows).token_ids
    torch.manual_seed(5)
    b = Sampler()(logits, rows).token_ids
    assert a == b
    # mixed: generator rows are still unaffected by the default-RNG rows
    mixed = Sampler()(logits, [row(), row(seed=42), row()]).token_ids
    assert mixed[1] == Sampler()(logits[1:2], [row(seed=42)]).token_ids[0]


def empirical(logits: torch.Tensor, params: SamplingParams, draws: int, seed: int) -> torch.Tensor:
    vocab = logits.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(params, gen, [], [], []) for _ in range(draws)]
    tokens = Sampler()(logits.expand(draws, vocab), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / draws


@pytest.mark.parametrize(
    "cfg",
    [
        dict(temperature=0.7),
        dict(temperature=0.7, top_k=6),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.2, top_k=10, top_p=0.9, min_p=0.05),
    ],
)
def test_empirical_distribution_matches_processed_softmax(cfg):
    vocab = 16
    logits = random_logits(1, vocab=vocab, seed=12, scale=1.5)
    draws = 20000
    freq = empirical(logits, SamplingParams(**cfg), draws, seed=13)
    ref = TemperatureLogitsWarper(cfg["temperature"])(None, logits.clone())
    ref = hf_warp(ref, cfg.get("top_k", 0), cfg.get("top_p", 1.0), cfg.get("min_p", 0.0))
    expected = ref.softmax(dim=-1)[0]
    assert (freq[expected == 0] == 0).all(), "a masked token was sampled"
    tv = 0.5 * (freq - expected).abs().sum().item()
    assert tv < 0.02, tv
    # Pearson chi-square over allowed tokens; df <= 15, the 0.999 quantile for df=15 is ~37.7.
    allowed = expected > 0
    chi2 = (draws * (freq[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum().item()
    assert chi2 < 40, chi2


def test_min_tokens_banning_blocks_eos():
    eos, stop_id = 3, 9
    logits = torch.zeros(2, 32)
    logits[:, eos] = 30.0
    logits[:, stop_id] = 10.0
    params = SamplingParams(min_tokens=4, stop_token_ids=[stop_id])
    for seed in range(20):
        out = Sampler()(
            logits,
            [
                row(params, seed=seed, banned=[eos, stop_id]),
                row(SamplingParams(temperature=0, min_tokens=4), banned=[eos, stop_id]),
            ],
        )
        assert eos not in out.token_ids and stop_id not in out.token_ids
    out = Sampler()(logits, [row(params, seed=0), row(SamplingParams(temperature=0))])
    assert out.token_ids == [eos, eos]  # once not banned, the dominant EOS wins


def check_ranks(entry: dict[int, Logprob], raw_lp: torch.Tensor) -> None:
    for tid, lp in entry.items():
        assert lp.logprob == pytest.approx(raw_lp[tid].item(), abs=1e-6)
        assert lp.rank == 1 + int((raw_lp > raw_lp[tid]).sum())


def test_logprobs_come_from_raw_logits():
    logits = random_logits(4, seed=14)
    raw_lp = torch.log_softmax(logits, dim=-1)
    rows = [
        row(
            SamplingParams(logprobs=5, temperature=0.3, top_k=3, repetition_penalty=1.5),
            seed=1,
            prompt=[1, 2],
        ),
        row(SamplingParams(logprobs=0), seed=2),
        row(SamplingParams()),
        row(SamplingParams(temperature=0, logprobs=20), banned=[int(logits[3].argmax())]),
    ]
    out = Sampler()(logits, rows)
    assert out.logprobs[2] is None
    top5 = raw_lp[0].topk(5)
    entry = out.logprobs[0]
    assert set(top5.indices.tolist()) | {out.token_ids[0]} == set(entry)
    for j, tid in enumerate(top5.indices.tolist()):
        assert entry[tid].rank == j + 1
    check_ranks(entry, raw_lp[0])
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    check_ranks(out.logprobs[1], raw_lp[1])
    # the greedy row had its argmax banned: it picked the second best, which is rank 2 of the raw
    # distribution
    assert out.logprobs[3][out.token_ids[3]].rank == 2 and len(out.logprobs[3]) == 20
    check_ranks(out.logprobs[3], raw_lp[3])


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_scratch_logits_sample_the_same_tokens_and_only_scratch_is_edited(with_logprobs):
    """sample(..., scratch=True) may edit the caller's logits in place: the same tokens and
    logprobs as on a copy, and without scratch the caller's logits are left as they were."""
    from engine.token_bitmask import allocate_bitmask

    logits = random_logits(4, seed=21)
    bitmask = allocate_bitmask(4, VOCAB)
    bitmask[1, :4] = 0x0F0F0F0F  # row 1: only some of its first 128 tokens, none above
    bitmask[1, 4:] = 0

    def rows() -> list[SamplingRow]:
        lp = 3 if with_logprobs else None
        return [
            row(SamplingParams(temperature=0.7, logit_bias={5: 4.0}, logprobs=lp), seed=1),
            row(SamplingParams(temperature=0, logprobs=lp)),
            row(SamplingParams(temperature=1.2, top_p=0.9), seed=2, banned=[3, 4]),
            row(SamplingParams(temperature=0, repetition_penalty=1.3), prompt=[7], output=[9]),
        ]

    kept = logits.clone()
    copied = Sampler().sample(logits, rows(), bitmask).result()
    assert torch.equal(logits, kept)
    scratch = logits.clone()
    edited = Sampler().sample(scratch, rows(), bitmask, scratch=True).result()
    assert edited.token_ids == copied.token_ids
    assert edited.logprobs == copied.logprobs
    allowed = set(
        np.flatnonzero(np.unpackbits(bitmask[1].numpy().view(np.uint8), bitorder="little"))
    )
    assert edited.token_ids[1] in allowed
    # logprobs need the raw logits: then the scratch stays as it was too
    assert torch.equal(scratch, kept) == with_logprobs


def test_logprob_ranks_with_ties():
    logits = torch.tensor([[2.0, 5.0, 5.0, 1.0, 5.0, 0.0]])
    out = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=4), banned=[1, 2, 4])])
    assert out.token_ids == [0]
    entry = out.logprobs[0]
    assert entry[0].rank == 4
    assert sorted(entry[t].rank for t in (1, 2, 4)) == [1, 1, 1]


def test_prompt_logprobs():
    logits = random_logits(6, seed=15)
    raw_lp = torch.log_softmax(logits, dim=-1)
    next_ids = [5, 17, int(logits[2].argmax()), 0, 300, 511]
    entries = prompt_logprobs(logits, next_ids, k=3)
    assert len(entries) == 6
    for t, entry in enumerate(entries):
        assert next_ids[t] in entry
        assert set(raw_lp[t].topk(3).indices.tolist()) <= set(entry)
        assert len(entry) in (3, 4)
        check_ranks(entry, raw_lp[t])
    assert entries[2][next_ids[2]].rank == 1 and len(entries[2]) == 3
    assert list(prompt_logprobs(logits, next_ids, k=0)[1]) == [17]
    assert prompt_logprobs(logits[:0], [], k=2) == []
    with pytest.raises(ValueError):
        prompt_logprobs(logits, next_ids[:2], k=1)


def test_sampler_rejects_mismatched_batch_and_handles_empty():
    with pytest.raises(ValueError):
        Sampler()(random_logits(2), [row()])
    assert Sampler()(torch.zeros(0, VOCAB), []) == SamplerOutput([], [])


def test_sampler_does_not_modify_input_logits():
    logits = random_logits(2, seed=16)
    before = logits.clone()
    Sampler()(
        logits,
        [
            row(
                SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.4),
                seed=1,
                output=[1],
                banned=[2],
            ),
            row(SamplingParams(temperature=0, presence_penalty=1.0), output=[3]),
        ],
    )
    assert torch.equal(logits, before)


def test_tiny_temperature_is_finite_and_near_greedy():
    logits = random_logits(3, seed=17)
    out = Sampler()(logits, [row(SamplingParams(temperature=1e-30), seed=i) for i in range(3)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_semantics():
    logits = random_logits(6, seed=18).cuda()
    settings = SETTINGS[:6]
    ours = apply_top_k_top_p_min_p(
        logits.clone(), [s[0] for s in settings], [s[1] for s in settings], [s[2] for s in settings]
    )
    cpu = apply_top_k_top_p_min_p(
        logits.cpu(), [s[0] for s in settings], [s[1] for s in settings], [s[2] for s in settings]
    )
    assert torch.equal(torch.isneginf(ours).cpu(), torch.isneginf(cpu))

    def run() -> list[int]:
        rows = [
            SamplingRow(
                SamplingParams(temperature=0.8, top_p=0.9, logprobs=2),
                torch.Generator(device="cuda").manual_seed(i),
                [1, 2],
                [3],
                [4],
            )
            for i in range(6)
        ]
        rows[0] = SamplingRow(SamplingParams(temperature=0), None, [], [], [])
        return Sampler()(logits, rows).token_ids

    first = run()
    assert first == run()
    assert first[0] == logits[0].argmax().item()
