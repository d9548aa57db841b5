"""`Every` (when to save) and `Keep` (what to keep), tested with plain inputs."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumable.policy import Entry, Every, Keep

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
