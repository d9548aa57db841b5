"""Progress of the commands that read every byte (``verify``, ``export``, ``ls --verify``):
a bar on stderr when it is a terminal (a pseudo-terminal here), nothing when piped;
reading in batches for the bar checks exactly what one read checks."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import resumable
import resumable.cli.progress
from resumable.cli import main

pytestmark = pytest.mark.usefixtures("sync_persist")

# the three commands, in one interpreter (one start-up), outputs separated by markers
SCRIPT = """
import sys
from resumable.cli import main
root, out = sys.argv[1], sys.argv[2]
for argv in (["verify", root, "--all"], ["ls", root, "--verify"],
             ["export", root, "--key", "model", "--out", out, "--force"]):
    print("==", argv[0], file=sys.stderr, flush=True)
    code = main(argv)
    sys.stderr.flush()
    print("== rc", code, file=sys.stderr, flush=True)
"""
BAR = "━"  # rich's bar


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("progress") / "ckpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RESUMABLE_PERSIST", "sync")
        model = {f"w{i}": torch.randn(256, 256) for i in range(6)}
        ckpt = resumable.Checkpointer(path, state={"model": model}, keep=None)
        ckpt.save(1)
        for t in model.values():
            t.add_(1.0)
        ckpt.save(2)
        ckpt.close()
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RESUMABLE_DEBUG", "NO_COLOR")}
    return {**env, "TERM": "xterm-256color", "COLUMNS": "120"}


def test_piped_output_has_no_progress(root: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), str(tmp_path / "m.safetensors")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("== rc 0") == 3, done.stderr
    for text in (done.stdout, done.stderr):
        assert "\x1b" not in text and "\r" not in text and BAR not in text
    assert "verifying" not in done.stderr and "exporting" not in done.stderr


def test_a_terminal_shows_a_bar(root: Path, tmp_path: Path) -> None:
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child's side is closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(root), str(tmp_path / "m.safetensors")],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=_env(),
            timeout=300,
        )
    finally:
        os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, terminal
    assert terminal.count("== rc 0") == 3, terminal
    assert BAR in terminal, terminal
    for what in ("verifying step-000000000002", "exporting model of step-000000000002"):
        assert what in terminal, terminal
    assert "OK       step-000000000002" in proc.stdout.decode()  # results stay on stdout


def test_reading_in_batches_checks_the_same(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a bar and one tensor per batch, ``verify`` finds the same bytes, and a bit
    flipped in the last tensor read."""
    monkeypatch.setattr(resumable.cli.progress, "stderr_is_terminal", lambda: True)
    monkeypatch.setattr(resumable.cli.progress, "PROGRESS_BATCH", 1)
    advanced: list[int] = []
    real = resumable.cli.progress.ByteProgress.advance
    monkeypatch.setattr(
        resumable.cli.progress.ByteProgress,
        "advance",
        lambda self, n: (advanced.append(n), real(self, n))[1],
    )
    work = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(root), str(work)], check=True)
    assert main(["verify", str(work), "--all", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in results] == [True, True]
    manifest = json.loads((work / "step-000000000002" / "manifest.json").read_text())
    assert len(advanced) >= 2 * len(manifest["tensors"])  # one batch per tensor
    whole = [t for t in manifest["tensors"].values() if "offsets" in t]
    last = max(whole, key=lambda t: t["offsets"][0])
    data_file = work / "step-000000000002" / last["file"]
    data = bytearray(data_file.read_bytes())
    data[last["offsets"][1] - 1] ^= 0x10
    data_file.write_bytes(bytes(data))
    assert main(["verify", str(work), "--all", "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in results] == [True, False]
    assert "checksum mismatch" in results[1]["error"]
