"""Tied weights (one tensor at several places of a state) are stored once: format version 5.

A tree may name one stored tensor from several places; a reader of version 5 builds it
once and hands the same tensor out at each place, as ``torch.save`` keeps a shared
storage shared. Readers of version 4 and below refuse such a checkpoint as newer, never
as corrupt (a corrupt newest checkpoint would make a restore fall back to an older one).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable import format as fmt
from resumable._capture_plan import CapturePlan
from resumable.capture import capture, decode
from resumable.errors import CorruptCheckpointError, NewerFormatError, PersistError, StorageError
from resumable.format import (
    ALIAS_VERSION,
    build_manifest,
    decode_manifest,
    encode_manifest,
    manifest_digest,
)
from resumable.storage.memory import MemoryStorage
from resumable.tree import has_repeats

VOCAB, WIDTH = 64, 16


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2's ``wte`` / ``lm_head``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(x))))


def make_state(seed: int = 0) -> dict[str, Any]:
    model = Tied(seed)
    return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def train(state: dict[str, Any], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (8, 12), generator=g)
        loss = nn.functional.cross_entropy(
            state["model"](x).reshape(-1, VOCAB), x.roll(1, 1).reshape(-1)
        )
        state["opt"].zero_grad()
        loss.backward()
        state["opt"].step()


def snapshot_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, st in state["opt"].state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step-{step:012d}" / "manifest.json").read_text())


def data_bytes(root: Path, step: int) -> int:
    return sum(p.stat().st_size for p in (root / f"step-{step:012d}").glob("*.safetensors"))


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    d = Path("/dev/shm") / f"resumable-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_tied_weight_is_stored_once_and_restores_tied_and_bit_identical(tmp_path: Path) -> None:
    state = make_state()
    train(state, 3)
    with resumable.Checkpointer(tmp_path / "tied", state, persist="sync") as ck:
        ck.save(3)
    m = manifest(tmp_path / "tied", 3)
    assert m["format_version"] == ALIAS_VERSION
    names = list(m["tensors"])
    assert "model/wte.weight" in names and "model/lm_head.weight" not in names
    tree = json.dumps(m["ranks"][0]["tree"])
    assert tree.count('"tensor": "model/wte.weight"') == 2  # named from both places

    untied = make_state()
    untied["model"].lm_head.weight = nn.Parameter(untied["model"].wte.weight.detach().clone())
    untied["opt"] = torch.optim.AdamW(untied["model"].parameters(), lr=1e-2)
    train(untied, 3)
    with resumable.Checkpointer(tmp_path / "untied", untied, persist="sync") as ck:
        ck.save(3)
    assert manifest(tmp_path / "untied", 3)["format_version"] == 1
    weight = VOCAB * WIDTH * 4
    assert data_bytes(tmp_path / "untied", 3) - data_bytes(tmp_path / "tied", 3) >= weight

    fresh = make_state(seed=5)
    with resumable.Checkpointer(tmp_path / "tied", fresh, persist="sync") as ck:
        assert ck.restore() == 3
    assert fresh["model"].lm_head.weight is fresh["model"].wte.weight  # still tied
    expected = snapshot_of(state)
    got = snapshot_of(fresh)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    train(state, 2, seed=7)
    train(fresh, 2, seed=7)
    after, resumed = snapshot_of(state), snapshot_of(fresh)
    assert all(torch.equal(after[k], resumed[k]) for k in after), "not bit-identical"


def test_a_tied_checkpoint_restores_into_an_untied_model(tmp_path: Path) -> None:
    state = make_state()
    train(state, 2)
    with resumable.Checkpointer(tmp_path / "ck", {"model": state["model"]}, persist="sync") as ck:
        ck.save(2)
    model = Tied(seed=4)
    model.lm_head.weight = nn.Parameter(torch.zeros(VOCAB, WIDTH))
    with resumable.Checkpointer(tmp_path / "ck", {"model": model}, persist="sync") as ck:
        assert ck.restore() == 2
    assert torch.equal(model.wte.weight, state["model"].wte.weight)
    assert torch.equal(model.lm_head.weight, state["model"].wte.weight)


def test_one_tensor_given_twice_in_a_container_comes_back_shared(tmp_path: Path) -> None:
    t = torch.arange(1000.0)
    with resumable.Checkpointer(tmp_path / "ck", {"x": {"a": t, "b": t}}, persist="sync") as ck:
        ck.save(1)
    tensors = manifest(tmp_path / "ck", 1)["tensors"]
    assert "x/a" in tensors and "x/b" not in tensors
    state: dict[str, Any] = {"x": {}}
    with resumable.Checkpointer(tmp_path / "ck", state, persist="sync") as ck:
        assert ck.restore() == 1
    assert state["x"]["a"] is state["x"]["b"]
    assert torch.equal(state["x"]["a"], t)


def test_states_without_ties_keep_their_format_version(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    a = torch.zeros(0)
    b = torch.zeros(0)  # empty tensors share address 0 and are not ties
    with resumable.Checkpointer(
        tmp_path / "ck", {"model": model, "x": {"a": a, "b": b}}, persist="sync"
    ) as ck:
        ck.save(1)
    m = manifest(tmp_path / "ck", 1)
    assert m["format_version"] == 1 and "refs" not in m
    assert {"x/a", "x/b"} <= set(m["tensors"])


def test_breaking_a_tie_of_two_parameters_saves_both_again(tmp_path: Path) -> None:
    """Two parameter objects viewing the same memory are stored once; a tie broken by
    rebinding one's ``.data`` (the objects unchanged) is seen at the next save."""
    model = Tied()
    model.lm_head.weight = nn.Parameter(model.wte.weight.data)  # another object, same memory
    with resumable.Checkpointer(tmp_path / "ck", {"model": model}, persist="sync") as ck:
        ck.save(1)
        assert "model/lm_head.weight" not in manifest(tmp_path / "ck", 1)["tensors"]
        ck.save(2)
        model.lm_head.weight.data = torch.full((VOCAB, WIDTH), 3.0)
        ck.save(3)
    assert "model/lm_head.weight" in manifest(tmp_path / "ck", 3)["tensors"]
    fresh = Tied(seed=2)
    fresh.lm_head.weight = nn.Parameter(torch.zeros(VOCAB, WIDTH))
    with resumable.Checkpointer(tmp_path / "ck", {"model": fresh}, persist="sync") as ck:
        assert ck.restore() == 3
    assert torch.equal(fresh.lm_head.weight, torch.full((VOCAB, WIDTH), 3.0))
    assert torch.equal(fresh.wte.weight, model.wte.weight)


def test_untying_by_a_new_parameter_is_seen_by_the_capture_plan(tmp_path: Path) -> None:
    state = make_state()
    plan = CapturePlan()
    first = capture(state, include_rng=False, plan=plan)
    second = capture(state, include_rng=False, plan=plan)
    assert second.reused, "a tied module's entry is reused from capture to capture"
    assert has_repeats(first.tree) and has_repeats(second.tree)
    assert "model/lm_head.weight" not in second.tensors
    state["model"].lm_head.weight = nn.Parameter(torch.full((VOCAB, WIDTH), 2.0))
    third = capture(state, include_rng=False, plan=plan)
    assert not has_repeats(third.tree)
    assert torch.equal(third.tensors["model/lm_head.weight"], torch.full((VOCAB, WIDTH), 2.0))


def test_a_tied_model_restores_from_shared_memory(shm_dir: Path) -> None:
    class Failing(MemoryStorage):
        fail = True

        def write(self, path: str, chunks: Any) -> int:
            if self.fail and path.endswith(".safetensors"):
                raise StorageError(28, "No space left on device (injected)")
            return super().write(path, chunks)

    storage = Failing("memory://tied")
    state = make_state()
    train(state, 2)
    ck = resumable.Checkpointer(storage, state, persist="thread", shm_dir=shm_dir)
    ck.save(2)
    with pytest.raises(PersistError):
        ck.close()  # nothing persisted: the snapshot stays in shared memory
    storage.fail = False
    fresh = make_state(seed=3)
    with resumable.Checkpointer(storage, fresh, persist="thread", shm_dir=shm_dir) as ck2:
        assert ck2.restore() == 2
    events = [json.loads(x) for x in storage.files["audit.jsonl"].decode().splitlines()]
    assert any(e["event"] == "restore" and e.get("tier") == "memory" for e in events)
    assert fresh["model"].lm_head.weight is fresh["model"].wte.weight
    expected, got = snapshot_of(state), snapshot_of(fresh)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


# ---------------------------------------------------------------- the format


def _manifest(tree: Any, version: int | None = None) -> dict[str, Any]:
    m = build_manifest(
        step=5,
        metrics={},
        trees=[tree],
        files={"rank-00000.safetensors": {"size": 112, "rank": 0}},
        tensors={
            "w": {
                "file": "rank-00000.safetensors",
                "dtype": "F32",
                "shape": [2, 2],
                "offsets": [96, 112],
                "xxh3_64": "0123456789abcdef",
            }
        },
    )
    if version is not None:
        m["format_version"] = version
        if version == 1:
            m.pop("refs", None)
        m["digest"] = manifest_digest(m)
    return m


TWICE = {
    "dict": [
        ["a", {"tensor": "w", "device": "cpu"}],
        ["b", {"list": [{"tensor": "w", "device": "cpu"}]}],
    ]
}


def test_a_repeated_reference_makes_version_5_and_is_read() -> None:
    m = _manifest(TWICE)
    assert m["format_version"] == ALIAS_VERSION and m["refs"] == []
    back = decode_manifest(encode_manifest(m), where="t")
    assert back["ranks"][0]["tree"] == TWICE
    once = _manifest({"dict": [["a", {"tensor": "w", "device": "cpu"}]]})
    assert once["format_version"] == 1


@pytest.mark.parametrize("version", [1, 3])
def test_a_repeated_reference_below_version_5_is_corrupt(version: int) -> None:
    m = _manifest(TWICE, version)
    if version == 3:
        m["refs"] = []
        m["digest"] = manifest_digest(m)
    with pytest.raises(CorruptCheckpointError, match="more than once"):
        decode_manifest(encode_manifest(m), where="t")


def test_an_older_reader_refuses_version_5_as_newer(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = encode_manifest(_manifest(TWICE))
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 4)  # what resumable read before it
    with pytest.raises(NewerFormatError, match=r"format version 5 is newer.*upgrade"):
        decode_manifest(blob, where="step-000000000005")


def test_a_version_5_top_listing_parts_and_tensors_is_corrupt() -> None:
    m = _manifest(TWICE)
    m["parts"] = []
    m["digest"] = manifest_digest(m)
    with pytest.raises(CorruptCheckpointError, match="split manifest lists its parts"):
        decode_manifest(encode_manifest(m), where="t")


def test_the_decoder_builds_a_tensor_named_from_many_places_once() -> None:
    w = torch.ones(4)
    many = {"dict": [[f"k{i}", {"tensor": "w", "device": "cpu"}] for i in range(1000)]}
    values = decode(many, {"w": w})
    assert all(v is w for v in values.values())
    calls: list[str] = []

    def resolve(fqn: str) -> torch.Tensor:
        calls.append(fqn)
        return torch.zeros(3)

    glob = {"dict": [[f"k{i}", {"global": "m.w", "device": "cpu"}] for i in range(1000)]}
    values = decode(glob, {}, resolve=resolve)
    assert calls == ["m.w"] and len({id(v) for v in values.values()}) == 1


def test_an_incremental_checkpoint_of_a_tied_model_refers_and_restores(tmp_path: Path) -> None:
    """Version 5 with version 3's extents: the tied weight frozen, written once in the
    first checkpoint, referred to by the later ones."""
    from resumable.incremental import Incremental

    state = make_state()
    state["model"].wte.weight.requires_grad_(False)  # frozen: its chunks never change
    state["opt"] = torch.optim.AdamW(
        [p for p in state["model"].parameters() if p.requires_grad], lr=1e-2
    )
    inc = Incremental(chunk_bytes=4096, min_bytes=0, whole_every=0, min_saving=0.0)
    expected = {}
    with resumable.Checkpointer(tmp_path / "ck", state, persist="sync", incremental=inc) as ck:
        for step in (1, 2, 3):
            train(state, 1, seed=step)
            ck.save(step)
            expected[step] = snapshot_of(state)
    versions = [manifest(tmp_path / "ck", s)["format_version"] for s in (1, 2, 3)]
    assert versions[0] == ALIAS_VERSION and versions[1:] == [ALIAS_VERSION] * 2
    later = manifest(tmp_path / "ck", 3)
    assert later["refs"] and "extents" in later["tensors"]["model/wte.weight"]
    fresh = make_state(seed=8)
    fresh["model"].wte.weight.requires_grad_(False)
    fresh["opt"] = torch.optim.AdamW(
        [p for p in fresh["model"].parameters() if p.requires_grad], lr=1e-2
    )
    with resumable.Checkpointer(tmp_path / "ck", fresh, persist="sync") as ck:
        assert ck.restore(2) == 2
    got = snapshot_of(fresh)
    assert all(torch.equal(expected[2][k], got[k]) for k in expected[2])
    assert fresh["model"].lm_head.weight is fresh["model"].wte.weight


def test_a_restores_copies_are_never_taken_for_a_freed_tensors() -> None:
    """The restore copies each borrowed tensor once for all its places (`_Own`, by the
    value's id). A value met once and freed leaves its id to the next tensor made: that
    one gets a copy of its own values, never the freed one's copy."""
    from resumable._restore import _Own

    own = _Own(frozenset())
    for i in range(200):  # CPython hands a freed object's id to the next one made
        got = own(torch.full((4,), float(i)))
        assert torch.equal(got, torch.full((4,), float(i))), f"value {i} got another's copy"
    shared = torch.arange(3.0)
    assert own({"a": shared, "b": [shared]})["a"] is own(shared), "one copy for every place"
