"""The `resumable` command line, run in-process through `main` and once as the installed
console script, against real checkpoints of a small model trained with AdamW."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import resumable
import resumable.cli.common
import resumable.export
from resumable.cli import COMMANDS, main
from resumable.errors import NoCheckpointError

pytestmark = pytest.mark.usefixtures("sync_persist")

STEPS = (1, 2, 3, 4)


@dataclass
class Run:
    root: Path
    model_sd: dict[int, dict[str, torch.Tensor]]
    optim_sd: dict[int, dict[str, object]]


def _train_and_save(root: Path) -> Run:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_sd: dict[int, dict[str, torch.Tensor]] = {}
    optim_sd: dict[int, dict[str, object]] = {}
    ckpt = resumable.Checkpointer(
        root,
        state={"model": model, "optim": optim, "extra": {"epoch": 0}},
        keep=None,
        persist="sync",
    )
    for step in STEPS:
        loss = model(torch.randn(16, 4)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        ckpt.save(step, metrics={"loss": loss.item()})
        model_sd[step] = {k: v.clone() for k, v in model.state_dict().items()}
        optim_sd[step] = {
            f"state.{i}.{name}": t.clone()
            for i, s in optim.state_dict()["state"].items()
            for name, t in s.items()
        }
    ckpt.close()
    return Run(root, model_sd, optim_sd)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _train_and_save(tmp_path_factory.mktemp("template") / "ckpt")


@pytest.fixture
def run(template: Run, tmp_path: Path) -> Run:
    root = tmp_path / "ckpt"
    shutil.copytree(template.root, root)
    return Run(root, template.model_sd, template.optim_sd)


def _data_file(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}" / "rank-00000.safetensors"


def _manifest(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step:012d}" / "manifest.json").read_text())


def _flip_tensor_byte(root: Path, step: int, tensor: str) -> None:
    """Flip one bit inside ``tensor``'s bytes in the data region (header stays valid)."""
    begin, _ = _manifest(root, step)["tensors"][tensor]["offsets"]
    path = _data_file(root, step)
    data = bytearray(path.read_bytes())
    data[begin] ^= 0x01
    path.write_bytes(bytes(data))


def _ls(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[dict]:
    assert main(["ls", str(root), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        == b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    )


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("resumable: error: ")
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- ls


def test_ls_lists_valid_checkpoints_with_metrics_and_pins(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    with resumable.Checkpointer(run.root, state={}) as c:
        c.pin(2)
    rows = _ls(run.root, capsys)
    assert [r["step"] for r in rows] == list(STEPS)
    assert {r["status"] for r in rows} == {"committed"}
    assert [r["pinned"] for r in rows] == [False, True, False, False]
    assert all(isinstance(r["metrics"]["loss"], float) for r in rows)
    assert all(r["bytes"] == _data_file(run.root, r["step"]).stat().st_size for r in rows)
    assert all(r["created"] and "T" in r["created"] for r in rows)

    assert main(["ls", str(run.root)]) == 0
    out = capsys.readouterr().out
    for col in ("step", "time", "size", "status", "pinned", "metrics"):
        assert col in out
    assert out.count("committed") == 4
    assert "loss=" in out and "KiB" in out
    assert "yes" in out


def test_ls_reports_corrupt_and_incomplete(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_tensor_byte(run.root, 3, "model/0.weight")
    data = _data_file(run.root, 2)
    data.write_bytes(data.read_bytes()[:-4])  # truncated: caught without checksums
    (run.root / "step-000000000009").mkdir()
    (run.root / "step-000000000009" / "rank-00000.safetensors").write_bytes(b"x" * 10)
    staging = run.root / ".tmp-step-000000000005.999999999.abcd1234"  # writer pid is dead
    staging.mkdir()
    (staging / "rank-00000.safetensors").write_bytes(b"y" * 7)

    cheap = {r["name"]: r for r in _ls(run.root, capsys)}
    assert cheap["step-000000000001"]["status"] == "committed"
    assert cheap["step-000000000002"]["status"] == "corrupt"
    assert "truncated" in cheap["step-000000000002"]["error"]
    # A flipped data bit leaves sizes and headers intact: only --verify sees it.
    assert cheap["step-000000000003"]["status"] == "committed"
    assert cheap["step-000000000009"]["status"] == "incomplete"
    assert cheap["step-000000000009"]["bytes"] == 10
    assert cheap[staging.name]["status"] == "incomplete"
    assert cheap[staging.name]["step"] == 5
    assert cheap[staging.name]["bytes"] == 7

    full = {r["name"]: r for r in _ls(run.root, capsys, "--verify")}
    assert full["step-000000000003"]["status"] == "corrupt"
    assert "checksum mismatch" in full["step-000000000003"]["error"]
    assert full["step-000000000004"]["status"] == "committed"

    assert main(["ls", str(run.root), "--verify"]) == 0
    out = capsys.readouterr().out
    assert out.count("corrupt") >= 2 and out.count("incomplete") >= 2
    assert "step-000000000003: corrupt: " in out


def test_ls_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _ls(tmp_path, capsys) == []
    assert main(["ls", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().out


# --------------------------------------------------------------------------- show


def test_show_prints_summary_and_tree(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "step-000000000004" in out
    assert "world size" in out and "torch=" in out and "loss=" in out
    lines = out.splitlines()
    weight = next(line for line in lines if line.strip().startswith("0.weight:"))
    assert "model/0.weight F32 [8, 4] 128 B" in weight
    exp_avg = next(line for line in lines if line.strip().startswith("exp_avg:"))
    assert len(exp_avg) - len(exp_avg.lstrip()) > len(weight) - len(weight.lstrip())
    assert any(line.strip() == 'extra: {"epoch": 0}' for line in lines)

    assert main(["show", str(run.root), "--step", "2", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest == _manifest(run.root, 2)

    assert main(["show", str(run.root), "--step", "7"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "step 7" in line and "1, 2, 3, 4" in line


# --------------------------------------------------------------------------- verify


def test_verify_exit_codes(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(run.root), "--all"]) == 0
    out = capsys.readouterr().out
    assert out.count("OK") == 4 and "CORRUPT" not in out

    _flip_tensor_byte(run.root, 3, "optim/state/0/exp_avg")
    assert main(["verify", str(run.root)]) == 0  # newest (4) is fine
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(run.root), "--all"]) == 1
    out = capsys.readouterr().out
    assert out.count("OK") == 3
    corrupt = [line for line in out.splitlines() if line.startswith("CORRUPT")]
    assert len(corrupt) == 1
    assert "step-000000000003" in corrupt[0] and "optim/state/0/exp_avg" in corrupt[0]
    assert main(["verify", str(run.root), "--step", "3", "--json"]) == 1
    [result] = json.loads(capsys.readouterr().out)
    assert result["step"] == 3 and result["ok"] is False and "checksum" in result["error"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty), "--all"]) == 2
    assert "nothing to verify" in _one_error_line(capsys.readouterr().err)
    assert main(["verify", str(run.root), "--step", "99"]) == 2
    _one_error_line(capsys.readouterr().err)
    assert main(["verify", str(run.root), "--step", "1", "--all"]) == 2  # usage error
    assert "not allowed" in capsys.readouterr().err


# --------------------------------------------------------------------------- export


def test_export_round_trip_is_bit_exact(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.safetensors"
    assert main(["export", str(run.root), "--step", "2", "--key", "model", "--out", str(out)]) == 0
    assert "exported 4 tensors" in capsys.readouterr().out
    loaded = load_file(str(out))
    expected = run.model_sd[2]
    assert sorted(loaded) == sorted(expected)
    assert all(_bytes_equal(loaded[k], expected[k]) for k in expected)
    assert not _bytes_equal(loaded["0.weight"], run.model_sd[4]["0.weight"])
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh.load_state_dict(loaded)
    assert [p.name for p in out_dir.iterdir()] == ["model.safetensors"]  # no temp file left

    optim_out = tmp_path / "optim.safetensors"
    assert main(["export", str(run.root), "--key", "optim", "--out", str(optim_out)]) == 0
    loaded = load_file(str(optim_out))
    assert sorted(loaded) == sorted(run.optim_sd[4])
    assert all(_bytes_equal(loaded[k], run.optim_sd[4][k]) for k in loaded)


def test_export_refuses_overwrite_and_bad_key(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    args = ["export", str(run.root), "--key", "model", "--out", str(out)]
    assert main(args) == 2
    assert "--force" in _one_error_line(capsys.readouterr().err)
    assert out.read_bytes() == b"precious"
    assert main([*args, "--force"]) == 0
    assert sorted(load_file(str(out))) == sorted(run.model_sd[4])

    def disk_full(tensor: object) -> memoryview:  # after the header went out
        raise OSError(28, "No space left on device")

    before = out.read_bytes()
    with monkeypatch.context() as m:
        m.setattr(resumable.export, "byte_view", disk_full)
        assert main([*args, "--force"]) == 2
    assert "No space left" in _one_error_line(capsys.readouterr().err)
    assert out.read_bytes() == before  # the old file survives a failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.safetensors"]

    other = tmp_path / "other.safetensors"
    assert main(["export", str(run.root), "--key", "modle", "--out", str(other)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "'modle'" in line and "model" in line and "optim" in line and "extra" in line
    assert main(["export", str(run.root), "--key", "extra", "--out", str(other)]) == 2
    assert "holds no tensors" in _one_error_line(capsys.readouterr().err)
    assert not other.exists()


def test_export_checks_checksums(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip_tensor_byte(run.root, 4, "model/2.bias")
    out = tmp_path / "model.safetensors"
    args = ["export", str(run.root), "--key", "model", "--out", str(out)]
    assert main([*args, "--step", "4"]) == 2
    assert "checksum mismatch" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()

    assert main(args) == 0  # default: the newest valid checkpoint, step 3
    captured = capsys.readouterr()
    assert "skipping corrupt step-000000000004" in captured.err
    assert "step-000000000003" in captured.out
    loaded = load_file(str(out))
    assert all(_bytes_equal(loaded[k], v) for k, v in run.model_sd[3].items())


# --------------------------------------------------------------------------- prune


def test_prune_dry_run_then_delete_keeps_pinned(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    with resumable.Checkpointer(run.root, state={}) as c:
        c.pin(2)
    before = sorted(p.name for p in run.root.iterdir())
    assert main(["prune", str(run.root), "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete step-000000000001" in out and "would delete step-000000000003" in out
    assert "step-000000000002" not in out and "step-000000000004" not in out
    assert sorted(p.name for p in run.root.iterdir()) == before

    assert main(["prune", str(run.root), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted step-000000000001" in out and "deleted step-000000000003" in out
    assert [r["step"] for r in _ls(run.root, capsys)] == [2, 4]
    audit = (run.root / "audit.jsonl").read_text().splitlines()
    deleted = [json.loads(x)["step"] for x in audit if json.loads(x)["event"] == "delete"]
    assert sorted(deleted) == [1, 3]

    assert main(["prune", str(run.root), "--keep-last", "0"]) == 2  # usage error
    assert "positive integer" in capsys.readouterr().err


# --------------------------------------------------------------------------- errors, entry point


def test_missing_dir_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    for argv in (["ls"], ["show"], ["verify", "--all"], ["prune", "--keep-last", "2"]):
        assert main([argv[0], str(missing), *argv[1:]]) == 2
        captured = capsys.readouterr()
        line = _one_error_line(captured.err)
        assert "no checkpoint directory" in line and str(missing) in line
        assert captured.out == ""
    assert main(["ls", "s3x://bucket/x"]) == 2
    assert "unsupported checkpoint URL scheme" in _one_error_line(capsys.readouterr().err)


def test_debug_env_shows_the_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RESUMABLE_DEBUG", "1")
    with pytest.raises(NoCheckpointError):
        main(["ls", str(tmp_path / "nope")])


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["frobnicate", "x"]) == 2


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("resumable")
    return [str(script)] if script.exists() else [sys.executable, "-m", "resumable.cli"]


def test_console_script_entry_point(run: Run, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RESUMABLE_DEBUG"}
    done = subprocess.run(
        [*_console_script(), "ls", str(run.root), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in json.loads(done.stdout)] == list(STEPS)

    done = subprocess.run(
        [sys.executable, "-m", "resumable.cli", "verify", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    _one_error_line(done.stderr)


# --------------------------------------------------------------------------- issue 19: details


def test_ls_show_and_verify_agree_on_a_checkpoints_size(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """One size everywhere: the data files as the manifest declares them."""
    listed = {r["step"]: r["bytes"] for r in _ls(run.root, capsys)}
    assert main(["verify", str(run.root), "--all", "--json"]) == 0
    verified = {r["step"]: r["bytes"] for r in json.loads(capsys.readouterr().out)}
    assert listed == verified
    for step in STEPS:
        assert main(["show", str(run.root), "--step", str(step)]) == 0
        files = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("files"))
        assert resumable.cli.common.human_size(listed[step]) in files


def test_pin_and_unpin_commands(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pin", str(run.root), "1"]) == 0
    assert "pinned step-000000000001" in capsys.readouterr().out
    assert main(["pin", str(run.root), "1"]) == 0
    assert "already pinned" in capsys.readouterr().out
    assert [r["pinned"] for r in _ls(run.root, capsys)] == [True, False, False, False]

    assert main(["prune", str(run.root), "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert [r["step"] for r in _ls(run.root, capsys)] == [1, 4]

    assert main(["unpin", str(run.root), "1"]) == 0
    assert "unpinned step-000000000001" in capsys.readouterr().out
    assert main(["prune", str(run.root), "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert [r["step"] for r in _ls(run.root, capsys)] == [4]
    events = [json.loads(x) for x in (run.root / "audit.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events if e["event"] in ("pin", "unpin")] == [
        ("pin", 1),
        ("unpin", 1),
    ]

    assert main(["unpin", str(run.root), "4"]) == 2
    assert "step 4 is not pinned" in _one_error_line(capsys.readouterr().err)
    assert main(["pin", str(run.root), "2"]) == 2  # deleted by the prune
    assert "no committed checkpoint for step 2" in _one_error_line(capsys.readouterr().err)


def test_ls_marks_the_checkpoint_restore_would_pick(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _ls(run.root, capsys)
    assert [r["step"] for r in rows if r["restore"]] == [4]
    assert main(["ls", str(run.root)]) == 0
    marked = [x for x in capsys.readouterr().out.splitlines() if "<-" in x]
    assert len(marked) == 1 and marked[0].split()[0] == "4"

    data = _data_file(run.root, 4)
    data.write_bytes(data.read_bytes()[:-4])  # step 4 corrupt: restore skips it
    rows = _ls(run.root, capsys)
    assert [r["step"] for r in rows if r["restore"]] == [3]
    state = {
        "model": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
        "optim": None,
        "extra": {"epoch": 0},
    }
    state["optim"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-2)
    with resumable.Checkpointer(run.root, state=state, persist="sync") as c:
        assert c.restore() == 3


def test_export_exact_fails_instead_of_falling_back(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip_tensor_byte(run.root, 4, "model/2.bias")
    out = tmp_path / "model.safetensors"
    args = ["export", str(run.root), "--key", "model", "--out", str(out), "--exact"]
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "step-000000000004" in line and "checksum mismatch" in line and "--exact" in line
    assert not out.exists()
    assert main(args[:-1]) == 0  # without --exact: the newest valid one, step 3
    assert "skipping corrupt step-000000000004" in capsys.readouterr().err


def test_s3_errors_name_the_root_not_internal_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing listens at the endpoint: the error names the root the user typed (not
    ``.../pins``, which ``ls`` reads first) and says to check the endpoint and network."""
    import socket

    pytest.importorskip("boto3")
    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for command in (["ls"], ["pin", "1"], ["show"], ["log"]):
        assert main([command[0], "s3://bucket/run", *command[1:]]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "s3://bucket/run:" in line and "/pins" not in line, line
        assert "check the endpoint and the network" in line


def test_s3_missing_credentials_says_so(tmp_path: Path) -> None:
    """No credentials anywhere (a fresh process: sessions cache what they found): the
    error says so, without the network advice that fits an unreachable endpoint."""
    pytest.importorskip("boto3")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RESUMABLE_"))}
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ENDPOINT_URL="http://127.0.0.1:9",
        PYTHONPATH=str(Path(resumable.__file__).resolve().parents[1]),
    )
    done = subprocess.run(
        [sys.executable, "-m", "resumable.cli", "ls", "s3://bucket/run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    line = _one_error_line(done.stderr)
    assert "credentials" in line and "AWS_ACCESS_KEY_ID" in line, line
    assert "network" not in line and "/pins" not in line, line


def test_docs_list_every_command() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    for name in COMMANDS:
        assert f"resumable {name}" in text, f"docs/cli.md does not describe `{name}`"


def _stderr_on_a_terminal(args: list[str]) -> tuple[int, str, str]:
    """Run the command line with stderr on a pseudo-terminal; (exit code, stdout, what the
    terminal received)."""
    import pty

    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "RESUMABLE_DEBUG"}
    env.update(COLUMNS="100", TERM="xterm")
    with subprocess.Popen(
        [sys.executable, "-m", "resumable.cli", *args],
        stdout=subprocess.PIPE,
        stderr=follower,
        env=env,
    ) as proc:
        os.close(follower)
        received = bytearray()
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            received += chunk
        out = proc.stdout.read().decode() if proc.stdout else ""
        code = proc.wait(timeout=120)
    os.close(leader)
    return code, out, received.decode(errors="replace")


@pytest.mark.parametrize(
    ("command", "bar"),
    [
        (["prune", "{root}", "--keep-last", "1"], "deleting"),
        (["verify", "{root}", "--all"], "verif"),
    ],
)
def test_long_commands_show_progress_on_a_terminal_only(
    run: Run, template: Run, command: list[str], bar: str
) -> None:
    args = [a.format(root=run.root) for a in command]
    piped = subprocess.run(
        [sys.executable, "-m", "resumable.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert piped.returncode == 0, piped.stderr
    assert bar not in piped.stderr and "\x1b[" not in piped.stderr  # quiet off a terminal
    shutil.rmtree(run.root)
    shutil.copytree(template.root, run.root)
    code, out, terminal = _stderr_on_a_terminal(args)
    assert code == 0, terminal
    assert bar in terminal.lower(), terminal
    assert out == piped.stdout  # the bar goes to stderr, the results stay the same
