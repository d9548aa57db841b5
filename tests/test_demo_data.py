"""The demo reads sklearn's digits file directly (importing sklearn costs a launch
seconds): the tensors must be exactly those `sklearn.datasets.load_digits` gives, split
the same way, or a resumed demo would no longer match the reference run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from resumable import demo


def _through_sklearn() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = np.random.RandomState(1234).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def test_the_file_read_gives_sklearns_tensors() -> None:
    got = demo.load_digits_tensors()
    assert all(torch.equal(a, b) for a, b in zip(got, _through_sklearn(), strict=True))
    assert [t.dtype for t in got] == [torch.float32, torch.int64] * 2


def test_without_the_file_it_goes_through_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.os.path, "isfile", lambda _: False)
    got = demo.load_digits_tensors()
    assert all(torch.equal(a, b) for a, b in zip(got, _through_sklearn(), strict=True))
