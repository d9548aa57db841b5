"""The class of each stateful object is recorded in the captured tree (``__classes__``)
and a restore into an object of another class is refused before anything is touched:
an AdamW checkpoint restored into SGD used to "succeed" and crash at the first step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable.capture import (
    CLASSES_KEY,
    capture,
    check_classes,
    class_name,
    decode,
    recorded_classes,
    restore,
)
from resumable.errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError


def model_and(optim_cls: type[torch.optim.Optimizer], **kw: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = optim_cls(model.parameters(), lr=0.1, **kw)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    cap = capture(state, include_rng=False)
    tree = json.loads(json.dumps(cap.tree))  # as a manifest stores it
    return decode(tree, {k: v.clone() for k, v in cap.tensors.items()})


def test_classes_are_recorded_for_every_stateful_object() -> None:
    state = model_and(torch.optim.AdamW)
    state["extra"] = {"sched": torch.optim.lr_scheduler.StepLR(state["optim"], 1), "n": 3}
    values = round_trip(state)
    assert recorded_classes(values[CLASSES_KEY]) == [
        (("model",), "torch.nn.modules.linear:Linear"),
        (("optim",), "torch.optim.adamw:AdamW"),
        (("extra", "sched"), "torch.optim.lr_scheduler:StepLR"),
    ]


def test_adamw_checkpoint_into_sgd_is_refused_naming_both() -> None:
    values = round_trip(model_and(torch.optim.AdamW))
    target = model_and(torch.optim.SGD, momentum=0.9)
    before = target["model"].weight.detach().clone()
    with pytest.raises(StateMismatchError) as err:
        restore(target, values)
    msg = str(err.value)
    assert "state['optim']" in msg and "torch.optim.adamw.AdamW" in msg
    assert "torch.optim.sgd.SGD" in msg and "new checkpoint directory" in msg
    assert torch.equal(target["model"].weight, before)  # refused before touching anything


def test_same_classes_restore() -> None:
    values = round_trip(model_and(torch.optim.AdamW))
    target = model_and(torch.optim.AdamW)
    restore(target, values)


def test_the_module_path_of_a_class_is_not_compared() -> None:
    """``__main__.Net`` when run as a script, ``train.Net`` under a launcher."""
    state = {"optim": model_and(torch.optim.AdamW)["optim"]}
    values = round_trip(state)
    values[CLASSES_KEY] = [[["optim"], "some.other.module:AdamW"]]
    restore(state, values)


def test_wrappers_count_as_the_class_they_wrap() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    net = Net()
    compiled = torch.compile(net)
    assert class_name(compiled) == class_name(net)
    assert class_name(net).endswith(":test_wrappers_count_as_the_class_they_wrap.<locals>.Net")


def test_checkpoints_without_classes_still_restore() -> None:
    """The golden v1 checkpoints predate the record (tests/test_golden.py restores them):
    nothing to compare, nothing refused."""
    values = round_trip(model_and(torch.optim.AdamW))
    del values[CLASSES_KEY]
    restore(model_and(torch.optim.SGD), values)  # load_state_dict itself accepts this one
    check_classes({"optim": torch.optim.SGD([torch.zeros(1)], lr=0.1)}, None)


def test_a_checkpoint_saved_and_restored_by_the_checkpointer(tmp_path: Path) -> None:
    saved = model_and(torch.optim.AdamW)
    with resumable.Checkpointer(tmp_path, saved, persist="sync", keep=None) as ck:
        ck.save(1)
    target = model_and(torch.optim.SGD)
    with resumable.Checkpointer(tmp_path / "x", target, persist="sync") as other:
        assert other.restore() == 0
    shutil.rmtree(tmp_path / "x")
    ck2 = resumable.Checkpointer(tmp_path, target, persist="sync")
    with pytest.raises(StateMismatchError, match=r"AdamW.*SGD"):
        ck2.restore()
    ck2.close()


@pytest.mark.parametrize(
    "bad",
    [{"x": 1}, [["optim"]], [[["optim"], 3]], [[[True], "a:B"]], [[[None], "a:B"]]],
)
def test_a_malformed_record_is_corrupt(bad: Any) -> None:
    with pytest.raises(CorruptCheckpointError, match=CLASSES_KEY):
        recorded_classes(bad)


def test_the_reserved_key_is_refused_as_a_state_key() -> None:
    with pytest.raises(UnsupportedStateError, match=CLASSES_KEY):
        capture({CLASSES_KEY: {}})
