"""An object store that is not there: the `resumable` command ends with its one-line
error, without the storage client's traceback, after a bounded number of tries; the
install hints name packages pip can find."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest

from resumable.errors import StorageError

pytest.importorskip("gcsfs")


def _closed_port() -> int:
    """A local port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "RESUMABLE_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "resumable.cli", *argv],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_unreachable_gcs_is_one_line(tmp_path: object) -> None:
    port = _closed_port()
    done = _cli(["ls", "gs://bucket/run"], {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 3, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[-1].startswith("resumable: error: could not list gs://bucket/run"), lines
    assert "check the endpoint and the network" in lines[-1]


@pytest.mark.timeout(300)
def test_unreachable_azure_is_one_line() -> None:
    pytest.importorskip("adlfs")
    port = _closed_port()
    conn = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
        "AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
        f"KBHBeksoGMGw==;BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
    )
    done = _cli(["ls", "az://container/run"], {"AZURE_STORAGE_CONNECTION_STRING": conn})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 3, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[-1].startswith("resumable: error: "), lines


def test_gcs_tries_as_often_as_asked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``max_attempts`` bounds gcsfs's retries (six, over about 35 s, before)."""
    from resumable.storage.fsspec_store import FsspecStorage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{_closed_port()}")
    caplog.set_level(logging.DEBUG, logger="gcsfs")
    storage = FsspecStorage("gs://bucket/run", max_attempts=2, connect_timeout=2)
    with pytest.raises(StorageError, match="could not list gs://bucket/run"):
        storage.list_dir("")
    retried = [r for r in caplog.records if "retrying after exception" in r.getMessage()]
    gave_up = [r for r in caplog.records if "out of retries" in r.getMessage()]
    assert (len(retried), len(gave_up)) == (1, 1)


def test_cli_restores_the_clients_loggers(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """`main` called in-process leaves logging as it found it."""
    from resumable.cli import main

    gcs = logging.getLogger("gcsfs")
    gcs.setLevel(logging.INFO)
    try:
        assert main(["ls", str(tmp_path), "--json"]) == 0
        assert gcs.level == logging.INFO
        assert not any(
            isinstance(h, logging.StreamHandler) for h in logging.getLogger("resumable").handlers
        )
    finally:
        gcs.setLevel(logging.NOTSET)
    capsys.readouterr()


def test_missing_client_hint_names_installable_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    from resumable.errors import CheckpointError
    from resumable.storage.fsspec_store import FsspecStorage

    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(CheckpointError) as info:
        FsspecStorage("gs://bucket/run")
    assert "pip install gcsfs" in str(info.value)
    assert "pip install -e '.[gcs]'" in str(info.value)
    assert "resumable-training[" not in str(info.value)

    monkeypatch.setitem(sys.modules, "adlfs", None)
    with pytest.raises(CheckpointError) as info:
        FsspecStorage("az://container/run")
    assert "pip install adlfs azure-identity" in str(info.value)
    assert "pip install -e '.[azure]'" in str(info.value)
