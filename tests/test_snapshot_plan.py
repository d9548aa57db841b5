"""The snapshot plan (issue 20): the layout of the state, the metadata that does not change
and the copy's destination views are made once and reused while the state's structure
stays the same; any change of structure is re-planned, never copied through a stale plan.

Every test changes the state between snapshots in one way, persists each snapshot from its
shared-memory slot (``save`` of a step that was just snapshotted reuses the slot), and
restores every step into fresh objects: bit-identical values and the same dtypes, shapes
and Python types."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumable.snapshot import Arena, CopyPlan, copy_threads
from state_checks import assert_same, like, restored, shm_dir, snapshot_each

__all__ = ["shm_dir"]  # a fixture


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_optimizer_moments_appearing_at_the_first_step_are_replanned(
    tmp_path: Path, shm_dir: Path, mode: str
) -> None:
    """Also a regression test: the snapshot slot grows at step 3 (a new file at the same
    name), and the persist worker used to read its old mapping, whose snapshot of step 1
    had the same sequence number: it committed step 1 again and step 3 was lost."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()

    # step 1: no moments yet; 2: moments appear (new tensors); 3, 4: same structure
    stages = [lambda: None, train, train, train]
    expected = snapshot_each(tmp_path / "ck", shm_dir, state, stages, mode=mode)
    assert expected[0]["optim"]["state"] == {} and expected[1]["optim"]["state"]
    for step, want in enumerate(expected, start=1):
        m2 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        assert_same(restored(tmp_path / "ck", step, {"model": m2, "optim": o2}), want)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: torch.randn(12), id="grown"),
        pytest.param(lambda t: torch.randn(1), id="shrunk-to-one-element-which-would-broadcast"),
        pytest.param(lambda t: t.reshape(2, 4).clone() + 1, id="same-bytes-other-shape"),
        pytest.param(lambda t: t.double() + 1, id="other-dtype"),
        pytest.param(lambda t: t.view(torch.int32).clone() + 1, id="same-bytes-other-dtype"),
        pytest.param(lambda t: torch.empty(0), id="emptied"),
    ],
)
def test_a_changed_tensor_is_replanned(
    tmp_path: Path, shm_dir: Path, change: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    torch.manual_seed(1)
    tensors = {"a": torch.randn(8), "w": torch.randn(8), "z": torch.randn(3)}
    state: dict[str, Any] = {"t": tensors}

    def mutate() -> None:
        for t in tensors.values():
            if t.is_floating_point() and t.numel():
                t.add_(1)

    def replace() -> None:
        tensors["w"] = change(tensors["w"])

    expected = snapshot_each(tmp_path / "ck", shm_dir, state, [mutate, replace, mutate, mutate])
    for step, want in enumerate(expected, start=1):
        assert_same(restored(tmp_path / "ck", step, {"t": like(want["t"])}), want)


def test_new_renamed_and_removed_entries_are_replanned(tmp_path: Path, shm_dir: Path) -> None:
    torch.manual_seed(2)
    extra: dict[str, Any] = {"x": torch.randn(4), "n": 1}
    state: dict[str, Any] = {"extra": extra}

    def add() -> None:
        extra["y"] = torch.randn(4)

    def rename() -> None:  # same count, dtypes and shapes: only the name differs
        extra["y2"] = extra.pop("y") + 1

    def remove() -> None:
        del extra["x"]

    stages = [lambda: None, add, rename, remove]
    expected = snapshot_each(tmp_path / "ck", shm_dir, state, stages)
    for step, want in enumerate(expected, start=1):
        assert_same(restored(tmp_path / "ck", step, {"extra": like(want["extra"])}), want)


def test_changed_small_values_are_never_served_from_a_stale_encoding(
    tmp_path: Path, shm_dir: Path
) -> None:
    """1, 1.0 and True are equal in Python but not in a checkpoint: every step's values
    come back with their own type."""
    extra: dict[str, Any] = {"v": 1, "w": torch.ones(2), "nested": {"k": [1, 2]}}
    state: dict[str, Any] = {"extra": extra}
    values: list[Any] = [1, 1.0, True, 1, "1", 0.0, -0.0, None, [1], (1,)]

    def setter(v: Any) -> Callable[[], None]:
        def stage() -> None:
            extra["v"] = v
            extra["nested"]["k"][1] = v

        return stage

    expected = snapshot_each(tmp_path / "ck", shm_dir, state, [setter(v) for v in values])
    for step, want in enumerate(expected, start=1):
        fresh = {"extra": {"v": None, "w": torch.zeros(2), "nested": {"k": [0, 0]}}}
        got = restored(tmp_path / "ck", step, fresh)
        assert_same(got, want)
        assert repr(got["extra"]["v"]) == repr(values[step - 1])


@pytest.mark.parametrize(
    "before, after",
    [
        ({"a": torch.zeros(4)}, {"a": torch.zeros(5)}),
        ({"a": torch.zeros(4)}, {"a": torch.zeros(2, 2)}),
        ({"a": torch.zeros(4)}, {"a": torch.zeros(4, dtype=torch.int32)}),
        ({"a": torch.zeros(4)}, {"b": torch.zeros(4)}),
        ({"a": torch.zeros(4), "b": torch.zeros(4)}, {"b": torch.zeros(4), "a": torch.zeros(4)}),
        ({"a": torch.zeros(4)}, {"a": torch.zeros(4), "b": torch.zeros(1)}),
        ({"a": torch.zeros(4), "b": torch.zeros(1)}, {"a": torch.zeros(4)}),
    ],
    ids=["grown", "reshaped", "dtype", "renamed", "reordered", "added", "removed"],
)
@pytest.mark.parametrize("guards", [True, False], ids=["torch-guards", "python-check"])
def test_a_plan_matches_only_its_own_structure(
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    guards: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With torch's C++ tensor checks, and with the Python comparison used where torch
    has none (the private module made unimportable)."""
    if not guards:
        monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", None)
    plan = CopyPlan(before)
    assert plan.matches(before)
    assert plan.matches({k: v.clone() + 1 for k, v in before.items()})  # values do not count
    assert not plan.matches(after)


@pytest.mark.parametrize("guards", [True, False], ids=["torch-guards", "python-check"])
def test_a_plan_of_tied_tensors_matches_only_while_they_stay_tied(
    guards: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied weight is one tensor under two names (torch's guards refuse a tensor
    given twice: repeats are compared by identity instead)."""
    if not guards:
        monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", None)
    w, b = nn.Parameter(torch.randn(4, 3)), torch.randn(3)
    plan = CopyPlan({"emb": w, "b": b, "head": w})
    assert plan.matches({"emb": w, "b": b, "head": w})
    w.data = torch.randn(5, 3)  # resized in place: both names see it
    assert not plan.matches({"emb": w, "b": b, "head": w})
    w.data = torch.randn(4, 3)
    assert plan.matches({"emb": w, "b": b, "head": w})
    untied = {"emb": w, "b": b, "head": nn.Parameter(torch.randn(4, 3))}
    assert plan.matches(untied) is (not guards)  # the Python check sees shapes only


def test_one_plan_copies_mixed_dtypes_views_and_empty_tensors_exactly() -> None:
    torch.manual_seed(3)
    base = torch.randn(6, 5)
    tensors = {
        "f16": torch.randn(7).half(),
        "f64": torch.randn(3, 2, dtype=torch.float64),
        "i64": torch.arange(-5, 5),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bf16": torch.randn(4).bfloat16(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # not contiguous
        "strided": base[::2, 1:4],
    }
    arena = Arena()
    for round_ in range(3):
        snap = arena.snapshot(tensors)
        for slot in snap.slots:
            got, want = snap.tensor(slot), tensors[slot.name]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), (round_, slot.name)
        for t in tensors.values():  # new values, same structure: the plan is reused
            if t.dtype.is_floating_point and t.numel():
                t.mul_(-1.5)
            elif t.dtype == torch.int64:
                t.add_(7)
    assert arena.allocations == 1
    tensors["f16"] = torch.randn(8).half()  # a new structure: a new plan and buffer
    snap = arena.snapshot(tensors)
    assert arena.allocations == 2
    assert torch.equal(snap.tensor(next(s for s in snap.slots if s.name == "f16")), tensors["f16"])


def test_a_state_without_tensors_is_planned_too() -> None:
    """A rank whose share of the tensors is empty, a state of plain values only."""
    arena = Arena()
    snap = arena.snapshot({})
    assert snap.slots == [] and snap.nbytes == 0
    assert arena.snapshot({}).nbytes == 0 and arena.allocations == 1


def test_the_random_streams_json_is_what_json_dumps_makes_at_every_step() -> None:
    """The random streams' entry is encoded per stream, Python's words reused while they
    stay the same (issue 20): at every step, whichever streams moved (Python's position
    only, its words after a twist, NumPy's cached Gaussian, torch's generator), the text
    is exactly ``json.dumps`` of the tree."""
    import json
    import random

    import numpy as np

    from resumable.capture import RNG_KEY, capture
    from resumable.pipeline.memory import TreeJSON

    state = {"w": torch.zeros(3), "x": {"a": 1}}
    draws = [
        lambda: random.random(),
        lambda: [random.random() for _ in range(400)],  # past 624 words: a twist
        lambda: np.random.rand(),
        lambda: np.random.randn(),  # a pair: one cached
        lambda: np.random.randn(),  # the cached one: NumPy's position stays
        lambda: torch.rand(1),
        lambda: None,
        lambda: random.seed(7),
    ]
    tree_json = TreeJSON()
    for i in range(3 * len(draws)):
        draws[i % len(draws)]()
        tree = capture(state).tree
        assert tree["dict"][-1][0] == RNG_KEY
        assert str(tree_json.encode(tree)) == json.dumps(
            tree, separators=(",", ":"), allow_nan=False
        ), i
    # A streams entry of another shape is encoded the general way.
    odd = {"dict": [["x", 1], [RNG_KEY, {"dict": [["python", {"tuple": [3, "?", None]}]]}]]}
    assert str(TreeJSON().encode(odd)) == json.dumps(odd, separators=(",", ":"))


def test_an_entry_of_a_few_parts_is_cached_per_part_and_stays_exact() -> None:
    """An optimizer's entry ("state", "param_groups") is cached per part: a learning rate
    changed at every step, a moment appearing, a group added, and values equal in
    Python but not in JSON (1, 1.0, True) all come out exactly as ``json.dumps``."""
    import json

    from resumable.capture import capture
    from resumable.pipeline.memory import TreeJSON

    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra: dict[str, Any] = {"a": 1, "b": [1, 2]}
    state = {"model": model, "optim": optim, "extra": extra}
    tree_json = TreeJSON()
    changes: list[Callable[[], None]] = [
        lambda: None,
        lambda: model(torch.ones(1, 3)).sum().backward(),
        optim.step,  # the moments appear
        lambda: optim.param_groups[0].__setitem__("lr", 5e-4),
        lambda: optim.param_groups[0].__setitem__("lr", 5e-4),
        lambda: optim.add_param_group({"params": [nn.Parameter(torch.ones(2))]}),
        lambda: extra.__setitem__("a", 1.0),
        lambda: extra.__setitem__("a", True),
        lambda: extra.__setitem__("a", 1),
        lambda: extra.__setitem__("c", {"d": 1}),
        lambda: extra.pop("b"),
    ]
    for i, change in enumerate(changes):
        change()
        tree = capture(state, include_rng=False).tree
        want = json.dumps(tree, separators=(",", ":"), allow_nan=False)
        assert str(tree_json.encode(tree)) == want, i


def test_a_list_of_dicts_in_a_few_parts_entry_is_encoded_exactly_short_or_long() -> None:
    """Parameter groups are encoded item by item; a user's list of dicts of the same
    shape, short or long (past the item-by-item limit), comes out as ``json.dumps``."""
    import json

    from resumable.capture import capture
    from resumable.pipeline.memory import TreeJSON

    for n in (3, 100):
        extra: dict[str, Any] = {"a": 1, "hist": [{"loss": float(i), "ok": True} for i in range(n)]}
        tree_json = TreeJSON()
        for step in range(4):
            extra["hist"][step % n]["loss"] = 1 if step % 2 else 1.0  # equal, but not in JSON
            tree = capture({"extra": extra}, include_rng=False).tree
            assert str(tree_json.encode(tree)) == json.dumps(
                tree, separators=(",", ":"), allow_nan=False
            ), (n, step)


@pytest.mark.parametrize(
    "cores, total, local, want",
    [
        (2, 2, None, 2),  # one process: the machine's cores
        (2, 2, "2", 1),  # two ranks on two cores: one thread each (no pool)
        (2, 2, "4", 1),
        (16, 16, "8", 2),
        (64, 64, "1", 4),  # at most 4
        (4, 64, "8", 4),  # pinned by the launcher to 4 cores: already this rank's share
        (2, 2, "junk", 2),
    ],
)
def test_copy_threads_share_the_cores_with_the_other_ranks_of_the_node(
    monkeypatch: pytest.MonkeyPatch, cores: int, total: int, local: str | None, want: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: total)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert copy_threads() == want


def test_a_large_state_is_copied_by_threads_from_a_share_out_planned_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over `_PARALLEL_MIN_BYTES` with one intra-op thread, `CopyPlan.copy` shares the
    tensors (the large ones in pieces) among the copy threads once per buffer and copies
    exactly what `copy_into` does, round after round; a tensor to split that is no longer
    contiguous is copied by `copy_into` instead."""
    from concurrent.futures import ThreadPoolExecutor

    from resumable import snapshot as snap_mod

    monkeypatch.setattr(snap_mod, "_PARALLEL_MIN_BYTES", 1 << 10)
    monkeypatch.setattr(snap_mod, "SHARED_COPY_MIN_BYTES", 1 << 10)
    monkeypatch.setattr(snap_mod, "_CHUNK_BYTES", 1 << 10)
    torch.manual_seed(5)
    big = torch.randn(40, 50)  # 8,000 bytes: 8 pieces
    tensors = {
        "big": big,
        "big_t": torch.randn(50, 40),
        "f16": torch.randn(700).half(),
        "i64": torch.arange(-300, 300),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(12, 10)[::2, 1:4],  # small, not contiguous: copied whole
    }
    plan = snap_mod.CopyPlan(tensors)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    want = torch.empty_like(buf)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(2) as pool:
            for round_ in range(3):
                buf.fill_(0xAB)
                plan.copy(buf, tensors, pool)
                snap_mod.copy_into(want, plan.slots, tensors, None)
                assert torch.equal(buf, want), round_
                for t in tensors.values():
                    if t.dtype.is_floating_point and t.numel():
                        t.mul_(-1.5)
            chunks = plan._chunks(buf, 2)
            assert plan._chunks(buf, 2) is chunks  # planned once
            sizes = [sum(v.numel() * v.element_size() for v in c[0]) for c in chunks]
            assert all(n >= 1 << 10 for n in sizes[:-1])  # each chunk about a piece
            spans = [w for c in chunks for w in c[1]]  # in layout order, each range once
            assert [w[0] for w in spans] == sorted(
                (w[0] for w in spans), key=[s.name for s in plan.slots].index
            )
            pieces = [w for w in spans if w[0] == "big"]
            assert sorted((lo, hi) for _, lo, hi in pieces) == [
                (i, min(i + 256, 2000)) for i in range(0, 2000, 256)
            ]
            # "big" with its shape but not contiguous: nothing is copied by the share-out,
            # and `copy` hands the whole state to `copy_into`
            odd = {**tensors, "big": torch.randn(50, 40).t()}
            buf.fill_(0)
            assert plan._copy_shared(buf, odd, pool) is False
            assert not buf.any()
            plan.copy(buf, odd, pool)
            snap_mod.copy_into(want, plan.slots, odd, None)
            assert torch.equal(buf, want)
    finally:
        torch.set_num_threads(threads)


def test_a_shared_copy_cuts_pieces_to_the_state_between_1_and_16_mib() -> None:
    from resumable.snapshot import share_piece_bytes

    mib = 1 << 20
    assert share_piece_bytes(1 << 30, 2) == 16 * mib  # large states: as before
    assert share_piece_bytes(128 * mib, 2) == 16 * mib
    assert share_piece_bytes(64 * mib, 2) == 8 * mib
    assert share_piece_bytes(10 * mib, 2) == mib + mib // 4  # four pieces a thread at least
    assert share_piece_bytes(3 * mib, 2) == mib  # never under 1 MiB
    assert share_piece_bytes(10 * mib, 0) == 10 * mib // 4  # no threads counts as one


def test_a_middle_sized_state_is_shared_with_one_thread_and_copied_at_once_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between `SHARED_COPY_MIN_BYTES` and `_PARALLEL_MIN_BYTES`: with torch on one
    intra-op thread the copy is shared among the pool's threads, in pieces small enough
    that a state mostly made of one tensor is shared evenly; with more intra-op threads,
    or a tensor to split that is not contiguous, it is one ``_foreach_copy_`` on the
    calling thread (never `copy_into`'s tensor-by-tensor loop). Exact every way."""
    from concurrent.futures import ThreadPoolExecutor

    from resumable import snapshot as snap_mod

    monkeypatch.setattr(snap_mod, "SHARED_COPY_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(snap_mod, "_PARALLEL_MIN_BYTES", 1 << 30)
    calls: list[str] = []
    shared = snap_mod.CopyPlan._copy_shared

    def spy_shared(self: Any, *args: Any) -> bool:
        done = shared(self, *args)
        calls.append(f"shared:{done}")
        return done

    def no_copy_into(*args: Any) -> None:
        raise AssertionError("copy_into under _PARALLEL_MIN_BYTES")

    monkeypatch.setattr(snap_mod.CopyPlan, "_copy_shared", spy_shared)
    monkeypatch.setattr(snap_mod, "copy_into", no_copy_into)
    torch.manual_seed(6)
    tensors = {"big": torch.randn(600, 1000), "small": torch.randn(64), "step": torch.tensor(3.0)}
    plan = snap_mod.CopyPlan(tensors)
    assert plan.nbytes >= 64 << 10
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)

    def want(ts: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.zeros_like(buf)
        for slot in plan.slots:
            snap_mod.tensor_view(out, slot).copy_(ts[slot.name])
        return out

    threads = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(2) as pool:
            torch.set_num_threads(1)
            buf.zero_()
            plan.copy(buf, tensors, pool)
            assert calls == ["shared:True"] and torch.equal(buf, want(tensors))
            loads = [sum(v.numel() * v.element_size() for v in c[0]) for c in plan._chunks(buf, 2)]
            assert len(loads) >= 3 and max(loads) <= 0.45 * sum(loads)  # "big" in pieces
            odd = {**tensors, "big": torch.randn(1000, 600).t()}
            buf.zero_()
            plan.copy(buf, odd, pool)
            assert calls[-1] == "shared:False" and torch.equal(buf, want(odd))
            torch.set_num_threads(2)
            calls.clear()
            buf.zero_()
            plan.copy(buf, tensors, pool)
            assert calls == [] and torch.equal(buf, want(tensors))
    finally:
        torch.set_num_threads(threads)


def test_a_thread_that_starts_late_takes_fewer_chunks_and_the_copy_is_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chunks of a shared copy go to whichever thread asks next: a pool thread that
    wakes only after the calling thread has copied everything takes none, one that is
    there from the start takes its part, and either way every byte is copied once."""
    import threading
    from concurrent.futures import Future

    from resumable import snapshot as snap_mod

    torch.manual_seed(7)
    tensors = {f"w{i}": torch.randn(300, 1000) for i in range(6)}  # 7.2 MB
    tensors["step"] = torch.tensor(4.0)
    plan = snap_mod.CopyPlan(tensors)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    want = torch.zeros_like(buf)
    for slot in plan.slots:
        snap_mod.tensor_view(want, slot).copy_(tensors[slot.name])
    by: list[int] = []
    copy = torch._foreach_copy_

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        by.append(threading.get_ident())
        copy(dsts, srcs)

    class Pool:
        """Runs each job on a thread of its own, which first waits until ``late``
        (the calling thread has copied every chunk) where asked to."""

        def __init__(self, late: bool) -> None:
            self._max_workers, self.late = 2, late

        def submit(self, fn: Any) -> Future[None]:
            done: Future[None] = Future()

            def later() -> None:
                for _ in range(5000 if self.late else 0):
                    if len(by) == len(chunks):
                        break
                    threading.Event().wait(0.001)
                try:
                    done.set_result(fn())
                except BaseException as exc:
                    done.set_exception(exc)

            threading.Thread(target=later).start()
            return done

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    chunks = plan._chunks(buf, 2)
    assert len(chunks) >= 4
    me = threading.get_ident()
    for late in (True, False):
        buf.zero_()
        by.clear()
        mine_began, pools_began = threading.Event(), threading.Event()
        if not late:  # each thread waits at its first chunk until the other took one

            def gate(
                dsts: list[torch.Tensor],
                srcs: list[torch.Tensor],
                events: tuple[threading.Event, threading.Event] = (mine_began, pools_began),
            ) -> None:
                own, other = events if threading.get_ident() == me else events[::-1]
                own.set()
                other.wait(5)
                spy(dsts, srcs)

            monkeypatch.setattr(torch, "_foreach_copy_", gate)
        assert plan._copy_shared(buf, tensors, Pool(late)) is True  # type: ignore[arg-type]
        assert torch.equal(buf, want) and len(by) == len(chunks)
        mine = by.count(me)
        assert (mine == len(chunks)) if late else (0 < mine < len(chunks)), (late, mine)


def test_a_state_over_the_threads_threshold_restores_from_shared_memory_exactly(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A 48 MiB model and its moments, snapshotted with one intra-op thread (the copy
    threads' share-out) at every step while it trains, restore exactly from each of
    the last snapshots."""
    import resumable

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 1024))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ck = resumable.Checkpointer(
            tmp_path / "ck",
            {"model": model, "optim": opt},
            persist="thread",
            memory_every=resumable.Every(steps=1),
            persist_every=resumable.Every(steps=10**9),
            shm_dir=shm_dir,
            keep=None,
        )
        try:
            for step in range(1, 4):
                opt.zero_grad()
                model(torch.randn(4, 2048)).square().mean().backward()
                opt.step()
                ck.snapshot(step)
            want = {k: v.clone() for k, v in model.state_dict().items()}
            moments = [s["exp_avg"].clone() for s in opt.state.values()]
            arena = ck._memory.arena  # type: ignore[union-attr]
            if copy_threads() > 1:
                assert arena._pool is not None  # the share-out ran
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            for s in opt.state.values():
                s["exp_avg"].zero_()
            assert ck.restore(tier="memory") == 3
            for k, v in model.state_dict().items():
                assert torch.equal(v, want[k]), k
            for s, m in zip(opt.state.values(), moments, strict=True):
                assert torch.equal(s["exp_avg"], m)
        finally:
            ck.save_on_close = False
            ck.close()
    finally:
        torch.set_num_threads(threads)
