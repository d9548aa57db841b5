"""Validation of saved data-position states: the checks shared by the sampler and the loader.

A state comes back from a checkpoint's JSON tree, so it is checked like any other input from
disk: exact key set, known version, types, ranges. Every failure is a `StateMismatchError`
that names the key, what was expected and what was found, raised before anything changes.
"""

from collections.abc import Mapping
from typing import Any

from resumable.errors import StateMismatchError

MASK64 = (1 << 64) - 1


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_u64(name: str, value: object) -> int:
    """``value`` as an int in [0, 2**64); `TypeError`/`ValueError` for a bad argument."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    assert isinstance(value, int)
    if not 0 <= value <= MASK64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def validated_state(
    state: object,
    what: str,
    versions: tuple[int, ...],
    keys: Mapping[int, Mapping[str, type]],
) -> dict[str, Any]:
    """Check a saved state's shape: a mapping whose ``version`` is one of ``versions`` and
    whose other keys are exactly ``keys[version]``, each of the given type (``int`` means a
    non-negative int below 2**64, never a bool; ``object`` accepts anything)."""
    if not isinstance(state, Mapping):
        raise StateMismatchError(
            f"{what} state must be a mapping (the dict returned by state_dict()), "
            f"found {type(state).__name__}; pass the saved state_dict unchanged."
        )
    version = state.get("version")
    if not is_int(version) or version not in versions:
        raise StateMismatchError(
            f"{what} state has version {version!r}, this library reads versions "
            f"{list(versions)}; restore it with the resumable version that wrote it."
        )
    assert isinstance(version, int)
    spec = keys[version]
    expected = {"version", *spec}
    found = set(state)
    if found != expected:
        missing = sorted(expected - found, key=str)
        extra = sorted(found - expected, key=str)
        raise StateMismatchError(
            f"{what} state has the wrong keys: missing {missing}, unexpected {extra}; expected "
            f"exactly {sorted(expected)}. Pass the dict produced by {what}.state_dict()."
        )
    for key, kind in spec.items():
        value = state[key]
        if kind is int:
            ok = is_int(value) and 0 <= value <= MASK64
            want = "an int in [0, 2**64)"
        elif kind is object:
            ok, want = True, "anything"
        else:
            ok = isinstance(value, kind)
            want = f"a {kind.__name__}"
        if not ok:
            raise StateMismatchError(
                f"{what} state[{key!r}] must be {want}, found {type(value).__name__} "
                f"{value!r}; the checkpoint is damaged or not a {what} state."
            )
    return dict(state)


def expect_same(what: str, key: str, saved: object, current: object, fix: str) -> None:
    if saved != current:
        raise StateMismatchError(
            f"{what} checkpoint was saved with {key}={saved!r} but this {what} has "
            f"{key}={current!r}; resuming would not continue the same sample sequence. {fix}"
        )
