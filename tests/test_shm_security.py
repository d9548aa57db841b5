"""The memory tier on a host shared with other users and other containers: slots are
private to their user, a file that is not one (planted by another user, or just in the
way) is ignored with a WARNING, never read, written into or fatal, and a slot counts as
in use while a process holds its lock, whether or not its owner's pid can be seen.

Other users are played by uid 65534 (files chowned to it, or a process run as it), so
most of these tests need root; they are skipped otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable import _shm as shm
from resumable.cli import main
from resumable.errors import CheckpointError
from resumable.snapshot import ShmArena
from resumable.storage import LocalStorage

EUID = os.geteuid()
OTHER = 65534  # nobody
needs_root = pytest.mark.skipif(EUID != 0, reason="plays another user: needs root")


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on /dev/shm standing in for it (sticky and world-writable like it)."""
    d = Path("/dev/shm") / f"resumable-sectest-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d)


def make_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(16, 16)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def train(state: dict[str, Any]) -> None:
    state["model"](torch.randn(4, 16)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()


def slot_names(root: Path) -> list[str]:
    key = shm.run_key_for(LocalStorage(root).url)
    return [f"resumable-{key}-r0-s{i}" for i in (0, 1)]


def slot_places(shm_dir: Path, root: Path, uid: int = EUID) -> list[Path]:
    """Every name a run of ``root`` by ``uid`` may use for its slots: in the user's
    directory (made here if missing, as its owner would), and in ``shm_dir`` itself
    where they lived before slots were made private."""
    own = shm_dir / f"resumable-{uid}"
    if not own.exists():
        own.mkdir(mode=0o700)
        os.chown(own, uid, uid)
    return [d / n for d in (shm_dir, own) for n in slot_names(root)]


def slot_files(shm_dir: Path) -> list[Path]:
    return sorted(p for p in shm_dir.rglob("resumable-*-r0-s*") if p.is_file())


def give_away(path: Path) -> None:
    """Make ``path`` look planted by another user: theirs, and open to everyone."""
    os.chown(path, OTHER, OTHER, follow_symlinks=False)
    path.chmod(0o666)


TRAINER = textwrap.dedent(
    """
    import os, sys, torch, resumable
    from torch import nn
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    root, shm_dir, stop_at, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ck = resumable.Checkpointer(root, {"model": model, "optim": opt},
        memory_every=resumable.Every(steps=1), persist_every=resumable.Every(steps=10),
        persist="sync", shm_dir=shm_dir)
    start = ck.restore()
    for step in range(start, stop_at):
        model(torch.randn(4, 16)).sum().backward()
        opt.step(); opt.zero_grad()
        ck.maybe_save(step + 1)
    print("ready", start, flush=True)
    if end == "fork-kill":  # a child (as a DataLoader worker) outlives the trainer
        child = os.fork()
        if child == 0:
            sys.stdin.readline()
            os._exit(0)
        print("child", child, flush=True)
    if end in ("kill", "fork-kill"):
        os.kill(os.getpid(), 9)
    if end == "wait":
        sys.stdin.readline()
        ck.save(stop_at + 1)  # its slots are still there to snapshot into
    ck.close()
    print("done", ck.steps(), flush=True)
    """
)


def trainer(root: Path, shm_dir: Path, stop_at: int, end: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(root), str(shm_dir), str(stop_at), end],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def killed_run(root: Path, shm_dir: Path, stop_at: int) -> None:
    """A run killed at ``stop_at``: step 10 committed, ``stop_at`` in shared memory."""
    proc = trainer(root, shm_dir, stop_at, "kill")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert slot_files(shm_dir), "the killed run left its slots"


# --------------------------------------------------------------------------- planted slots


@needs_root
def test_planted_world_writable_slot_is_neither_written_nor_read(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    spies = {}
    for i, path in enumerate(slot_places(shm_dir, root)):
        # An empty slot big enough for the job: adopting it would write snapshots into it.
        shm.ShmSlot.create(path, meta_cap=1 << 20, sums_cap=1 << 16, data_cap=1 << 20).close()
        give_away(path)
        spy = shm_dir / f"spy-{i}"
        os.link(path, spy)  # what the planting user keeps open
        spies[spy] = spy.read_bytes()
    caplog.set_level(logging.WARNING, logger="resumable")
    state = make_state()
    ck = resumable.Checkpointer(
        root, state, memory_every=resumable.Every(steps=1), persist="thread", shm_dir=shm_dir
    )
    assert ck.restore() == 0
    for step in (1, 2, 3):
        train(state)
        ck.maybe_save(step)
    ck.save(4)
    ck.close()
    for spy, before in spies.items():
        assert spy.read_bytes() == before, f"the job wrote into the planted slot {spy}"
    planted = shm_dir / f"resumable-{EUID}" / slot_names(root)[0]
    assert f"{planted} is not a private snapshot slot" in caplog.text
    assert ck.steps() == [4]


@needs_root
def test_planted_complete_snapshot_is_not_restored(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    killed_run(root, shm_dir, stop_at=17)  # a real complete snapshot of step 17
    made = {p.name: p for p in slot_files(shm_dir)}
    for place in slot_places(shm_dir, root):
        if place.name in made and place != made[place.name]:
            shutil.copyfile(made[place.name], place)
        if place.exists():
            give_away(place)  # ... now another user's, open to all
    caplog.set_level(logging.WARNING, logger="resumable")
    with resumable.Checkpointer(
        root, make_state(1), memory_every=resumable.Every(steps=1), shm_dir=shm_dir
    ) as ck:
        assert ck.restore() == 10, "a planted snapshot must never be restored"
    assert "is not a private snapshot slot" in caplog.text
    assert "belongs to uid 65534" in caplog.text


@needs_root
@pytest.mark.parametrize("owner, mode", [(OTHER, 0o700), (EUID, 0o777)], ids=["other", "0777"])
def test_foreign_user_directory_is_not_used(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture, owner: int, mode: int
) -> None:
    root = tmp_path / "ck"
    planted = shm_dir / f"resumable-{EUID}"
    planted.mkdir()
    spies = {}
    for i, name in enumerate(slot_names(root)):
        path = planted / name
        shm.ShmSlot.create(path, meta_cap=1 << 20, sums_cap=1 << 16, data_cap=1 << 20).close()
        give_away(path)
        spies[path] = (shm_dir / f"spy-{i}", path.read_bytes())
        os.link(path, spies[path][0])
    os.chown(planted, owner, owner)
    planted.chmod(mode)
    caplog.set_level(logging.WARNING, logger="resumable")
    state = make_state()
    ck = resumable.Checkpointer(
        root,
        state,
        memory_every=resumable.Every(steps=1),
        persist_every=resumable.Every(steps=2),
        persist="thread",
        shm_dir=shm_dir,
    )
    assert ck.restore() == 0
    for step in range(1, 6):
        train(state)
        ck.maybe_save(step)
    ck.close()
    assert f"not using {planted} for shared-memory snapshots" in caplog.text
    for path, (spy, before) in spies.items():
        assert spy.read_bytes() == before and path.samefile(spy), "planted slot touched"
    assert sorted(p.name for p in planted.iterdir()) == sorted(slot_names(root))
    assert {p.name for p in shm_dir.iterdir()} == {planted.name, "spy-0", "spy-1"}, (
        "the fallback directory is removed with the slots at close"
    )
    with resumable.Checkpointer(root, make_state(1), persist="sync") as again:
        assert again.restore() == 5


@needs_root
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_unusable_file_at_slot_name_does_not_stop_restore(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    root = tmp_path / "ck"
    target = shm_dir / "target"
    target.write_bytes(b"not yours")
    for path in slot_places(shm_dir, root):
        if kind == "directory":
            path.mkdir()
            (path / "inside").write_text("x")
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to(target)
    caplog.set_level(logging.WARNING, logger="resumable")
    state = make_state()
    ck = resumable.Checkpointer(
        root,
        state,
        memory_every=resumable.Every(steps=1),
        persist_every=resumable.Every(steps=1),
        persist="thread",
        shm_dir=shm_dir,
    )
    assert ck.restore() == 0
    for step in (1, 2, 3):
        train(state)
        ck.maybe_save(step)
    ck.close()
    assert ck.steps()[-1] == 3
    assert "ignoring a shared-memory snapshot file" in caplog.text
    assert target.read_bytes() == b"not yours"
    with resumable.Checkpointer(
        root, make_state(1), memory_every=resumable.Every(steps=1), shm_dir=shm_dir
    ) as again:
        assert again.restore() == 3


def _other_user_can_run_python() -> bool:
    if EUID != 0:
        return False
    try:
        args = [sys.executable, "-c", "import torch, resumable"]
        return subprocess.run(args, user=OTHER, capture_output=True, check=False).returncode == 0
    except OSError:
        return False


def test_slot_name_taken_by_another_user_does_not_stop_an_unprivileged_run(
    shm_dir: Path,
) -> None:
    """The trainer runs as uid 65534; root's unreadable files sit at its slot names in a
    sticky /dev/shm, so it can neither open nor remove them."""
    if not _other_user_can_run_python():
        pytest.skip("needs root, and a python interpreter that uid 65534 may run")
    root = shm_dir / "ck"
    root.mkdir()
    os.chown(root, OTHER, OTHER)
    for path in slot_places(shm_dir, root, uid=OTHER):
        path.write_bytes(b"\0" * 8192)
        path.chmod(0o600)
    proc = trainer(
        root,
        shm_dir,
        3,
        "close",
        user=OTHER,
        group=OTHER,
        extra_groups=[],
        env={**os.environ, "HOME": str(shm_dir)},
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.splitlines()[0] == "ready 0"
    assert "ignoring a shared-memory snapshot file" in err, err


def test_slots_are_private_to_their_user(tmp_path: Path, shm_dir: Path) -> None:
    ck = resumable.Checkpointer(tmp_path / "ck", make_state(), persist="thread", shm_dir=shm_dir)
    ck.snapshot(1)
    own = shm_dir / f"resumable-{EUID}"
    st = own.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == EUID and stat.S_IMODE(st.st_mode) == 0o700
    files = slot_files(shm_dir)
    assert files and all(p.parent == own for p in files)
    for p in files:
        assert p.stat().st_uid == EUID and stat.S_IMODE(p.stat().st_mode) == 0o600
    ck.close()


# --------------------------------------------------------------------------- liveness


def live_trainer(root: Path, shm_dir: Path) -> subprocess.Popen[str]:
    """A trainer that holds its slots (snapshot of step 3) until told to go on."""
    proc = trainer(root, shm_dir, 3, "wait")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready"), proc.communicate(timeout=60)[1]
    return proc


def finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, err
    return out


def clean(shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["shm", "--clean", "--json", "--shm-dir", str(shm_dir)]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def test_clean_keeps_slots_of_a_live_job_whose_pid_it_cannot_see(
    tmp_path: Path, shm_dir: Path, dead_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    live = live_trainer(tmp_path / "live", shm_dir)
    held = slot_files(shm_dir)
    assert held
    for path in held:  # as seen from another PID namespace: the owner looks dead
        slot = shm.ShmSlot.attach(path)
        control = slot.control()
        control.owner_pid = dead_pid
        slot._write_control(control)
        slot.close()
    killed_run(tmp_path / "dead", shm_dir, stop_at=10)  # committed: nothing to lose
    dead = sorted(set(slot_files(shm_dir)) - set(held))
    assert dead

    rows = {Path(r["path"]): r for r in clean(shm_dir, capsys)}
    assert all(p.exists() for p in held), "slots of a live job were deleted"
    assert not any(p.exists() for p in dead), "slots of a dead job were kept"
    assert all(not rows[p]["removed"] and rows[p]["in_use"] for p in held)
    assert all(rows[p]["removed"] for p in dead)
    assert "done [4]" in finish(live), "the live job goes on with its slots"


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], check=False).returncode == 0
    except OSError:
        return False


def test_clean_from_another_pid_namespace_keeps_a_live_job(tmp_path: Path, shm_dir: Path) -> None:
    if not _can_unshare():
        pytest.skip("needs unshare --pid (root, and a runtime that allows it)")
    live = live_trainer(tmp_path / "live", shm_dir)
    held = slot_files(shm_dir)
    cleaner = "import sys; from resumable.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["shm", "--clean", "--json", "--shm-dir", str(shm_dir)]
    out = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", cleaner, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = json.loads(out.stdout)
    assert held and all(p.exists() for p in held), "a sidecar's --clean deleted a live job's slots"
    assert rows and not any(r["removed"] for r in rows)
    assert "done [4]" in finish(live)


def test_adoption_waits_for_the_holder_then_refuses(tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "ck"
    live = live_trainer(root, shm_dir)
    arena = ShmArena(shm.run_key_for(LocalStorage(root).location), shm_dir=shm_dir)
    with pytest.raises(CheckpointError, match="still in use after"):
        arena.adopt(wait_s=0.3)
    arena.close(unlink=False)
    finish(live)


def test_a_forked_child_outliving_a_killed_trainer_does_not_keep_its_slots(
    tmp_path: Path, shm_dir: Path
) -> None:
    root = tmp_path / "ck"
    proc = trainer(root, shm_dir, 13, "fork-kill")
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready")
    child = int(proc.stdout.readline().split()[1])
    try:
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        os.kill(child, 0)  # alive, with copies of every descriptor the trainer had
        assert slot_files(shm_dir)
        arena = ShmArena(shm.run_key_for(LocalStorage(root).location), shm_dir=shm_dir)
        found = arena.adopt(wait_s=5)  # the child holds no lock: taken over at once
        assert found and found[0][1].step == 13
        arena.close(unlink=False)
        # the relaunch: a Checkpointer as the trainer's, in this process (not the one killed)
        with resumable.Checkpointer(
            root,
            make_state(),
            memory_every=resumable.Every(steps=1),
            persist_every=resumable.Every(steps=10),
            persist="sync",
            shm_dir=shm_dir,
        ) as ck:
            assert ck.restore() == 13, "the relaunch resumes from the snapshot in shared memory"
    finally:
        os.kill(child, signal.SIGKILL)


# --------------------------------------------------------------------------- run keys


def test_run_key_tells_s3_endpoints_apart() -> None:
    pytest.importorskip("boto3")
    from resumable.storage.s3 import S3Storage

    def key(endpoint: str) -> str:
        storage = S3Storage(
            "s3://bucket/prefix",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="y",
        )
        return shm.run_key_for(storage.location)

    assert key("http://127.0.0.1:9000") != key("http://127.0.0.1:9001")
    assert key("http://127.0.0.1:9000") == key("http://127.0.0.1:9000")


def test_run_key_of_a_local_root_is_its_url(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ck")
    assert storage.location == storage.url
