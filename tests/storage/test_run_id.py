"""The run id of a root (`resumable.runid`) on every backend: written once, read
cheaply, the same for every process, new when the root is deleted and made again."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resumable.runid import (
    RUN_ID_FILE,
    ensure_run_id,
    read_run_id,
    snapshot_belongs,
)
from resumable.storage import LocalStorage, Storage

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_written_once_and_read_back(storage: Storage) -> None:
    assert read_run_id(storage) is None
    run_id = ensure_run_id(storage)
    assert len(run_id) == 32
    assert ensure_run_id(storage) == run_id == read_run_id(storage)
    assert json.loads(storage.read(RUN_ID_FILE))["run_id"] == run_id


def test_a_recreated_root_is_another_run(storage: Storage) -> None:
    old = ensure_run_id(storage)
    storage.write("step-000000000001/manifest.json", [b"{}"])
    storage.delete("")  # rm -rf of the root
    assert read_run_id(storage) is None
    new = ensure_run_id(storage)
    assert new != old
    assert snapshot_belongs(new, new)
    assert not snapshot_belongs(old, new)
    assert not snapshot_belongs(None, new)


def test_a_damaged_file_gives_a_stable_derived_id(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    storage.write(RUN_ID_FILE, [b"not json at all"])
    with caplog.at_level(logging.WARNING, logger="resumable.runid"):
        first = ensure_run_id(storage)
    assert "does not hold a run id" in caplog.text
    assert read_run_id(storage) == first
    assert storage.read(RUN_ID_FILE) == b"not json at all"  # never rewritten


RACE = """
import os, sys, traceback
from resumable.runid import ensure_run_id
from resumable.storage import LocalStorage
root, n = sys.argv[1], int(sys.argv[2])
go_r, go_w = os.pipe()
racers = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(go_w)
            os.read(go_r, 1)  # EOF once every racer is forked: they start together
            os.write(1, (ensure_run_id(LocalStorage(root)) + "\\n").encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    racers.append(pid)
os.close(go_w)
sys.exit(sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in racers))
"""


def test_processes_racing_to_create_it_agree(tmp_path: Path) -> None:
    """Six processes, forked from one interpreter that imported the library, call
    `ensure_run_id` on a root that does not exist yet, released at the same moment."""
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", RACE, str(tmp_path / "root"), "6"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert len(ids) == 6
    assert set(ids) == {read_run_id(LocalStorage(tmp_path / "root"))}
