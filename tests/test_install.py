"""Installing and first use: the distribution's name, the install hints the library and
its documents give, what `make demo` installs, and the demo's printed commands, which a
newcomer pastes into a shell."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resumable.errors import CheckpointError
from resumable.storage import open_storage

REPO = Path(__file__).resolve().parents[1]

# `resumable` on PyPI is an unrelated upload client (0.1.1, 2017): a hint naming it as a
# distribution installs that.
WRONG_HINT = re.compile(
    r"pip3? install\s+(-\S+\s+)*['\"]?resumable(?![\w-])"  # pip install resumable
    r"|(?<![\w./-])resumable\["  # resumable[s3], not resumable-training[s3] nor ./resumable[s3]
)
# `resumable-training` is installed from a clone (the README's `pip install
# /path/to/this/clone`), not from an index: a hint must name the packages themselves
# (`pip install gcsfs`) or the clone's extra (`'.[gcs]'`).
FROM_AN_INDEX = re.compile(r"pip3? install\s+(-\S+\s+)*['\"]?resumable-training(?![\w-])")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_distribution_is_resumable_training_with_the_resumable_command() -> None:
    project = _pyproject()["project"]
    assert project["name"] == "resumable-training"
    assert project["scripts"] == {"resumable": "resumable.cli:main"}
    # One version: the distribution's is the `__version__` that manifests record.
    assert "version" in project["dynamic"]
    dynamic = _pyproject()["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "resumable._version.__version__"}
    import resumable
    from resumable import format as fmt

    assert fmt.versions()["resumable"] == resumable.__version__


def test_test_extra_holds_what_the_demo_and_s3_need() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    assert set(extras["demo"]) <= set(extras["test"])
    assert set(extras["s3"]) <= set(extras["test"])


def _hints_matching(pattern: re.Pattern[str]) -> list[str]:
    """``"path:line: text"`` for each line of the README, the build files and the
    sources, docs, examples and benchmarks that ``pattern`` finds."""
    files = [REPO / "README.md", REPO / "pyproject.toml", REPO / "Makefile"]
    for folder in ("src", "docs", "examples", "benchmarks"):
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    return [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_hint_installs_the_unrelated_pypi_package() -> None:
    assert _hints_matching(WRONG_HINT) == []


def test_the_pattern_finds_the_hint_pip_cannot_find() -> None:
    assert FROM_AN_INDEX.search("(``pip install 'resumable-training[transformers]'``)")
    assert FROM_AN_INDEX.search("pip install -U resumable-training")
    assert not FROM_AN_INDEX.search("pip install /path/to/this/clone  # resumable-training")
    assert not FROM_AN_INDEX.search("pip install -e '.[gcs]'")


def test_no_hint_installs_resumable_training_from_an_index() -> None:
    assert _hints_matching(FROM_AN_INDEX) == []


def test_s3_without_boto3_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` raises ImportError
    with pytest.raises(CheckpointError) as err:
        open_storage("s3://bucket/run")
    message = str(err.value)
    assert "pip install 'boto3" in message
    assert not WRONG_HINT.search(message)


# --------------------------------------------------------------------------- Makefile


def _make_dry_run(tmp_path: Path, target: str) -> list[str]:
    """The commands `make TARGET` runs in a fresh clone (no .venv yet), not run."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    # Under `make test` the variables of the outer make would make this one a sub-make,
    # which prints "Entering directory" lines naming the (pytest) temporary directory.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(
        ["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _installs(commands: list[str]) -> list[str]:
    return [c for c in commands if re.search(r"pip (un)?install", c)]


def test_make_demo_installs_only_what_the_demo_needs(tmp_path: Path) -> None:
    commands = _make_dry_run(tmp_path, "demo")
    installs = _installs(commands)
    assert "torch==" in installs[0], "torch first, pinned, or pip pulls another build"
    assert not any("--no-compile" in i for i in installs), "bytecode is compiled at install"
    assert "uninstall -y -q resumable " in installs[1], "the pre-rename distribution goes"
    assert installs[2].endswith('install -q -c .venv/constraints.txt -e ".[demo]"')
    assert len(installs) == 3
    _assert_torch_held(commands, installs[0])


def _assert_torch_held(commands: list[str], first: str) -> None:
    """The extras resolve with torch held at the pin installed first (a constraints
    file), so that one asking for an unpinned torch (DeepSpeed) cannot replace it."""
    pin = re.search(r"torch==[\w.+]+", first)
    assert pin is not None
    assert f'echo "{pin.group(0)}" > .venv/constraints.txt' in commands


def test_make_test_installs_the_toolchain_and_the_demo(tmp_path: Path) -> None:
    commands = _make_dry_run(tmp_path, "test")
    installs = _installs(commands)
    assert "torch==" in installs[0]
    assert "uninstall -y -q resumable " in installs[1]
    extras = re.search(r'-c \.venv/constraints\.txt -e "\.\[([\w,]+)\]"', installs[2])
    assert extras is not None
    assert {"test", "demo", "s3", "docs", "deepspeed"} <= set(extras.group(1).split(","))
    _assert_torch_held(commands, installs[0])
    # The API reference is built (and checked) before the tests run.
    build = [i for i, c in enumerate(commands) if "docs/build_api.py" in c and "ruff" not in c]
    tests = [i for i, c in enumerate(commands) if "-m pytest" in c]
    assert build and tests and build[0] < tests[0]


# --------------------------------------------------------------------------- the demo


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RESUMABLE_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    return env


def _pasted(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``line`` as a shell would, from ``cwd``, with what the shell finds on PATH."""
    argv = shlex.split(line, comments=True)
    assert "/" in argv[0] or shutil.which(argv[0]) is not None, f"{argv[0]}: command not found"
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=_env(), timeout=240)


def _leave_a_killed_run(directory: Path, cwd: Path) -> None:
    """A demo run in ``directory`` SIGKILLed part-way: checkpoints on disk and a newer
    snapshot in shared memory, which a launch in ``directory`` would resume from."""
    cmd = [sys.executable, "-m", "resumable.cli", "demo", "--dir", str(directory)]
    cmd += ["--steps", "400", "--every", "100", "--workers", "0", "--log-every", "10"]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= 150:
            break
    proc.send_signal(signal.SIGKILL)
    proc.stdout.close()
    proc.wait(timeout=60)


def test_make_demo_prints_commands_that_paste(tmp_path: Path) -> None:
    earlier = tmp_path / "runs" / "demo-uninterrupted"
    _leave_a_killed_run(earlier, tmp_path)
    script = str(REPO / "examples" / "demo_kill_resume.py")
    done = subprocess.run(
        [sys.executable, script, "--dir", "runs/demo", "--steps", "200", "--every", "20"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    commands = [i for i, line in enumerate(out) if line.startswith("$ ")]
    assert len(commands) == 3

    # It says that it deletes the earlier run, and its snapshot, before it runs anything.
    said = [line for line in out[: commands[0]] if line.startswith("removing")]
    assert len(said) == 1 and "runs/demo-uninterrupted" in said[0], out[: commands[0]]
    assert "shared-memory snapshot" in said[0]
    assert out[commands[0] + 1] == "  | starting fresh in runs/demo-uninterrupted"
    assert out[commands[1] + 1] == "  | starting fresh in runs/demo"
    final = next(line for line in out if line.startswith("uninterrupted: "))
    final = final.removeprefix("uninterrupted: ")

    # The command it ran last, pasted: the finished run resumes and prints the same line.
    again = _pasted(out[commands[2]][2:], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[0] == "resumed from step 200"
    assert again.stdout.splitlines()[-1] == final

    # The command it ends on, pasted, lists the run.
    hint = next(line for line in out if line.startswith("inspect it with:"))
    listed = _pasted(hint.removeprefix("inspect it with:"), tmp_path)
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "200" in listed.stdout


def test_make_demo_refuses_to_delete_what_is_not_a_run(tmp_path: Path) -> None:
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("...")
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo_kill_resume.py"), "--dir", "thesis"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert done.returncode == 2
    assert "refusing to delete thesis" in done.stderr
    assert (precious / "chapter1.tex").exists()
    assert "$ " not in done.stdout
