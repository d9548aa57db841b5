"""The capture plan (issue 20): a module's or optimizer's tree node and tensors are reused
from one snapshot to the next while a cheap check says the structure they were made from
is unchanged; any change of structure is walked again, and a snapshot through a plan
is exactly what a full walk gives.

Two levels: `capture` with a plan against `capture` without one after every kind of
change (the same JSON, names and tensor values), and snapshots through a `Checkpointer`
persisted and restored at every step (bit-identical values)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from resumable._capture_plan import CapturePlan, NumpyState, PythonState
from resumable.capture import CLASSES_KEY, Captured, capture, decode
from resumable.pipeline.memory import TreeJSON
from resumable.reader import CheckpointReader
from resumable.snapshot import CopyPlan
from resumable.storage.local import LocalStorage
from state_checks import assert_same, shm_dir, snapshot_each

__all__ = ["shm_dir"]  # a fixture


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))
        self.head = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(1))


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {
        "epoch": 0,
        "nested": {"a": {"x": torch.randn(3), "y": torch.randn(2)}, "b": {"z": torch.randn(4)}},
        "hist": [torch.randn(2), 1.5, (1, "two")],
        "lists": [[torch.randn(2), torch.randn(3)], [torch.randn(4)]],
    }
    model.body[0].register_buffer("extra", torch.randn(2))
    return {"model": model, "optim": optim, "extra": extra}


def train(state: dict[str, Any]) -> None:
    """An optimizer step on random gradients (any change below leaves it possible)."""
    optim = state["optim"]
    for group in optim.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    optim.step()
    state["model"].count.add_(1)


def text(c: Captured) -> str:
    return json.dumps(c.tree, separators=(",", ":"), allow_nan=False)


def assert_equivalent(
    got: Captured, want: Captured, where: str, tree_json: TreeJSON | None = None
) -> None:
    """``got`` (through a plan) is what a full walk ``want`` gave: the same tree JSON,
    tensor names in order, dtypes, shapes, devices and values; and, with ``tree_json``
    (the memory tier's encoder, fed every planned capture in turn), the same text
    through it, though it reuses the texts the plan made (`KnownJSON`)."""
    assert text(got) == text(want), where
    if tree_json is not None:
        assert str(tree_json.encode(got.tree)) == text(want), where
    assert list(got.tensors) == list(want.tensors), where
    for name, w in want.tensors.items():
        g = got.tensors[name]
        assert (g.dtype, g.shape, g.device) == (w.dtype, w.shape, w.device), (where, name)
        assert torch.equal(g.detach(), w), (where, name)


# Changes between captures: (name, change). Each would make a stale plan wrong.
def _replace_param(s: dict[str, Any]) -> None:
    s["model"].head.weight = nn.Parameter(torch.randn(2, 3))


def _resize_data(s: dict[str, Any]) -> None:
    bias = s["model"].head._parameters.get("bias")  # renamed by another change, maybe
    if bias is None:
        return
    bias.data = torch.randn(5)
    s["optim"].state.pop(bias, None)  # its moments no longer fit


def _transpose_data(s: dict[str, Any]) -> None:  # same shape and storage, other strides
    w = s["model"].body[0].weight
    w.data = w.data.t()


def _other_dtype(s: dict[str, Any]) -> None:
    bias = s["model"].body[2].bias
    bias.data = bias.data.double()
    s["optim"].state.pop(bias, None)


def _new_buffer(s: dict[str, Any]) -> None:
    s["model"].head.register_buffer(f"b{random.randrange(10**6)}", torch.randn(2))


def _replace_buffer(s: dict[str, Any]) -> None:
    s["model"].count = s["model"].count + 1


def _non_persistent(s: dict[str, Any]) -> None:
    m = s["model"]
    m.register_buffer("count", m.count, persistent=False)


def _persistent_again(s: dict[str, Any]) -> None:
    m = s["model"]
    m.register_buffer("count", m.count, persistent=True)


def _add_submodule(s: dict[str, Any]) -> None:
    s["model"].body.append(nn.Linear(3, 3))


def _submodule_none(s: dict[str, Any]) -> None:
    s["model"].body[1] = None


def _hook(s: dict[str, Any]) -> None:
    def add(module: nn.Module, sd: dict[str, Any], prefix: str, meta: Any) -> None:
        sd[prefix + "hooked"] = torch.full((2,), 7.0)

    s["model"].head.register_state_dict_post_hook(add)


def _own_state_dict(s: dict[str, Any]) -> None:
    head = s["model"].head
    head.state_dict = lambda *a, **k: {"own": torch.ones(1)}  # type: ignore[method-assign]


def _param_group(s: dict[str, Any]) -> None:
    s["optim"].add_param_group({"params": [nn.Parameter(torch.randn(3))], "lr": 0.5})


def _reorder_params(s: dict[str, Any]) -> None:  # the same lengths, other indices
    params = s["optim"].param_groups[0]["params"]
    params[0], params[1] = params[1], params[0]


def _lr(s: dict[str, Any]) -> None:
    for g in s["optim"].param_groups:
        g["lr"] = g["lr"] * 0.5


def _reload_optimizer(s: dict[str, Any]) -> None:
    s["optim"].load_state_dict(s["optim"].state_dict())


def _optimizer_float_step(s: dict[str, Any]) -> None:
    for st_ in s["optim"].state.values():
        st_["seen"] = float(len(st_)) + random.random()


def _optimizer_hook(s: dict[str, Any]) -> None:
    def post(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        sd["param_groups"][0]["hooked"] = 1
        sd["extra_key"] = 5
        return sd

    s["optim"].register_state_dict_post_hook(post)


def _renamed(d: dict[Any, Any], old: Any, new: Any) -> None:
    """Rename ``old`` to ``new`` in place, keeping its position and value object."""
    items = list(d.items())
    d.clear()
    d.update((new if k == old else k, v) for k, v in items)


def _rename_param(s: dict[str, Any]) -> None:  # the same objects in the same order
    params = s["model"].head._parameters
    _renamed(params, "bias", "bias2") if "bias" in params else _renamed(params, "bias2", "bias")


def _aux_moment(s: dict[str, Any]) -> None:  # adds a key, then renames it in place
    st_ = next(iter(s["optim"].state.values()), None)
    if st_ is None:
        return
    if "aux" in st_:
        _renamed(st_, "aux", "aux2")
    elif "aux2" in st_:
        _renamed(st_, "aux2", "aux")
    else:
        st_["aux"] = 1


def _shift_moment(s: dict[str, Any]) -> None:  # adds a key, then moves it to the next dict
    inner = list(s["optim"].state.values())
    if len(inner) < 2:
        return
    if "aux" in inner[0]:
        moved = inner[0].pop("aux")
        rest = dict(inner[1])
        inner[1].clear()
        inner[1].update({"aux": moved, **rest})
    elif "aux" not in inner[1]:
        inner[0]["aux"] = 1


class OwnSave(nn.Linear):
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "own"] = torch.ones(1)


def _own_class(s: dict[str, Any]) -> None:  # a submodule's class changes in place
    s["model"].head.__class__ = OwnSave


def _renamed_class(s: dict[str, Any]) -> None:  # the top module's recorded class changes
    s["model"].__class__ = type("Renamed", (Net,), {})


def _shift_buffer(s: dict[str, Any]) -> None:
    """A key moved from one module's dict to the front of the next dict of the walk
    (the flattened keys and values stay the same; the names do not)."""
    body = s["model"].body
    first, second = body[0], body[1]
    if "extra" in first._buffers and second is not None:  # `_submodule_none` may run first
        moved = first._buffers.pop("extra")
        params = dict(second._parameters)
        second._parameters.clear()
        second._parameters.update({"extra": moved, **params})


def _epoch(s: dict[str, Any]) -> None:
    s["extra"]["epoch"] += 1


def _shift_key(s: dict[str, Any]) -> None:  # the same flattened keys and values, other names
    nested = s["extra"]["nested"]
    a, b = nested["a"], nested["b"]
    if "y" in a:
        moved = a.pop("y")
        rest = dict(b)
        b.clear()
        b.update({"y": moved, **rest})


def _shift_item(s: dict[str, Any]) -> None:  # the same flattened items, other names
    first, second = s["extra"]["lists"]
    if len(first) == 2:
        second.insert(0, first.pop())


def _list_append(s: dict[str, Any]) -> None:
    s["extra"]["hist"].append(torch.ones(2))


def _list_replace(s: dict[str, Any]) -> None:
    s["extra"]["hist"][0] = torch.randn(3)


def _extra_in_place(s: dict[str, Any]) -> None:
    s["extra"]["nested"]["a"]["x"].add_(1)


def _numpy_leaf(s: dict[str, Any]) -> None:
    s["extra"]["arr"] = np.arange(4.0)


def _new_entry(s: dict[str, Any]) -> None:
    s["extra"]["more"] = torch.arange(3)


def _swap_module(s: dict[str, Any]) -> None:
    s["model"], s["other"] = Net(), s["model"]


def _draws(s: dict[str, Any]) -> None:
    random.random()
    np.random.randn()
    torch.rand(1)


def _numpy_cached_gauss(s: dict[str, Any]) -> None:
    np.random.randn()  # the pair's second is kept: NumPy's words and position stay


def _python_twist(s: dict[str, Any]) -> None:
    for _ in range(400):  # past the 624 words: new words, not only a new position
        random.random()


def _python_gauss(s: dict[str, Any]) -> None:
    random.gauss(0, 1)  # a Gaussian kept (gauss_next), or the kept one used


def _lr_tensor(s: dict[str, Any]) -> None:
    for g in s["optim"].param_groups:
        lr = g["lr"]
        g["lr"] = torch.tensor(0.5) if not isinstance(lr, torch.Tensor) else lr * 0.5


def _group_list_in_place(s: dict[str, Any]) -> None:
    """A mutable group value changed in place: the same object, another content."""
    for g in s["optim"].param_groups:
        g.setdefault("history", []).append(len(g.get("history", [])) + 0.5)


def _group_int_key(s: dict[str, Any]) -> None:
    """A group key that is no string (the walk takes ints): that group is walked."""
    group = s["optim"].param_groups[0]
    group[7] = group.get(7, 0) + 1


def _group_same_number(s: dict[str, Any]) -> None:
    """Values equal in Python but not in JSON (1, 1.0, True), as new objects."""
    for g in s["optim"].param_groups:
        kind = g.get("flag", 1.0)
        g["flag"] = {bool: 1, int: 1.0, float: True}[type(kind)]


CHANGES: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("train", train),
    ("nothing", lambda s: None),
    ("replace-param", _replace_param),
    ("resize-data", _resize_data),
    ("transpose-data", _transpose_data),
    ("other-dtype", _other_dtype),
    ("new-buffer", _new_buffer),
    ("replace-buffer", _replace_buffer),
    ("non-persistent", _non_persistent),
    ("persistent-again", _persistent_again),
    ("add-submodule", _add_submodule),
    ("submodule-none", _submodule_none),
    ("state-dict-hook", _hook),
    ("own-state-dict", _own_state_dict),
    ("param-group", _param_group),
    ("reorder-params", _reorder_params),
    ("lr", _lr),
    ("reload-optimizer", _reload_optimizer),
    ("optimizer-float", _optimizer_float_step),
    ("optimizer-hook", _optimizer_hook),
    ("rename-param", _rename_param),
    ("aux-moment", _aux_moment),
    ("shift-moment", _shift_moment),
    ("own-class", _own_class),
    ("renamed-class", _renamed_class),
    ("shift-buffer", _shift_buffer),
    ("epoch", _epoch),
    ("shift-key", _shift_key),
    ("shift-item", _shift_item),
    ("list-append", _list_append),
    ("list-replace", _list_replace),
    ("extra-in-place", _extra_in_place),
    ("numpy-leaf", _numpy_leaf),
    ("new-entry", _new_entry),
    ("swap-module", _swap_module),
    ("draws", _draws),
    ("numpy-cached-gauss", _numpy_cached_gauss),
    ("python-twist", _python_twist),
    ("python-gauss", _python_gauss),
    ("lr-tensor", _lr_tensor),
    ("group-list-in-place", _group_list_in_place),
    ("group-same-number", _group_same_number),
    ("group-int-key", _group_int_key),
]


@pytest.mark.parametrize("name, change", CHANGES, ids=[n for n, _ in CHANGES])
def test_each_change_is_captured_as_a_full_walk_would(
    name: str, change: Callable[[dict[str, Any]], None]
) -> None:
    state = make_state()
    plan = CapturePlan()
    tree_json = TreeJSON()
    for step in range(7):
        if step in (3, 4):  # the change, and the same change again
            change(state)
        elif step:
            train(state)
        got = capture(state, plan=plan)
        assert_equivalent(got, capture(state), f"{name} step {step}", tree_json)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(range(len(CHANGES))), min_size=1, max_size=10))
def test_any_sequence_of_changes_is_captured_as_a_full_walk_would(picks: list[int]) -> None:
    state = make_state()
    plan = CapturePlan()
    tree_json = TreeJSON()
    assert_equivalent(capture(state, plan=plan), capture(state), "start", tree_json)
    for i, pick in enumerate(picks):
        name, change = CHANGES[pick]
        change(state)
        for again in range(2):  # the capture after a change, and the one reusing it
            got = capture(state, plan=plan)
            assert_equivalent(got, capture(state), f"{i} {name} {again}", tree_json)


def test_an_unchanged_structure_is_reused_with_the_live_tensors() -> None:
    state = make_state()
    train(state)
    plan = CapturePlan()
    assert not capture(state, plan=plan).reused  # planned
    train(state)
    got = capture(state, plan=plan)
    assert got.reused
    model, optim = state["model"], state["optim"]
    assert got.tensors["model/head.weight"] is model.head.weight  # not a detached copy
    moment = optim.state[model.head.weight]["exp_avg"]
    assert any(t is moment for t in got.tensors.values())
    _new_buffer(state)
    capture(state, plan=plan)  # the module walked again (the optimizer's part reused)
    again = capture(state, plan=plan)
    assert again.reused and any(n.startswith("model/head.b") for n in again.tensors)


def classes_of(c: Captured) -> Any:
    return next(node for key, node in c.tree["dict"] if key == CLASSES_KEY)


def test_the_classes_node_is_the_last_ones_while_the_entries_are_reused() -> None:
    """Reused entries hand out their own class tuples, so the ``__classes__`` node is the
    very object of the last capture (the memory tier's `TreeJSON` then reuses its text
    without comparing bytes); a stateful object added or taken away makes a new node,
    the same as a walk's."""
    state = make_state()
    train(state)
    plan = CapturePlan()
    capture(state, plan=plan)
    first = capture(state, plan=plan)
    train(state)
    second = capture(state, plan=plan)
    assert second.reused and classes_of(second) is classes_of(first)
    assert classes_of(second) == classes_of(capture(state))
    state["sched"] = torch.optim.lr_scheduler.StepLR(state["optim"], step_size=2)
    added = capture(state, plan=plan)
    assert classes_of(added) is not classes_of(second)
    assert_equivalent(added, capture(state), "a scheduler added")
    assert "torch.optim.lr_scheduler:StepLR" in text(added)
    del state["sched"]
    taken = capture(state, plan=plan)
    assert_equivalent(taken, capture(state), "the scheduler taken away")
    assert classes_of(taken) == classes_of(second) and "StepLR" not in text(taken)


def test_a_copy_plan_sees_what_the_capture_check_leaves_to_it() -> None:
    """A tensor resized or retyped in place keeps its object: the capture plan reuses
    the entry, and the copy plan's structure check is what refuses it (the memory tier
    then forgets the capture plan and walks again)."""
    model = Net()
    state = {"model": model}
    plan = CapturePlan()
    capture(state, plan=plan)
    for change in (
        lambda: setattr(model.head.bias, "data", torch.randn(5)),
        lambda: setattr(model.head.bias, "data", model.head.bias.data.double()),
    ):
        before = capture(state, plan=plan)
        copy_plan = CopyPlan(before.tensors)
        change()
        after = capture(state, plan=plan)
        assert after.reused and not copy_plan.matches(after.tensors)


def test_an_entry_that_never_keeps_its_structure_is_walked_each_time() -> None:
    """A module replacing a buffer at every step fails the check each time: after a few
    misses it is walked the ordinary way (each capture still exact)."""
    state = make_state()
    plan = CapturePlan()
    for step in range(12):
        _replace_buffer(state)
        got = capture(state, plan=plan)
        assert_equivalent(got, capture(state), f"step {step}")


@pytest.mark.parametrize("name, change", CHANGES, ids=[n for n, _ in CHANGES])
def test_snapshots_across_each_change_hold_the_state_bit_identically(
    tmp_path: Path, shm_dir: Path, name: str, change: Callable[[dict[str, Any]], None]
) -> None:
    """Snapshot at every step through a `Checkpointer` (persisted from its slot), the
    change in the middle: every step's checkpoint holds the state's state dicts as they
    were, dtypes, shapes and bytes."""
    state = make_state()
    stages: list[Callable[[], None]] = [
        lambda: train(state),
        lambda: train(state),
        lambda: change(state),
        lambda: train(state),
        lambda: None,
    ]
    expected = snapshot_each(tmp_path / "ck", shm_dir, state, stages)
    storage = LocalStorage(tmp_path / "ck")
    for step, want in enumerate(expected, start=1):
        reader = CheckpointReader(storage, step)
        got = decode(reader.tree, reader.tensors())
        got.pop(CLASSES_KEY, None)
        assert_same(as_dicts(got), as_dicts(want), f"step {step}")


def as_dicts(v: Any) -> Any:
    """``v`` with every mapping a plain dict (a module's state dict is an OrderedDict)."""
    if isinstance(v, dict):
        return {k: as_dicts(x) for k, x in v.items()}
    if isinstance(v, list):
        return [as_dicts(x) for x in v]
    if isinstance(v, tuple):
        return tuple(as_dicts(x) for x in v)
    return v


def test_numpy_state_is_read_again_exactly_when_it_changed() -> None:
    """Including a Gaussian restored by ``set_state`` with the words and position the
    stream already has: only the kept Gaussian differs."""
    reader = NumpyState()
    np.random.seed(11)
    np.random.randn()  # a pair: one Gaussian kept
    pending = np.random.get_state()
    np.random.randn()  # the kept one: words and position unchanged, none kept now
    for draw in [
        lambda: None,
        np.random.rand,  # the words and position change: the state made from the bytes
        lambda: np.random.set_state(pending),  # the same words and position, one kept
        lambda: None,
        np.random.randn,
        lambda: None,
        np.random.rand,
        np.random.randn,  # a pair: one Gaussian kept
        np.random.randn,  # the kept one: words and position unchanged
        lambda: None,
        lambda: np.random.seed(3),
        lambda: np.random.set_state(np.random.get_state()),
    ]:
        draw()
        got, want = reader.get(), np.random.get_state(legacy=False)
        assert list(got) == list(want) and list(got["state"]) == list(want["state"])
        assert got["bit_generator"] == want["bit_generator"]
        for k in ("pos",):
            assert type(got["state"][k]) is type(want["state"][k])
            assert got["state"][k] == want["state"][k]
        key, want_key = got["state"]["key"], want["state"]["key"]
        assert key.dtype == want_key.dtype and np.array_equal(key, want_key)
        for k in ("has_gauss", "gauss"):
            assert type(got[k]) is type(want[k]) and got[k] == want[k], k


def test_python_state_is_read_again_exactly_when_it_changed() -> None:
    reader = PythonState()
    random.seed(5)
    for draw in [
        lambda: None,
        random.random,  # past the words: a twist
        random.random,  # the position only
        lambda: None,
        lambda: random.gauss(0, 1),  # a Gaussian kept (gauss_next)
        lambda: random.gauss(0, 1),  # and used
        lambda: random.setstate(random.getstate()),
        lambda: random.seed(5),
        lambda: [random.random() for _ in range(700)],
    ]:
        draw()
        assert reader.get() == random.getstate()


def test_a_python_stream_moving_by_its_position_only_is_encoded_exactly() -> None:
    """While only Python's position moves, its node reuses the last words: the capture
    is still exactly a full walk's, and so is its JSON."""
    state = {"w": torch.zeros(2)}
    plan = CapturePlan()
    tree_json = TreeJSON()
    random.seed(9)
    for i in range(30):
        random.random() if i % 3 else random.getrandbits(8)
        got, want = capture(state, plan=plan), capture(state)
        assert_equivalent(got, want, f"draw {i}")
        assert str(tree_json.encode(got.tree)) == text(want)


def test_numpy_state_follows_a_replaced_bit_generator() -> None:
    rs = np.random.mtrand._rand
    original = rs._bit_generator
    reader = NumpyState()
    reader.get()
    try:
        np.random.set_bit_generator(np.random.PCG64(5))
        assert reader.get()["bit_generator"] == "PCG64"
        np.random.random()
        assert reader.get() == np.random.get_state(legacy=False)
    finally:
        np.random.set_bit_generator(original)
    assert reader.get()["bit_generator"] == "MT19937"


def test_random_streams_of_unusual_shapes_are_walked_and_encoded_exactly() -> None:
    """NumPy's words under a name a user's tensor took first, and NumPy's stream under
    another bit generator: the plan walks them (no text of its own) and the capture
    and its JSON through `TreeJSON` are still exactly a full walk's."""
    state = {"__rng__/numpy/state": {"key": torch.ones(2)}, "w": torch.zeros(2)}
    plan = CapturePlan()
    tree_json = TreeJSON()
    for i in range(3):
        np.random.random()
        got = capture(state, plan=plan)
        assert "__rng__/numpy/state/key#2" in got.tensors
        assert_equivalent(got, capture(state), f"taken {i}", tree_json)
    rs = np.random.mtrand._rand
    original = rs._bit_generator
    try:
        np.random.set_bit_generator(np.random.PCG64(5))
        for i in range(3):
            np.random.random()
            assert_equivalent(
                capture({"w": torch.zeros(2)}, plan=plan),
                capture({"w": torch.zeros(2)}),
                f"pcg {i}",
                tree_json,
            )
    finally:
        np.random.set_bit_generator(original)
    random.random()
    assert_equivalent(capture(state, plan=plan), capture(state), "back", tree_json)


def test_a_group_key_the_walk_refuses_is_refused_through_a_plan_too() -> None:
    """A parameter group gains a key that is neither str nor int after the plan was made:
    the planned capture refuses it as the full walk does, naming the key."""
    from resumable.errors import UnsupportedStateError

    state = make_state()
    train(state)
    plan = CapturePlan()
    capture(state, plan=plan)
    capture(state, plan=plan)
    state["optim"].param_groups[0][1.5] = 1
    with pytest.raises(UnsupportedStateError, match=r"1\.5"):
        capture(state)
    with pytest.raises(UnsupportedStateError, match=r"1\.5"):
        capture(state, plan=plan)


def test_unchanged_dicts_are_checked_by_their_version_tags_alone() -> None:
    """Where CPython keeps dict version tags (this machine's 3.11), a reuse after a
    training step compares the tags only: the per-item passes over the module's and the
    optimizer's dicts are not run. A write straight into a watched dict (no
    ``__setattr__``, no registration call) changes its tag: the whole check runs and
    the capture is still exactly a full walk's."""
    from resumable import _plan_entries

    if _plan_entries.dict_tags([{}]) is None:
        pytest.skip("this Python keeps no dict version tags")
    state = make_state()
    train(state)
    plan = CapturePlan()
    capture(state, plan=plan)
    whole: list[str] = []
    module_whole = _plan_entries.ModuleEntry._same_dicts
    state_whole = _plan_entries.OptimizerEntry._same_state

    def count_module(entry: Any) -> bool:
        whole.append("module")
        return module_whole(entry)

    def count_state(entry: Any, st: Any) -> bool:
        whole.append("optimizer")
        return state_whole(entry, st)

    model, optim = state["model"], state["optim"]
    mp = pytest.MonkeyPatch()
    mp.setattr(_plan_entries.ModuleEntry, "_same_dicts", count_module)
    mp.setattr(_plan_entries.OptimizerEntry, "_same_state", count_state)
    try:
        for step in range(3):
            train(state)
            got = capture(state, plan=plan)
            assert got.reused
            assert_equivalent(got, capture(state), f"step {step}")
        assert whole == []  # only tags compared
        # straight into the dicts the tags watch
        model.head._parameters["weight"] = nn.Parameter(torch.randn(2, 3))
        got = capture(state, plan=plan)
        assert "module" in whole
        assert got.tensors["model/head.weight"] is model.head.weight
        assert_equivalent(got, capture(state), "parameter written into _parameters")
        whole.clear()
        inner = optim.state[model.body[0].weight]
        inner["exp_avg"] = torch.full_like(inner["exp_avg"], 3.0)
        got = capture(state, plan=plan)
        assert "optimizer" in whole
        assert any(t is inner["exp_avg"] for t in got.tensors.values())
        assert_equivalent(got, capture(state), "moment written into the optimizer's state")
    finally:
        mp.undo()


def test_a_learning_rate_set_at_every_step_is_encoded_as_a_walk_would() -> None:
    """The parameter groups' items are kept while their value is the same object; a
    learning rate set before each step (a float, then an int, a bool, None, a tensor)
    is encoded anew, exactly as a full walk encodes it."""
    state = make_state()
    plan = CapturePlan()
    tree_json = TreeJSON()
    group = state["optim"].param_groups[0]
    for step, lr in enumerate([1e-3, 2e-3, 3, True, None, 0.5, torch.tensor(0.25), 0.125]):
        group["lr"] = lr
        got = capture(state, plan=plan)
        assert_equivalent(got, capture(state), f"step {step} lr {lr!r}", tree_json)


def test_an_ordered_dict_reordered_in_place_is_seen_without_a_tag_change() -> None:
    """``OrderedDict.move_to_end`` reorders without a change to the dict's version tag:
    a module whose parameters lie in an ``OrderedDict`` (and an optimizer state of
    ``OrderedDict`` entries) is checked whole every time, and the reordered names come
    out in a full walk's order."""
    from collections import OrderedDict

    state = make_state()
    train(state)
    model, optim = state["model"], state["optim"]
    head = model.head
    head._parameters = OrderedDict(head._parameters)
    first = next(iter(optim.state))
    optim.state[first] = OrderedDict(optim.state[first])
    plan = CapturePlan()
    tree_json = TreeJSON()
    for step, change in enumerate(
        [
            lambda: None,
            lambda: head._parameters.move_to_end("weight"),
            lambda: optim.state[first].move_to_end("exp_avg"),
            lambda: train(state),
        ]
    ):
        change()
        got = capture(state, plan=plan)
        assert_equivalent(got, capture(state), f"step {step}", tree_json)
    names = [n for n in got.tensors if n.startswith("model/head.")]
    assert names == ["model/head.bias", "model/head.weight"]


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_the_random_streams_of_a_rank_of_several_are_made_as_a_walk_makes_them(
    rank: int,
) -> None:
    """At several ranks the streams are per-rank state: their tensors are named under the
    rank's prefix. Through the plan, with every stream moving (a draw, a Gaussian kept,
    a reseed, nothing) and a user's tensor taking NumPy's name, the capture and its
    JSON through `TreeJSON` are exactly a full walk's at that rank."""
    state = {"extra": {"w": torch.zeros(2)}}
    plan = CapturePlan()
    tree_json = TreeJSON()
    random.seed(4)
    np.random.seed(4)
    moves = [
        lambda: None,
        random.random,
        np.random.random,
        lambda: torch.rand(1),
        np.random.randn,  # one Gaussian kept
        lambda: None,
        lambda: random.gauss(0, 1),
        lambda: np.random.seed(9),
        lambda: [random.random() for _ in range(700)],
    ]
    for i, move in enumerate(moves * 2):
        move()
        got = capture(state, plan=plan, rank=rank, world_size=4)
        want = capture(state, rank=rank, world_size=4)
        assert f"rank{rank}/__rng__/numpy/state/key" in got.tensors, list(got.tensors)
        assert_equivalent(got, want, f"move {i}", tree_json)
    taken = {**state, "__rng__/numpy/state": {"key": torch.ones(2)}}  # NumPy's name first
    np.random.random()
    got = capture(taken, plan=plan, rank=rank, world_size=4)
    assert f"rank{rank}/__rng__/numpy/state/key#2" in got.tensors, list(got.tensors)
    assert_equivalent(
        capture(taken, plan=plan, rank=rank, world_size=4),
        capture(taken, rank=rank, world_size=4),
        "taken",
        tree_json,
    )
