"""`Every` (when to save) and `Keep` (what to keep), tested with plain inputs."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumable.policy import CostEstimate, Entry, Every, Keep, daly_interval, young_interval

# --------------------------------------------------------------------------- Every


def test_every_steps_is_due_on_multiples() -> None:
    policy = Every(steps=10)
    due = [s for s in range(0, 45) if policy.due(s, last_step=None, since_last_s=0.0)]
    assert due == [0, 10, 20, 30, 40]


def test_every_steps_after_a_save_waits_for_the_next_multiple() -> None:
    policy = Every(steps=10)
    assert not policy.due(15, last_step=10, since_last_s=0.0)
    assert not policy.due(19, last_step=10, since_last_s=0.0)
    assert policy.due(20, last_step=10, since_last_s=0.0)


def test_every_steps_catches_up_after_a_gap_of_a_full_interval() -> None:
    policy = Every(steps=10)
    assert not policy.due(22, last_step=13, since_last_s=0.0)
    assert policy.due(23, last_step=13, since_last_s=0.0)


def test_every_steps_ignores_elapsed_time() -> None:
    assert not Every(steps=10).due(7, last_step=None, since_last_s=1e12)


@pytest.mark.parametrize("policy", [Every(steps=1), Every(seconds=1), Every(steps=5, minutes=1)])
@pytest.mark.parametrize("step", [0, 5, 99, 100])
def test_never_due_at_or_before_the_last_saved_step(policy: Every, step: int) -> None:
    assert not policy.due(step, last_step=100, since_last_s=1e9)


def test_every_seconds_counts_from_the_last_save() -> None:
    policy = Every(seconds=5)
    assert policy.interval_seconds == 5
    assert not policy.due(1, last_step=None, since_last_s=4.999)
    assert policy.due(1, last_step=None, since_last_s=5.0)
    assert not policy.due(3, last_step=2, since_last_s=0.0)
    assert policy.due(3, last_step=2, since_last_s=7.5)


def test_every_minutes_is_sixty_seconds_each() -> None:
    policy = Every(minutes=0.5)
    assert policy.interval_seconds == 30
    assert not policy.due(10, last_step=1, since_last_s=29.9)
    assert policy.due(10, last_step=1, since_last_s=30.0)


def test_every_combination_is_due_on_whichever_comes_first() -> None:
    policy = Every(steps=100, minutes=30)
    assert policy.interval_seconds == 1800
    assert policy.due(100, last_step=0, since_last_s=1.0)
    assert policy.due(50, last_step=0, since_last_s=1800.0)
    assert not policy.due(50, last_step=0, since_last_s=1799.0)


def test_every_seconds_and_minutes_take_the_shorter_interval() -> None:
    assert Every(seconds=90, minutes=1).interval_seconds == 60
    assert Every(seconds=10, minutes=1).interval_seconds == 10
    assert Every(steps=3).interval_seconds is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"steps": 0},
        {"steps": -5},
        {"steps": 2.5},
        {"steps": "10"},
        {"seconds": 0},
        {"seconds": -1.0},
        {"seconds": math.nan},
        {"seconds": "5"},
        {"minutes": 0},
        {"minutes": -0.5},
        {"steps": 10, "minutes": -1},
    ],
)
def test_every_rejects_invalid_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Every"):
        Every(**kwargs)


def test_every_is_a_frozen_value() -> None:
    assert Every(steps=10) == Every(steps=10)
    with pytest.raises(AttributeError):
        Every(steps=10).steps = 20  # type: ignore[misc]


# --------------------------------------------------------------------------- optimal interval

DAY = 86400.0


def test_young_interval_is_sqrt_of_twice_cost_times_mtbf() -> None:
    assert young_interval(8.0, 100.0) == 40.0  # sqrt(1600)
    assert young_interval(0.5, 3600.0) == 60.0  # sqrt(3600)
    assert young_interval(60.0, DAY) == pytest.approx(3219.9379, abs=1e-4)  # sqrt(10_368_000)
    assert young_interval(0.0, DAY) == 0.0


def test_daly_interval_against_hand_computed_values() -> None:
    # C/(2M) = 1/9: sqrt(2*2*9) * (1 + 1/9 + 1/81) - 2 = 6 * 91/81 - 2 = 384/81
    assert daly_interval(2.0, 9.0) == pytest.approx(384 / 81, rel=1e-12)
    # C/(2M) = 1/100: 10 * (1 + 1/30 + 1/900) - 1 = 841/90
    assert daly_interval(1.0, 50.0) == pytest.approx(841 / 90, rel=1e-12)
    # C = 60 s, M = 24 h: 3219.9379 * (1 + sqrt(1/2880)/3 + 1/25920) - 60
    assert daly_interval(60.0, DAY) == pytest.approx(3180.0621, abs=1e-4)
    assert daly_interval(0.0, DAY) == 0.0


@pytest.mark.parametrize(("mtbf_min", "published_min"), [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_interval_reproduces_the_papers_worked_examples(
    mtbf_min: float, published_min: float
) -> None:
    """Daly (2006), figures 3-5: dump time 5 min; the optimum given to 2-3 digits."""
    tau = daly_interval(5 * 60.0, mtbf_min * 60.0) / 60.0
    assert round(tau, 1 if published_min < 10 else 0) == published_min


def test_daly_interval_is_the_mtbf_once_the_cost_reaches_twice_the_mtbf() -> None:
    assert daly_interval(10.0, 5.0) == 5.0
    assert daly_interval(1e6, 5.0) == 5.0
    # Just below the switch the series gives sqrt(2CM) * (1 - 1/3)^2 = 8M/9 of the MTBF.
    assert daly_interval(9.999999, 5.0) == pytest.approx(5.0 * 8 / 9, rel=1e-6)


@pytest.mark.parametrize("fn", [young_interval, daly_interval])
@pytest.mark.parametrize(
    ("cost", "mtbf"),
    [
        (-1.0, DAY),
        (math.nan, DAY),
        (math.inf, DAY),
        (1.0, 0.0),
        (1.0, -DAY),
        (1.0, math.nan),
        (1.0, math.inf),
        (True, DAY),
        ("1", DAY),
    ],
)
def test_interval_functions_reject_invalid_inputs(fn: Any, cost: Any, mtbf: Any) -> None:
    bad = "cost" if mtbf == DAY else "mtbf"
    with pytest.raises(ValueError, match=bad):
        fn(cost, mtbf)


costs = st.floats(1e-6, 1e6)
mtbfs = st.floats(1e-3, 1e9)
factors = st.floats(1.001, 1000.0)


@given(cost=costs, mtbf=mtbfs)
def test_daly_interval_properties(cost: float, mtbf: float) -> None:
    tau = daly_interval(cost, mtbf)
    assert tau > 0
    if cost < 2 * mtbf:
        # Equivalent closed form: sqrt(2CM) * (1 - sqrt(C/2M)/3)^2, so Daly < Young.
        closed = math.sqrt(2 * cost * mtbf) * (1 - math.sqrt(cost / (2 * mtbf)) / 3) ** 2
        assert tau == pytest.approx(closed, rel=1e-9)
        assert tau < young_interval(cost, mtbf)
        assert tau <= mtbf * 8 / 9 * (1 + 1e-12)  # below the value M it switches to
    else:
        assert tau == mtbf


@given(cost=costs, mtbf=mtbfs, factor=factors)
def test_daly_interval_grows_with_mtbf_on_each_branch(
    cost: float, mtbf: float, factor: float
) -> None:
    longer = mtbf * factor
    if cost < 2 * mtbf or cost >= 2 * longer:  # both on the same branch
        assert daly_interval(cost, longer) > daly_interval(cost, mtbf)


def test_daly_interval_is_not_monotone_in_mtbf_across_the_switch() -> None:
    # At C = 2M the formula jumps from 8M/9 to M: the only place a longer MTBF shortens it.
    assert daly_interval(10.0, 5.0) == 5.0
    assert daly_interval(10.0, 5.001) < 5.0


@given(cost=costs, mtbf=mtbfs, factor=factors)
def test_daly_interval_never_shrinks_when_the_cost_grows(
    cost: float, mtbf: float, factor: float
) -> None:
    assert daly_interval(cost * factor, mtbf) >= daly_interval(cost, mtbf)


# --------------------------------------------------------------------------- CostEstimate


def test_cost_estimate_is_none_before_the_first_observation() -> None:
    est = CostEstimate()
    assert est.value is None
    assert est.count == 0
    assert est.window == 5


def test_cost_estimate_is_the_median_of_the_last_window() -> None:
    est = CostEstimate(window=3)
    est.observe(9.0)  # the slow first save
    assert est.value == 9.0
    est.observe(1.0)
    assert est.value == 5.0  # median of two is their mean
    est.observe(2.0)
    assert est.value == 2.0  # the outlier no longer decides
    est.observe(3.0)  # 9.0 leaves the window
    est.observe(4.0)
    assert est.value == 3.0
    assert est.count == 5
    assert "window=3" in repr(est)


def test_cost_estimate_follows_a_lasting_change_within_half_a_window() -> None:
    est = CostEstimate(window=5)
    for _ in range(5):
        est.observe(1.0)
    est.observe(10.0)
    est.observe(10.0)
    assert est.value == 1.0
    est.observe(10.0)
    assert est.value == 10.0


@pytest.mark.parametrize("seconds", [-0.001, math.nan, math.inf, None, "1", True])
def test_cost_estimate_rejects_invalid_observations(seconds: Any) -> None:
    est = CostEstimate()
    est.observe(0.0)
    with pytest.raises(ValueError, match="cost"):
        est.observe(seconds)
    assert est.count == 1
    assert est.value == 0.0


@pytest.mark.parametrize("window", [0, -1, 2.0, True, None])
def test_cost_estimate_rejects_invalid_windows(window: Any) -> None:
    with pytest.raises(ValueError, match="window"):
        CostEstimate(window=window)


# --------------------------------------------------------------------------- Every(auto=True)


def test_auto_interval_is_daly_of_the_measured_cost() -> None:
    policy = Every(auto=True, mtbf=DAY)
    assert policy.interval_seconds is None
    assert policy.interval_seconds_for(60.0) == daly_interval(60.0, DAY)
    assert policy.interval_seconds_for(60.0) == pytest.approx(3180.0621, abs=1e-4)


def test_auto_interval_before_any_cost_is_the_lower_bound() -> None:
    assert Every(auto=True, mtbf=DAY).interval_seconds_for(None) == 1.0
    assert Every(auto=True, mtbf=DAY, min_seconds=30).interval_seconds_for(None) == 30.0


def test_auto_interval_is_clamped_to_its_bounds() -> None:
    policy = Every(auto=True, mtbf=DAY, min_seconds=60, max_seconds=3600)
    assert policy.bounds == (60.0, 3600.0)
    assert policy.interval_seconds_for(0.0) == 60.0
    assert policy.interval_seconds_for(0.01) == 60.0  # Daly: about 41.5 s
    assert policy.interval_seconds_for(1.0) == pytest.approx(daly_interval(1.0, DAY))
    assert policy.interval_seconds_for(600.0) == 3600.0  # Daly: about 9.6 h
    assert Every(auto=True, mtbf=1e12).interval_seconds_for(60.0) == 24 * 3600.0
    assert Every(auto=True, mtbf=5.0).interval_seconds_for(1e3) == 5.0  # C >= 2M: M


def test_fixed_policies_ignore_the_cost() -> None:
    assert Every(seconds=5).interval_seconds_for(1e6) == 5
    assert Every(seconds=5).interval_seconds_for(None) == 5
    assert Every(steps=10).interval_seconds_for(3.0) is None
    assert Every(seconds=5).due(1, last_step=None, since_last_s=5.0, cost_s=1e6)
    assert not Every(steps=10).due(7, last_step=None, since_last_s=1e9, cost_s=0.0)


def test_auto_due_is_reevaluated_as_the_cost_changes() -> None:
    policy = Every(auto=True, mtbf=DAY)
    since = 1000.0
    assert policy.due(5, last_step=4, since_last_s=since, cost_s=1.0)  # interval ~ 413 s
    assert not policy.due(5, last_step=4, since_last_s=since, cost_s=60.0)  # ~ 3180 s
    assert policy.due(5, last_step=4, since_last_s=3180.1, cost_s=60.0)
    assert not policy.due(5, last_step=4, since_last_s=3180.0, cost_s=60.0)


def test_auto_due_with_a_cost_estimate_fed_by_measurements() -> None:
    policy = Every(auto=True, mtbf=DAY)
    est = CostEstimate(window=3)
    assert policy.due(1, last_step=None, since_last_s=1.0, cost_s=est.value)  # measure early
    est.observe(30.0)  # a slow first save
    assert not policy.due(2, last_step=1, since_last_s=600.0, cost_s=est.value)  # ~ 2250 s
    est.observe(0.5)
    est.observe(0.5)
    assert policy.due(2, last_step=1, since_last_s=600.0, cost_s=est.value)  # ~ 293 s
    assert not policy.due(2, last_step=1, since_last_s=200.0, cost_s=est.value)


def test_auto_is_never_due_at_or_before_the_last_saved_step() -> None:
    policy = Every(auto=True, mtbf=DAY)
    assert not policy.due(100, last_step=100, since_last_s=1e9, cost_s=None)
    assert not policy.due(99, last_step=100, since_last_s=1e9, cost_s=1.0)


@given(
    mtbf=mtbfs,
    lo=st.floats(0.01, 1e4),
    span=st.floats(1.0, 1e4),
    cost=st.one_of(st.none(), st.floats(0.0, 1e7)),
    factor=factors,
)
def test_auto_interval_stays_in_bounds_and_grows_with_the_cost(
    mtbf: float, lo: float, span: float, cost: float | None, factor: float
) -> None:
    policy = Every(auto=True, mtbf=mtbf, min_seconds=lo, max_seconds=lo * span)
    interval = policy.interval_seconds_for(cost)
    assert interval is not None
    assert lo <= interval <= lo * span
    if cost is not None:
        larger = policy.interval_seconds_for(cost * factor)
        assert larger is not None and larger >= interval


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"auto": True}, "needs mtbf"),
        ({"auto": True, "mtbf": DAY, "steps": 100}, "takes no steps"),
        ({"auto": True, "mtbf": DAY, "seconds": 60}, "takes no seconds"),
        ({"auto": True, "mtbf": DAY, "minutes": 1}, "takes no minutes"),
        ({"auto": True, "mtbf": 0}, "mtbf"),
        ({"auto": True, "mtbf": -DAY}, "mtbf"),
        ({"auto": True, "mtbf": math.nan}, "mtbf"),
        ({"auto": True, "mtbf": math.inf}, "mtbf"),
        ({"auto": True, "mtbf": "86400"}, "mtbf"),
        ({"auto": True, "mtbf": True}, "mtbf"),
        ({"auto": True, "mtbf": DAY, "min_seconds": 0}, "min_seconds"),
        ({"auto": True, "mtbf": DAY, "max_seconds": -1}, "max_seconds"),
        ({"auto": True, "mtbf": DAY, "max_seconds": math.inf}, "max_seconds"),
        ({"auto": True, "mtbf": DAY, "min_seconds": 10, "max_seconds": 5}, "must not exceed"),
        ({"auto": True, "mtbf": DAY, "min_seconds": 2 * DAY}, "must not exceed"),
        ({"auto": "yes", "mtbf": DAY}, "auto"),
        ({"auto": 1, "mtbf": DAY}, "auto"),
        ({"steps": 10, "mtbf": DAY}, "only read with auto"),
        ({"seconds": 10, "min_seconds": 1}, "only read with auto"),
        ({"minutes": 10, "max_seconds": 0}, "only read with auto"),
        ({"mtbf": DAY}, "only read with auto"),
    ],
)
def test_every_auto_rejects_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Every(**kwargs)


def test_every_auto_is_a_frozen_value() -> None:
    assert Every(auto=True, mtbf=DAY) == Every(auto=True, mtbf=DAY)
    assert Every(auto=True, mtbf=DAY) != Every(auto=True, mtbf=DAY, max_seconds=3600)
    with pytest.raises(AttributeError):
        Every(auto=True, mtbf=DAY).mtbf = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------- Keep


def entries(*steps: int, **metrics_by_step: Any) -> list[Entry]:
    return [Entry(s, metrics_by_step.get(f"s{s}", {})) for s in steps]


def test_keep_default_is_the_three_newest() -> None:
    assert Keep().retained(entries(*range(1, 11))) == {8, 9, 10}


def test_keep_last_ignores_input_order() -> None:
    shuffled = entries(40, 10, 30, 20, 50)
    assert Keep(last=2).retained(shuffled) == {40, 50}
    assert Keep(last=2).to_delete(shuffled) == [10, 20, 30]


def test_keep_last_larger_than_the_number_of_checkpoints_keeps_all() -> None:
    assert Keep(last=10).retained(entries(1, 2, 3)) == {1, 2, 3}
    assert Keep(last=10).to_delete(entries(1, 2, 3)) == []


def test_keep_nothing_to_decide_on_no_checkpoints() -> None:
    assert Keep(last=1).retained([]) == set()
    assert Keep(last=1).to_delete([], pinned=[5]) == []


def test_keep_best_min_with_ties_prefers_the_newer_step() -> None:
    es = [
        Entry(1, {"loss": 0.5}),
        Entry(2, {"loss": 0.1}),
        Entry(3, {"loss": 0.9}),
        Entry(4, {"loss": 0.1}),
        Entry(5, {"loss": 0.7}),
        Entry(6, {"loss": 0.8}),
    ]
    assert Keep(last=1, best=("loss", "min", 1)).retained(es) == {4, 6}
    assert Keep(last=1, best=("loss", "min", 2)).retained(es) == {2, 4, 6}
    assert Keep(last=1, best=("loss", "min", 3)).retained(es) == {1, 2, 4, 6}


def test_keep_best_max() -> None:
    es = [
        Entry(1, {"acc": 0.5}),
        Entry(2, {"acc": 0.95}),
        Entry(3, {"acc": 0.95}),
        Entry(4, {"acc": 0.2}),
        Entry(5, {"acc": 0.1}),
    ]
    assert Keep(last=None, best=("acc", "max", 1)).retained(es) == {3, 5}
    assert Keep(last=None, best=("acc", "max", 2)).retained(es) == {2, 3, 5}


def test_keep_best_skips_missing_and_non_finite_metrics() -> None:
    es = [
        Entry(1, {"loss": 0.9}),
        Entry(2, {}),
        Entry(3, {"loss": math.nan}),
        Entry(4, {"loss": "nan"}),  # how a NaN metric is stored in a manifest
        Entry(5, {"loss": -math.inf}),
        Entry(6, {"loss": True}),
        Entry(7, {"other": 0.0}),
        Entry(8, {"loss": 0.3}),
        Entry(9, {"loss": None}),
        Entry(10, {"loss": 5}),
    ]
    keep = Keep(last=None, best=("loss", "min", 2))
    assert keep.retained(es) == {8, 1, 10}
    assert keep.to_delete(es) == [2, 3, 4, 5, 6, 7, 9]


def test_keep_best_with_no_scored_checkpoint_still_keeps_the_newest() -> None:
    es = [Entry(1, {}), Entry(2, {"loss": math.nan}), Entry(3, {"acc": 1.0})]
    assert Keep(last=None, best=("loss", "min", 3)).retained(es) == {3}


def test_keep_every_steps_keeps_multiples() -> None:
    es = entries(*range(5, 101, 5))
    assert Keep(last=1, every_steps=25).retained(es) == {25, 50, 75, 100}
    assert Keep(last=2, every_steps=30).retained(es) == {30, 60, 90, 95, 100}


def test_keep_pinned_survive_and_unknown_pins_are_ignored() -> None:
    es = entries(1, 2, 3, 4, 5)
    assert Keep(last=1).retained(es, pinned=[2, 3]) == {2, 3, 5}
    assert Keep(last=1).retained(es, pinned={42}) == {5}
    assert Keep(last=1).to_delete(es, pinned=(1,)) == [2, 3, 4]


def test_keep_newest_is_kept_even_when_it_is_the_worst() -> None:
    es = [Entry(1, {"loss": 0.1}), Entry(2, {"loss": 0.2}), Entry(3, {"loss": 99.0})]
    assert Keep(last=None, best=("loss", "min", 1)).retained(es) == {1, 3}
    assert Keep(last=None, every_steps=2).retained(es) == {2, 3}


def test_keep_union_of_all_rules() -> None:
    es = [Entry(s, {"loss": 1.0 / s if s != 7 else 0.0}) for s in range(1, 13)]
    keep = Keep(last=2, best=("loss", "min", 1), every_steps=5)
    assert keep.retained(es, pinned=[3]) == {3, 5, 7, 10, 11, 12}


def test_keeps_all() -> None:
    assert Keep(last=None).keeps_all
    assert Keep(last=None).retained(entries(1, 2, 3), pinned=[]) == {1, 2, 3}
    assert Keep(last=None).to_delete(entries(1, 2, 3)) == []
    assert not Keep().keeps_all
    assert not Keep(last=None, every_steps=5).keeps_all
    assert not Keep(last=None, best=("loss", "min", 1)).keeps_all


@pytest.mark.parametrize(
    "kwargs",
    [
        {"last": 0},
        {"last": -1},
        {"last": 2.0},
        {"last": "3"},
        {"best": ("loss", "min")},
        {"best": ("loss", "avg", 1)},
        {"best": ("loss", "min", 0)},
        {"best": ("loss", "min", 1.5)},
        {"best": (3, "min", 1)},
        {"best": ["loss", "min", 1]},
        {"best": "loss"},
        {"every_steps": 0},
        {"every_steps": -10},
        {"every_steps": 2.5},
    ],
)
def test_keep_rejects_invalid_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Keep"):
        Keep(**kwargs)


metric_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-5, 5),
    st.none(),
    st.just("nan"),
)
keeps = st.builds(
    Keep,
    last=st.one_of(st.none(), st.integers(1, 5)),
    best=st.one_of(
        st.none(),
        st.tuples(st.just("loss"), st.sampled_from(["min", "max"]), st.integers(1, 4)),
    ),
    every_steps=st.one_of(st.none(), st.integers(1, 7)),
)


@given(
    keep=keeps,
    steps=st.sets(st.integers(0, 60), max_size=15),
    values=st.lists(metric_values, min_size=15, max_size=15),
    pinned=st.sets(st.integers(0, 70), max_size=5),
)
def test_keep_invariants(keep: Keep, steps: set[int], values: list[Any], pinned: set[int]) -> None:
    es = [Entry(s, {} if v is None else {"loss": v}) for s, v in zip(sorted(steps), values)]
    kept = keep.retained(es, pinned)
    deleted = keep.to_delete(es, pinned)

    assert kept <= steps
    assert set(deleted) == steps - kept
    assert deleted == sorted(deleted)
    if steps:
        assert max(steps) in kept
    assert pinned & steps <= kept
    if keep.last is not None:
        assert set(sorted(steps)[-keep.last :]) <= kept
    if keep.every_steps is not None:
        assert {s for s in steps if s % keep.every_steps == 0} <= kept
    if keep.best is not None:
        _, mode, k = keep.best
        sign = 1 if mode == "min" else -1
        scored = sorted(
            (sign * e.metrics["loss"], e.step)
            for e in es
            if type(e.metrics.get("loss")) in (int, float) and math.isfinite(e.metrics["loss"])
        )
        if scored:
            cutoff = scored[min(k, len(scored)) - 1][0]
            assert {s for v, s in scored if v < cutoff} <= kept
            assert len({s for v, s in scored if v <= cutoff} & kept) >= min(k, len(scored))
    if keep.keeps_all:
        assert kept == steps
    elif keep.best is None:
        expected = {s for s in steps if s in pinned}
        expected |= set(sorted(steps)[-(keep.last or 1) :])
        if keep.every_steps is not None:
            expected |= {s for s in steps if s % keep.every_steps == 0}
        assert kept == expected
