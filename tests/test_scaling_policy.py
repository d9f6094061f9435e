"""The scaling policy as a pure function: bursts, idle, booting workers, capacity changes,
keep-alive from idle gaps, bounds, and a brute-force check of the ski-rental keep-warm horizon.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from scaling.policy import (
    Decision,
    IdleGaps,
    Observation,
    PolicyConfig,
    decide,
    keep_warm_horizon,
    predicted_backlog,
)


def obs(**kw) -> Observation:
    base = dict(
        in_queue=0,
        in_progress=0,
        workers_ready=0,
        workers_booting=0,
        workers_idle=0,
        capacity_per_worker=128.0,
        arrival_rate=0.0,
        mean_service_s=8.0,
        cold_start_s=30.0,
    )
    base.update(kw)
    return Observation(**base)


CFG = PolicyConfig()


def test_a_burst_into_an_empty_endpoint_starts_enough_workers_at_once():
    d = decide(obs(in_queue=300), CFG)
    assert isinstance(d, Decision)
    # 3, not one at a time
    assert d.desired_workers == math.ceil(300 / (128 * CFG.target_utilization))
    assert decide(obs(in_queue=1), CFG).desired_workers == 1


def test_booting_workers_count_as_capacity_on_its_way():
    # 100 queued, one worker booting with 128 slots: nothing to add
    assert decide(obs(in_queue=100, workers_booting=1), CFG).desired_workers == 1
    # 1000 queued: the booting worker is not enough, workers are added at once
    assert decide(obs(in_queue=1000, workers_booting=1), CFG).desired_workers > 1
    # and adding more booting workers until they cover the backlog stops the additions
    d = decide(obs(in_queue=1000, workers_booting=1), CFG)
    again = decide(obs(in_queue=1000, workers_booting=d.desired_workers), CFG)
    assert again.desired_workers == d.desired_workers


def test_a_queue_the_fleet_clears_within_one_cold_start_adds_no_worker():
    # one full worker, 20 queued, 1 s per request: gone in well under the 120 s a new worker needs
    o = obs(
        in_queue=20,
        in_progress=128,
        workers_ready=1,
        mean_service_s=1.0,
        cold_start_s=120.0,
        arrival_rate=1.0,
    )
    assert predicted_backlog(o) == 0
    assert decide(o, CFG).desired_workers == 1
    # the same queue with a 60 s service time outlives a 5 s cold start: scale up
    o = obs(
        in_queue=200,
        in_progress=128,
        workers_ready=1,
        mean_service_s=60.0,
        cold_start_s=5.0,
        arrival_rate=1.0,
    )
    assert predicted_backlog(o) > 0
    assert decide(o, CFG).desired_workers >= 2


def test_sustained_rate_sets_the_fleet_by_littles_law():
    # 30 req/s x 8 s = 240 requests in flight; 128 * 0.85 slots per worker -> 3 workers
    o = obs(in_progress=200, workers_ready=2, arrival_rate=30.0)
    assert decide(o, CFG).desired_workers == math.ceil(30 * 8 / (128 * CFG.target_utilization))


def test_capacity_changes_change_the_fleet():
    o = dict(in_progress=100, workers_ready=2, arrival_rate=20.0)
    big = decide(obs(capacity_per_worker=128.0, **o), CFG).desired_workers
    small = decide(obs(capacity_per_worker=32.0, **o), CFG).desired_workers
    assert small > big
    assert small == math.ceil(20 * 8 / (32 * CFG.target_utilization))


def test_scale_down_only_drains_idle_workers():
    # 5 ready, 1 idle, hardly any traffic: never below the 4 busy ones
    d = decide(obs(in_progress=4, workers_ready=5, workers_idle=1, arrival_rate=0.01), CFG)
    assert d.desired_workers == 4
    # booting workers are not cancelled either
    d = decide(obs(workers_ready=1, workers_idle=1, workers_booting=2, idle_for_s=1e6), CFG)
    assert d.desired_workers == 2


def test_idle_endpoint_keeps_one_warm_then_goes_to_zero():
    cold = 30.0
    k = keep_warm_horizon((), cold, CFG)
    warm = decide(obs(workers_ready=1, workers_idle=1, idle_for_s=k / 2, cold_start_s=cold), CFG)
    assert warm.desired_workers == 1
    gone = decide(obs(workers_ready=1, workers_idle=1, idle_for_s=k + 1, cold_start_s=cold), CFG)
    assert gone.desired_workers == 0
    # the warm floor keeps a worker, it never starts one
    assert decide(obs(idle_for_s=0.0), CFG).desired_workers == 0
    # and min_workers holds even when idle forever
    cfg = PolicyConfig(min_workers=2)
    assert decide(obs(workers_ready=2, workers_idle=2, idle_for_s=1e6), cfg).desired_workers == 2


def test_keep_alive_is_about_one_cold_start_without_history_and_grows_with_the_wait_weight():
    for cold in (5.0, 30.0, 120.0):
        k0 = keep_warm_horizon((), cold, PolicyConfig(wait_cost_weight=0.0))
        assert k0 == pytest.approx(cold)
        k8 = keep_warm_horizon((), cold, PolicyConfig(wait_cost_weight=8.0))
        assert k8 == pytest.approx(min(9 * cold, CFG.max_keep_alive_s))
    d = decide(obs(workers_ready=1, workers_idle=1, cold_start_s=30.0), CFG)
    assert d.keep_alive_s >= 30.0 and d.keep_warm_s >= 30.0


def test_keep_alive_follows_the_idle_gap_history():
    cold, cfg = 10.0, PolicyConfig(wait_cost_weight=8.0)  # a cold start "costs" 90 s
    returns = (40.0,) * 20  # traffic always came back after 40 s: stay warm through it
    assert keep_warm_horizon(returns, cold, cfg) >= 40.0
    leaves = (3000.0,) * 20  # it never came back within the hour: go at once
    assert keep_warm_horizon(leaves, cold, cfg) < cold
    mixed_short = keep_warm_horizon((40.0,) * 18 + (3000.0,) * 2, cold, cfg)
    assert 40.0 <= mixed_short < 3000.0


@pytest.mark.parametrize("seed", range(6))
def test_keep_warm_horizon_is_the_best_fixed_keep_alive_by_brute_force(seed):
    rng = np.random.default_rng(seed)
    gaps = tuple(
        float(g) for g in rng.lognormal(mean=3.5, sigma=1.2, size=int(rng.integers(5, 60)))
    )
    cold, cfg = (
        float(rng.choice([5.0, 30.0, 120.0])),
        PolicyConfig(wait_cost_weight=float(rng.choice([0, 2, 8, 32]))),
    )
    penalty = cold * (1 + cfg.wait_cost_weight)
    unseen = min(max(2 * max(gaps), penalty), cfg.max_keep_alive_s)
    g = np.array(gaps + (unseen,))

    def cost(k: float) -> float:
        return float(np.minimum(g, k).sum() + penalty * (g > k).sum())

    grid = np.concatenate([np.linspace(0, cfg.max_keep_alive_s, 20001), g])
    best = min(cost(k) for k in grid)
    k = keep_warm_horizon(gaps, cold, cfg)
    assert 0 <= k <= cfg.max_keep_alive_s
    assert cost(k) <= best + 1e-6


def test_bounds():
    assert decide(obs(in_queue=100_000), PolicyConfig(max_workers=5)).desired_workers == 5
    assert decide(obs(), PolicyConfig(min_workers=1, max_workers=3)).desired_workers == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("target_utilization", 0.0),
        ("target_utilization", 1.5),
        ("max_workers", 0),
        ("min_workers", -1),
        ("latency_budget_s", -1.0),
        ("wait_cost_weight", -0.5),
        ("max_keep_alive_s", -1.0),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


def test_idle_gaps_count_only_spells_that_began_after_a_request():
    idle = IdleGaps(history=2)
    idle.observe(0.0, active=False)  # quiet since before anything was seen: no known start
    assert idle.idle_for(5.0) == 5.0
    idle.observe(10.0, active=True)
    assert list(idle.gaps) == [] and idle.idle_for(10.0) == 0.0
    for start, end in ((20.0, 50.0), (60.0, 61.0), (70.0, 90.0)):
        idle.observe(start, active=False)
        idle.observe(start + 1, active=False)  # a second quiet look does not move the spell's start
        idle.observe(end, active=True)
    assert list(idle.gaps) == [1.0, 20.0]  # the oldest of three fell out of a history of two
