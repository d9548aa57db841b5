"""The `resumable` command against a hostile checkpoint: metric names and values, state
keys and tensor names that carry terminal control sequences (OSC 52 clipboard writes,
CSI line erases, C1 controls, bidi overrides) reach the terminal escaped, in every
subcommand's human output, while ``--json`` keeps them exact."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import resumable
from resumable.cli import main
from resumable.cli.common import printable

pytestmark = pytest.mark.usefixtures("sync_persist")

# a clipboard write, a line erase with carriage return and backspace, a one-byte CSI
# (U+009B), a right-to-left override and an isolate
HOSTILE = "\x1b]52;c;SGVsbG8=\x07\x1b[2K\r\x08OK\x9b31m\u202eevil\u2066\x7f"
TENSOR = "w" + HOSTILE
# what a terminal acts on; "\n" ends the lines the command prints
RAW = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def _assert_printable(text: str) -> None:
    found = RAW.findall(text)
    assert not found, f"raw control characters reached the terminal: {found!r}\n{text!r}"


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 with hostile metrics, keys and a hostile tensor name; the tensor's
    bytes of step 2 damaged, so that errors quote its name."""
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RESUMABLE_PERSIST", "sync")
        ckpt = resumable.Checkpointer(
            root,
            state={
                "model": {TENSOR: torch.ones(3)},
                "extra": {"k" + HOSTILE: "v" + HOSTILE},
            },
            keep=None,
        )
        ckpt.save(1, metrics={"loss" + HOSTILE: "v" + HOSTILE, "acc": 0.5})
        ckpt.save(2, metrics={"loss" + HOSTILE: 1.0})
        ckpt.close()
    step = root / "step-000000000002"
    begin, _ = json.loads((step / "manifest.json").read_text())["tensors"][f"model/{TENSOR}"][
        "offsets"
    ]
    data = bytearray((step / "rank-00000.safetensors").read_bytes())
    data[begin] ^= 0x01
    (step / "rank-00000.safetensors").write_bytes(bytes(data))
    return root


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    _assert_printable(out.out)
    _assert_printable(out.err)
    return code, out.out + out.err


def test_printable_escapes_what_a_terminal_acts_on() -> None:
    assert printable("a\x1b[31mb") == "a\\x1b[31mb"
    assert printable("\x9b\u202e\u2066\r\x08\x07\x7f") == "\\x9b\\u202e\\u2066\\x0d\\x08\\x07\\x7f"
    assert printable("plain ü → 損失") == "plain ü → 損失"
    _assert_printable(printable("".join(map(chr, range(0x2100)))))


def test_ls_show_verify_escape_checkpoint_text(
    hostile_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _run(capsys, "ls", str(hostile_root))
    assert code == 0 and "loss\\x1b]52;c;SGVsbG8=\\x07\\x1b[2K\\x0d\\x08OK\\x9b31m" in text
    code, text = _run(capsys, "ls", str(hostile_root), "--verify")
    assert code == 0 and "corrupt" in text and "\\u202eevil" in text
    code, text = _run(capsys, "show", str(hostile_root), "--step", "1")
    assert code == 0 and "w\\x1b]52" in text and "\\u202eevil" in text
    code, text = _run(capsys, "verify", str(hostile_root), "--all")
    assert code == 1 and "CORRUPT" in text and "checksum mismatch" in text


def test_export_and_report_escape_checkpoint_text(
    hostile_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.safetensors"
    code, text = _run(capsys, "export", str(hostile_root), "--key", "model", "--out", str(out))
    assert code == 0 and "skipping corrupt" in text and "\\x1b]52" in text
    code, text = _run(
        capsys, "export", str(hostile_root), "--key", "extra", "--out", str(out), "--force"
    )
    assert code == 2 and "holds no tensors" in text
    code, text = _run(
        capsys, "export", str(hostile_root), "--key", "nope", "--out", str(tmp_path / "n")
    )
    assert code == 2 and "available keys" in text
    code, text = _run(capsys, "report", str(hostile_root), "--out", str(tmp_path / "r.html"))
    assert code == 0 and "wrote" in text


def test_json_output_stays_exact(hostile_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = _run(capsys, "ls", str(hostile_root), "--json")
    assert code == 0
    main(["ls", str(hostile_root), "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["metrics"] == {"loss" + HOSTILE: "v" + HOSTILE, "acc": 0.5}
    code, _ = _run(capsys, "show", str(hostile_root), "--step", "1", "--json")
    main(["show", str(hostile_root), "--step", "1", "--json"])
    assert f"model/{TENSOR}" in json.loads(capsys.readouterr().out)["tensors"]
    code, _ = _run(capsys, "verify", str(hostile_root), "--all", "--json")
    main(["verify", str(hostile_root), "--all", "--json"])
    [_, bad] = json.loads(capsys.readouterr().out)
    assert "checksum mismatch" in bad["error"] and not bad["ok"]
    code, _ = _run(capsys, "log", str(hostile_root))
    assert code == 0


def test_console_script_writes_no_raw_control_byte(hostile_root: Path) -> None:
    """The installed command, its bytes as a terminal would receive them."""
    for argv in (["ls", str(hostile_root)], ["verify", str(hostile_root), "--all"]):
        done = subprocess.run(
            [sys.executable, "-m", "resumable.cli", *argv],
            capture_output=True,
            timeout=120,
        )
        assert b"\x1b" not in done.stdout + done.stderr
        _assert_printable(done.stdout.decode() + done.stderr.decode())
        assert b"\\x1b]52" in done.stdout
