"""Borrowed values (a shared-memory slot, a mapped file: memory a later snapshot or read
reuses) are copied once on their way into the live state: by the restore wherever a live
object would keep a reference to them, and not by the restore where the object copies
them itself: ``nn.Module.load_state_dict``, and a stateful object whose class sets
``resumable_copies_on_load = True`` (the Megatron wrappers)."""

from __future__ import annotations

from typing import Any

import torch

from resumable._restore import restore


class Keeper:
    """Keeps the very dict (and tensors) its ``load_state_dict`` is given."""

    def __init__(self) -> None:
        self.kept: dict[str, Any] = {"t": torch.zeros(4), "n": 0}

    def state_dict(self) -> dict[str, Any]:
        return self.kept

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.kept = sd


class Copier(Keeper):
    """Copies what it is given into tensors of its own, and says so."""

    resumable_copies_on_load = True

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.given = sd
        self.kept = {"t": sd["t"].clone(), "n": sd["n"]}


class Claims(Keeper):
    """Sets the attribute to something true that is not True: not trusted."""

    resumable_copies_on_load = 1


def _values() -> dict[str, Any]:
    return {"t": torch.arange(4.0), "n": 3}


def test_a_keeper_gets_copies_of_borrowed_tensors() -> None:
    for cls in (Keeper, Claims):
        obj = cls()
        values = {"k": _values()}
        restore({"k": obj}, values, borrowed=True)
        kept = obj.kept["t"]
        assert torch.equal(kept, torch.arange(4.0)) and obj.kept["n"] == 3
        assert kept is not values["k"]["t"]
        assert kept.untyped_storage().data_ptr() != values["k"]["t"].untyped_storage().data_ptr()
        values["k"]["t"].fill_(-1.0)  # the slot reused by a later snapshot
        assert torch.equal(obj.kept["t"], torch.arange(4.0))


def test_an_object_that_copies_on_load_gets_the_borrowed_tensors_themselves() -> None:
    obj = Copier()
    values = {"k": _values()}
    restore({"k": obj}, values, borrowed=True)
    assert obj.given["t"] is values["k"]["t"]  # no copy made for it
    values["k"]["t"].fill_(-1.0)
    assert torch.equal(obj.kept["t"], torch.arange(4.0))


def test_values_that_are_not_borrowed_are_never_copied() -> None:
    obj = Keeper()
    values = {"k": _values()}
    restore({"k": obj}, values, borrowed=False)
    assert obj.kept["t"] is values["k"]["t"]
