"""Incremental checkpoints mirrored to object storage (SeaweedFS on loopback): a
fine-tuning job (a large frozen backbone, a small trained head) mirrors only each
checkpoint's new bytes, the remote keeps every checkpoint a kept one refers to whatever
``mirror_keep`` says, and a new node with an empty disk restores bit for bit from the
mirror alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conftest import tensor_bytes_equal
from resumable import Checkpointer, Incremental, Keep
from resumable.audit import read_audit
from resumable.commit import list_committed, step_dir
from resumable.format import MANIFEST
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage, open_storage

WIDTH = 512  # each backbone weight: 1 MiB, so the defaults write incrementally
LAYERS = 4


class FineTune:
    """A frozen backbone (4 x Linear(512, 512), ~4 MiB: above ``Incremental``'s
    ``min_bytes``) and a trained head (Linear(512, 8)) with AdamW on the head alone;
    batches from its own generator."""

    def __init__(self, seed: int = 0) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[nn.Module] = []
            for _ in range(LAYERS):
                layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
            self.model = nn.Sequential(*layers, nn.Linear(WIDTH, 8))
        for p in self.model[:-1].parameters():
            p.requires_grad_(False)
        self.optim = torch.optim.AdamW(self.model[-1].parameters(), lr=1e-2)
        self.batches = torch.Generator().manual_seed(1000 + seed)
        self.state = {"model": self.model, "optim": self.optim}

    def train(self) -> None:
        x = torch.randn(4, WIDTH, generator=self.batches)
        loss = self.model(x).square().mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, st in self.optim.state_dict()["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/{i}/{k}"] = v.detach().clone()
        return out


def objects_bytes(s3: Any, bucket: str, prefix: str) -> int:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


def test_mirror_receives_only_new_chunks_and_keeps_referenced_checkpoints(
    s3_env: Any, tmp_path: Path
) -> None:
    bucket = s3_env.new_bucket("inc")
    remote_url = f"s3://{bucket}/ft"
    job = FineTune()
    saved = {}
    with Checkpointer(
        tmp_path / "local",
        job.state,
        keep=Keep(last=1),
        mirror=remote_url,
        mirror_keep=Keep(last=2),
        incremental=Incremental(),
        capture_rng=False,
    ) as ck:
        for step in range(1, 7):
            job.train()
            ck.save(step)
            ck.wait()
            saved[step] = job.tensors()
    local, remote = LocalStorage(tmp_path / "local"), open_storage(remote_url)
    full = sum(v.numel() * v.element_size() for v in saved[6].values())

    # Each checkpoint after the first uploaded its own chunks and manifest only.
    uploads = {e["step"]: e["bytes"] for e in read_audit(local) if e["event"] == "mirror_commit"}
    assert sorted(uploads) == [1, 2, 3, 4, 5, 6]
    assert uploads[1] >= full
    assert all(uploads[s] < full / 10 for s in range(2, 7)), uploads

    # The remote keeps the 2 newest, and step 1, which they refer to; 2-4 are gone.
    s3 = s3_env.client()
    assert list_committed(remote) == [1, 5, 6]
    for s in (5, 6):
        manifest = CheckpointReader(remote, s).manifest
        assert manifest["format_version"] == 3 and manifest["refs"] == [1]
        assert objects_bytes(s3, bucket, f"ft/{step_dir(s)}/") < full / 10
    assert objects_bytes(s3, bucket, f"ft/{step_dir(1)}/") >= full
    for s in list_committed(remote):
        CheckpointReader(remote, s).verify()
    assert list_committed(local) == [1, 6]  # local retention holds step 1 too

    # A new node: an empty local disk, the mirror alone.
    fresh = FineTune(seed=3)
    with Checkpointer(
        tmp_path / "new-node", fresh.state, mirror=remote_url, capture_rng=False
    ) as ck:
        assert ck.restore() == 6
    got = fresh.tensors()
    assert sorted(got) == sorted(saved[6])
    assert [k for k in got if not tensor_bytes_equal(got[k], saved[6][k])] == []
    restores = [
        e for e in read_audit(LocalStorage(tmp_path / "new-node")) if e["event"] == "restore"
    ]
    assert restores[-1]["tier"] == "mirror" and restores[-1]["step"] == 6
    manifest = json.loads((tmp_path / "local" / step_dir(6) / MANIFEST).read_text())
    assert manifest["refs"] == [1]


def test_a_checkpoint_mirrored_later_brings_the_ones_it_refers_to(
    s3_env: Any, tmp_path: Path
) -> None:
    """Steps 1-3 are written without a mirror (2 and 3 refer to 1); the next launch,
    with a mirror, uploads its newest step 3 at start: step 1 goes up first, so the
    remote never lists a checkpoint whose references it lacks."""
    remote_url = f"s3://{s3_env.new_bucket('late')}/ft"
    job = FineTune()
    with Checkpointer(tmp_path / "local", job.state, keep=None, persist="sync") as ck:
        for step in (1, 2, 3):
            job.train()
            ck.save(step)
    saved = job.tensors()
    local = LocalStorage(tmp_path / "local")
    assert CheckpointReader(local, 3).manifest["refs"] == [1]
    with Checkpointer(tmp_path / "local", job.state, keep=None, mirror=remote_url, persist="sync"):
        pass  # the catch-up of the newest step runs at start; close waits for it
    remote = open_storage(remote_url)
    assert 3 in list_committed(remote) and 1 in list_committed(remote)
    for s in list_committed(remote):
        CheckpointReader(remote, s).verify()
    assert CheckpointReader(remote, 3).manifest["refs"] == [1]

    fresh = FineTune(seed=5)
    with Checkpointer(tmp_path / "node2", fresh.state, mirror=remote_url) as ck:
        assert ck.restore() == 3
    got = fresh.tensors()
    assert [k for k in saved if not tensor_bytes_equal(got[k], saved[k])] == []
