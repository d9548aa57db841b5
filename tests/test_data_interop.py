"""`ResumableDataLoader` with Hugging Face ``datasets`` streaming from local files, and
torchdata's ``StatefulDataLoader`` captured as it is by a `Checkpointer` (both skipped where
the packages are not installed: ``make test`` installs them, the ``data`` extra)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable import Checkpointer
from resumable.data import ResumableDataLoader

Log = list[tuple[int, list[int]]]


def drive(loader: Any, epochs: int, log: Log, stop: int | None = None, epoch0: int = 0) -> Any:
    """Read ``epochs`` epochs (a `ResumableDataLoader` knows its epoch; for another loader
    the caller passes ``epoch0``); the JSON-roundtripped state after ``stop`` batches."""
    done = 0
    epoch = getattr(loader, "epoch", epoch0)
    while epoch < epochs:
        for batch in loader:
            ids = batch["i"] if isinstance(batch, dict) else batch[0]
            log.append((epoch, ids.tolist()))
            done += 1
            if done == stop:
                return json.loads(json.dumps(loader.state_dict()))
        epoch = getattr(loader, "epoch", epoch + 1)
    return None


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture
def jsonl_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    files = []
    for s in range(4):
        path = tmp_path / f"shard{s}.jsonl"
        path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(s * 6, s * 6 + 6)))
        files.append(str(path))
    return files


def streaming(files: list[str], seen: list[int] | None = None, **split: int) -> Any:
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    if split:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=split["rank"], world_size=split["world_size"])
    if seen is not None:
        ds = ds.map(lambda row: seen.append(row["i"]) or row)
    return ds.with_format("torch")


def test_hf_streaming_dataset_resumes_at_every_boundary_without_replay(
    jsonl_shards: list[str],
) -> None:
    def make(seen: list[int] | None = None) -> ResumableDataLoader:
        return ResumableDataLoader(streaming(jsonl_shards, [] if seen is None else seen), 5)

    reference: Log = []
    drive(make(), 2, reference)
    assert sorted(i for e, b in reference if e == 0 for i in b) == list(range(24))
    for k in range(1, len(reference) + 1):
        log: Log = []
        state = drive(make(), 2, log, stop=k)
        seen: list[int] = []
        resumed = make(seen)
        resumed.load_state_dict(state)
        drive(resumed, 2, log)
        assert log == reference, f"interrupted after batch {k}"
        assert seen == [i for _, b in log[k:] for i in b]  # nothing read twice


class ReadLog:
    """A ``map`` function that appends each row's ``i`` to a file of ``folder`` named after
    the process reading it (workers included)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir()
        self.folder = folder

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        with (self.folder / f"{os.getpid()}.log").open("a") as out:
            out.write(f"{int(row['i'])}\n")
        return row

    def read(self) -> list[int]:
        return sorted(int(x) for f in self.folder.glob("*.log") for x in f.read_text().split())


def test_hf_streaming_dataset_read_by_workers_resumes_without_replay(
    jsonl_shards: list[str], tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")

    def make(log: ReadLog) -> ResumableDataLoader:
        ds = datasets.load_dataset("json", data_files=jsonl_shards, split="train", streaming=True)
        # The same pipeline (map included) in every run: its state's shape follows it.
        return ResumableDataLoader(ds.map(log).with_format("torch"), 5, num_workers=2)

    reference: Log = []
    drive(make(ReadLog(tmp_path / "reference")), 2, reference)
    plain = torch.utils.data.DataLoader(
        datasets.load_dataset(
            "json", data_files=jsonl_shards, split="train", streaming=True
        ).with_format("torch"),
        5,
        num_workers=2,
    )
    assert [b for e, b in reference if e == 0] == [b["i"].tolist() for b in plain]
    for k in (1, 3, 5, 6, 8):
        log: Log = []
        state = drive(make(ReadLog(tmp_path / f"before-{k}")), 2, log, stop=k)
        reads = ReadLog(tmp_path / f"reads-{k}")
        resumed = make(reads)
        resumed.load_state_dict(state)
        drive(resumed, 2, log)
        assert log == reference, f"interrupted after batch {k}"
        if k < 6:  # in epoch 0: the rest of it, then all of epoch 1, read once each
            rest = [i for e, b in log[k:] if e == 0 for i in b]
            assert reads.read() == sorted(rest + list(range(24)))


def test_hf_streaming_split_by_node_resumes_each_rank(jsonl_shards: list[str]) -> None:
    for rank in range(2):

        def make(rank: int = rank) -> ResumableDataLoader:
            ds = streaming(jsonl_shards, rank=rank, world_size=2)
            return ResumableDataLoader(ds, 2, num_replicas=2, rank=rank)

        reference: Log = []
        drive(make(), 2, reference)
        assert len({i for _, b in reference for i in b}) == 12
        for k in (1, 4, 6, 9):
            log: Log = []
            state = drive(make(), 2, log, stop=k)
            assert state["rank"] == rank
            resumed = make()
            resumed.load_state_dict(state)
            drive(resumed, 2, log)
            assert log == reference, f"rank {rank}, interrupted after batch {k}"


# --------------------------------------------------------------------------- torchdata


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # inside torchdata
def test_stateful_dataloader_is_captured_as_it_is(tmp_path: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.utils.data.TensorDataset(torch.arange(20))

    def make() -> Any:
        g = torch.Generator().manual_seed(3)
        return stateful.StatefulDataLoader(data, batch_size=3, shuffle=True, generator=g)

    reference: Log = []
    drive(make(), 1, reference)
    log: Log = []
    loader = make()
    it = iter(loader)
    for _ in range(4):
        log.append((0, next(it)[0].tolist()))
    with Checkpointer(tmp_path / "ck", {"data": loader}, persist="sync") as ck:
        ck.save(4)
    resumed = make()
    with Checkpointer(tmp_path / "ck", {"data": resumed}, persist="sync") as ck:
        assert ck.restore() == 4
    log += [(0, b[0].tolist()) for b in resumed]
    assert log == reference
