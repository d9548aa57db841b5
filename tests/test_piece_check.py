"""``benchmarks/piece_check.py`` at toy size: every way it times of checking a tensor
stored in pieces gives the same hashes (per block, with blocks that cut pieces and a
last block cut short; whole, the manifest's checksum), and its block renders and lands
in the page. A smoke test of the harness: no time is checked."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import incr_bench  # noqa: E402
import piece_check  # noqa: E402


@pytest.fixture(scope="module")
def result(
    tmp_path_factory: pytest.TempPathFactory,
    frozen_heap: Callable[[], AbstractContextManager[None]],
) -> dict[str, Any]:
    settings = replace(incr_bench.Settings.toy(), patterns=("uniform",), chunk_bytes=(4096,))
    work = tmp_path_factory.mktemp("piece-check")
    # 48 KiB blocks over a 256 KiB table: blocks end inside pieces, the last one short
    with frozen_heap():  # the harness collects garbage before each timed sample
        return piece_check.run(work, settings, 48 << 10, 2, lambda _: None)


def test_every_way_agrees(result: dict[str, Any]) -> None:
    m = result["patterns"]["uniform"]["roots"]["incr_4KiB"]
    assert m["tensor"] == "model/table.weight" and m["bytes"] == 4096 * 16 * 4
    assert m["pieces"] > 1 and m["blocks"] == -(-m["bytes"] // (48 << 10))
    assert m["agree"] is True
    assert set(m["seconds"]) == set(piece_check.WAYS)
    assert all(v > 0 for v in m["seconds"].values()) and m["restore_ratio"] > 0


def test_blocks_cut_pieces_as_one_buffer_would(tmp_path: Path) -> None:
    import numpy as np
    import xxhash

    rng = np.random.default_rng(0)
    files = {k: rng.integers(0, 256, 10_000, dtype=np.uint8) for k in range(3)}
    maps = {k: memoryview(v) for k, v in files.items()}
    rows, parts = [], []
    for k, b, e in [(0, 0, 4000), (2, 100, 101), (1, 5000, 9000), (0, 9000, 9500), (2, 3, 3003)]:
        rows.append([k, b, e])
        parts.append(files[k][b:e])
    whole = np.concatenate(parts).tobytes()
    for block in (1, 999, 4096, 1 << 20):
        blocks = piece_check.Blocks(maps, rows, block)
        want = [xxhash.xxh3_64_intdigest(whole[j : j + block]) for j in range(0, len(whole), block)]
        assert blocks.hashed(range(blocks.count)) == want
        assert blocks.scratched(range(blocks.count)) == want


def test_block_renders_and_lands_in_the_page(result: dict[str, Any], tmp_path: Path) -> None:
    text = piece_check.render(result, "`x.json`")
    assert text.startswith(piece_check.BEGIN) and text.endswith(piece_check.END)
    assert "| uniform | 4 KiB |" in text and "agreed with the others and the manifest: True" in text
    page = tmp_path / "incremental.md"
    page.write_text(f"# Incremental\n\n- a\n{piece_check.ANCHOR}\n\n## What stays true\n")
    piece_check.write_docs(result, "first.json", page)
    first = page.read_text()
    assert first.index("- a") < first.index(piece_check.BEGIN) < first.index(piece_check.ANCHOR)
    piece_check.write_docs(result, "second.json", page)
    second = page.read_text()
    assert second.count(piece_check.BEGIN) == 1 and "second.json" in second
    assert "first.json" not in second and second.endswith("## What stays true\n")
