"""Edges of the capture (issue 44 item 8): a nested tensor is refused with the library's
error at capture, not inside torch; a parameter (or a tensor requiring gradients) in a
plain container comes back as one, ``requires_grad`` kept, when it is restored into an
empty slot, from storage and from shared memory. Checkpoints without that record (the
golden ones) restore plain tensors as before (tests/test_golden.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable
from resumable.capture import capture
from resumable.errors import UnsupportedStateError
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture


def nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout is a prototype
        return torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)], layout=layout)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_is_refused_at_capture_with_what_to_do(layout: torch.layout) -> None:
    with pytest.raises(UnsupportedStateError, match=r"state\['extra'\]\['n'\]: .*nested") as err:
        capture({"extra": {"n": nested(layout)}})
    assert "unbind" in str(err.value)


def test_a_nested_tensor_is_refused_by_save_without_writing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with resumable.Checkpointer(root, {"extra": [nested(torch.strided)]}, persist="sync") as ck:
        with pytest.raises(UnsupportedStateError, match="nested"):
            ck.save(1)
        assert ck.steps() == []


def saved_state() -> dict[str, Any]:
    return {
        "p": torch.nn.Parameter(torch.arange(3.0)),
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "pair": (1, torch.zeros(2, requires_grad=True)),
        "plain": torch.full((2,), 7.0),
    }


def check_kinds(slot: dict[str, Any]) -> None:
    p = slot["p"]
    assert type(p) is torch.nn.Parameter and p.requires_grad and p.is_leaf
    assert torch.equal(p.detach(), torch.arange(3.0))
    frozen = slot["frozen"]
    assert type(frozen) is torch.nn.Parameter and not frozen.requires_grad
    grad = slot["pair"][1]
    assert type(grad) is torch.Tensor and grad.requires_grad and grad.is_leaf
    assert type(slot["plain"]) is torch.Tensor and not slot["plain"].requires_grad


@pytest.mark.parametrize("empty", ["none", "missing"])
def test_a_parameter_restored_into_an_empty_slot_stays_a_parameter(
    tmp_path: Path, empty: str
) -> None:
    root = tmp_path / "ck"
    with resumable.Checkpointer(root, {"extra": saved_state()}, persist="sync") as ck:
        ck.save(1)
    slot: dict[str, Any] = {k: None for k in saved_state()} if empty == "none" else {}
    with resumable.Checkpointer(root, {"extra": slot}, persist="sync") as ck:
        assert ck.restore() == 1
    check_kinds(slot)


def test_a_parameter_in_a_live_slot_is_copied_into_as_before(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with resumable.Checkpointer(root, {"extra": saved_state()}, persist="sync") as ck:
        ck.save(1)
    live = torch.nn.Parameter(torch.zeros(3))
    slot: dict[str, Any] = {"p": live}
    with resumable.Checkpointer(root, {"extra": slot}, persist="sync") as ck:
        ck.restore()
    assert slot["p"] is live and torch.equal(live.detach(), torch.arange(3.0))


TRAINER = textwrap.dedent(
    """
    import os, sys, torch, resumable
    root, shm_dir = sys.argv[1], sys.argv[2]
    extra = {
        "p": torch.nn.Parameter(torch.arange(3.0)),
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "pair": (1, torch.zeros(2, requires_grad=True)),
        "plain": torch.full((2,), 7.0),
    }
    ck = resumable.Checkpointer(root, {"extra": extra}, persist="thread", shm_dir=shm_dir,
        memory_every=resumable.Every(steps=1), persist_every=resumable.Every(steps=1000))
    for step in range(1, 5):  # snapshots after the first reuse the capture plan
        ck.maybe_save(step)
    os.kill(os.getpid(), 9)
    """
)


def test_a_parameter_restored_from_shared_memory_into_an_empty_slot(
    tmp_path: Path, shm_dir: Path
) -> None:
    root = tmp_path / "ck"
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, str(root), str(shm_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    slot: dict[str, Any] = {}
    with resumable.Checkpointer(root, {"extra": slot}, persist="thread", shm_dir=shm_dir) as ck:
        assert ck.restore(tier="memory") == 4
    check_kinds(slot)


def test_a_planned_capture_keeps_the_record_of_a_frozen_parameter() -> None:
    """`CapturePlan` reuses a plain container's node without walking it: one holding a
    parameter is walked every time, so its ``__classes__`` record is never dropped."""
    from resumable._capture_plan import CapturePlan

    state = {"extra": {"f": torch.nn.Parameter(torch.ones(2), requires_grad=False)}}
    plan = CapturePlan()
    for _ in range(3):
        tree = capture(state, plan=plan).tree
        classes = [node for key, node in tree["dict"] if key == "__classes__"]
        assert classes and "Parameter(requires_grad=False)" in str(classes[0])


def _framework_class(module: str, name: str, *, sharded: bool) -> type:
    """A stateful class that says it comes from ``module`` (a framework's), as its
    engines and modules do."""

    def state_dict(self: Any) -> dict[str, Any]:
        return {"w": torch.zeros(2)}

    body: dict[str, Any] = {
        "__module__": module,
        "state_dict": state_dict,
        "load_state_dict": lambda self, sd: None,
    }
    if sharded:
        body["sharded_state_dict"] = lambda self: {}
    return type(name, (), body)


def test_framework_objects_are_refused_at_every_capture_beside_plain_ones() -> None:
    """A capture notes the classes neither refusal applies to and skips both checks for
    them next time (`resumable.capture._PLAIN_TYPES`); a DeepSpeed engine or a raw
    Megatron module is never noted, so it is refused at every capture, also after
    plain objects of the same shape were captured, and a key that is not a string is
    refused before any object is looked at."""
    plain = _framework_class("my_trainer.engine", "DeepSpeedEngine", sharded=True)
    engine = _framework_class("deepspeed.runtime.engine", "DeepSpeedEngine", sharded=False)
    raw = _framework_class("megatron.core.models.gpt", "GPTModel", sharded=True)
    for _ in range(3):
        capture({"plain": plain()})
        with pytest.raises(UnsupportedStateError, match=r"DeepSpeedState\(engine\)"):
            capture({"plain": plain(), "engine": engine()})
        with pytest.raises(UnsupportedStateError, match="tensor-parallel shards"):
            capture({"model": raw()})
    with pytest.raises(UnsupportedStateError, match="state keys must be strings"):
        capture({3: engine()})  # type: ignore[dict-item]


def test_a_patched_module_state_dict_turns_the_capture_plan_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``torch_saves_modules`` (whether a module's state dict can be planned) sees a
    patched ``nn.Module`` method, and sees it restored."""
    from resumable._plan_entries import torch_saves_modules

    assert torch_saves_modules()
    original = torch.nn.Module.state_dict
    monkeypatch.setattr(torch.nn.Module, "state_dict", lambda self, *a, **k: original(self))
    assert not torch_saves_modules()
    monkeypatch.undo()
    assert torch_saves_modules()
