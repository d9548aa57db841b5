"""Campaign 6, object storage faults: checkpoints on a real S3 server (SeaweedFS) behind
the fault proxy of the test suite (``tests/faultproxy.py``); a writer killed at every
request of a save, and saves under request failure rates up to 20%. No torn checkpoint
may ever be listed.

One SeaweedFS server and one `FaultProxy` in front of it serve the whole campaign. Each
writer is a `Checkpointer` (``persist="sync"``) in a child process forked from a fork
server that imported torch and the library once, so a writer starts in well under a
second and never inherits the proxy's threads or sockets. It reaches the server through
the proxy; the campaign checks what landed straight at the server.

**Kill sweep.** For each save shape (`SHAPES`: a 16 KiB data file in one PUT keeping
every step; a 6 MiB data file in a two-part multipart upload with ``Keep(last=2)``; a
16 KiB one with ``Keep(last=2)``, so that retention deletes during the save), a root
gets two committed steps, then an unkilled writer saves the next one and the proxy
counts its requests. Then for each request index ``i`` of a save, a new writer opens
the root and saves the next step, and is SIGKILLed at its ``i``-th request, in one of
two ways: ``dropped`` (killed as the request arrives; the request never reaches the
server) or ``landed`` (the request reaches the server, its answer is lost, and the
writer is killed at its next request). After each kill:

- every listed step verifies (`CheckpointReader.verify`) and its tensors are bit for bit
  the ones that step saved (a step already checked in full, whose manifest has not
  changed since, gets `CheckpointReader.check_files`: every file there at its size);
- nothing is listed but the steps listed before and the step being saved; the newest
  step listed before is still listed, and without retention every earlier one;
- the step being saved is listed exactly when its manifest PUT reached the server;
- a fresh writer restores the newest listed step, bit for bit, then saves and commits
  the next step.

**Fault-rate sweep.** At each failure rate (`RATES`), writers save one step after
another, through the proxy, into a root of each shape, with that share of requests
failing: 45% of the faults a 500/502/503/504, 25% a connection reset before the server
sees the request, 20% a lost response (the request took effect, the answer is reset),
10% a response delayed past the read timeout. The writer's own opening (root lease,
probe, run id) goes through the faults too; when it fails the writer is launched again.
Each save must either commit a step that verifies and restores bit for bit, or raise
`CheckpointError` (`StorageError` for storage failures) within `SAVE_TIMEOUT_S`; after
each save every listed step is checked as above. A save that raised but whose step is
listed anyway (its manifest landed, a later request failed) is counted, and must be
whole too.

botocore's back-off is scaled down as in ``tests/test_s3_faults.py`` (throttling waits
start at 50 ms, not 1 s), so that thousands of injected faults cost minutes; the retry
logic under test is unchanged.

**Able to fail** (`able_to_fail`): the kill sweep, with the writers' commit replaced by
a broken one: ``manifest-first`` puts the manifest before the data is copied next to
it; ``retention-data-first`` deletes an old step's data before its manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import resumable.pipeline._worker_jobs
from resumable import Checkpointer, Keep
from resumable.capture import capture
from resumable.commit import Attempt, MarkerCommit, list_committed, step_dir
from resumable.errors import CheckpointError, StorageError
from resumable.format import MANIFEST, checksum
from resumable.reader import CheckpointReader
from resumable.storage import Storage
from resumable.storage.s3 import S3Storage
from stress.workload import set_step

# The S3 server and the fault proxy are the test suite's (tests/s3server.py,
# tests/faultproxy.py); `python -m stress` does not put tests/ on the path.
TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if TESTS not in sys.path:
    sys.path.append(TESTS)

from faultproxy import FaultProxy  # noqa: E402
from s3server import S3Server, SeaweedUnavailable, run_seaweedfs  # noqa: E402

MiB = 1 << 20
SEED = 6
SAVE_TIMEOUT_S = 120.0
OPEN_TIMEOUT_S = 120.0
RATES = (0.01, 0.05, 0.10, 0.20)
FAULT_SHARES = {"error": 0.45, "reset": 0.25, "lost_response": 0.20, "delay": 0.10}
MODES = ("dropped", "landed")

SIZES: dict[str, dict[str, Any]] = {
    "small": {"reps": 1, "stride": 8, "modes": ("dropped",), "rates": (0.20,), "saves": 4},
    "full": {"reps": 1, "stride": 1, "modes": MODES, "rates": RATES, "saves": 34},
    "able": {"reps": 1, "stride": 1, "modes": ("dropped",), "rates": (), "saves": 0},
    "caught": {
        "reps": 1,
        "stride": 1,
        "modes": ("dropped",),
        "rates": (),
        "saves": 0,
        "until_caught": True,
        "last_first": True,
    },
}
"""``saves``: per rate and shape; ``stride``: every how many request indices a kill;
``able``: the runs of `able_to_fail`; ``caught``: ``able``'s sweep from a save's last
request back (its commit and retention deletes come last), ended by the first kill after
which a problem is found (`make test`'s proof that the checks catch a broken commit, at
a fraction of the kills)."""


@dataclass(frozen=True)
class Shape:
    """What a save looks like on the wire: the data file's size and the retention."""

    name: str
    big_numel: int  # float32 elements besides the model (0: none)
    keep_last: int | None  # Keep(last=...) or keep every step

    @property
    def keep(self) -> Keep | None:
        return Keep(last=self.keep_last) if self.keep_last else None


SHAPES = (
    Shape("16 KiB, one PUT, keep all", 0, None),
    Shape("6 MiB, multipart (2 parts), Keep(last=2)", 1_536 * 1024, 2),
    Shape("16 KiB, one PUT, Keep(last=2)", 0, 2),
)


def s3_options(endpoint: str, server: S3Server, **overrides: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "endpoint_url": endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
        "part_size": 5 * MiB,
        "max_concurrency": 4,
        "max_attempts": 8,
        "connect_timeout": 5,
        "read_timeout": 20,
    }
    options.update(overrides)
    return options


FAULT_OPTIONS = {"max_attempts": 4, "connect_timeout": 2, "read_timeout": 1.0}
DELAY_S = 1.5  # past FAULT_OPTIONS' read timeout


# --------------------------------------------------------------------------- the job


def make_state(shape: Shape) -> dict[str, Any]:
    torch.manual_seed(0)
    state: dict[str, Any] = {"model": torch.nn.Linear(64, 64)}
    if shape.big_numel:
        state["big"] = torch.zeros(shape.big_numel, dtype=torch.float32)
    return state


def set_state(state: dict[str, Any], step: int) -> None:
    """Values that depend only on ``step``."""
    set_step(state, step)
    if "big" in state:
        big = state["big"]
        torch.arange(big.numel(), out=big).mul_(0.5).add_(step)


def expected(shape: Shape, step: int) -> dict[str, torch.Tensor]:
    state = make_state(shape)
    set_state(state, step)
    return {k: v.detach().clone() for k, v in capture(state, include_rng=False).tensors.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of tensors that differ in dtype, shape or any byte (or are missing)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return [
        n
        for n in sorted(set(a) | set(b))
        if n not in a
        or n not in b
        or a[n].dtype != b[n].dtype
        or a[n].shape != b[n].shape
        or not torch.equal(raw(a[n]), raw(b[n]))
    ]


def open_checkpointer(url: str, state: dict[str, Any], shape: Shape, options: Any) -> Checkpointer:
    return Checkpointer(
        url,
        state,
        keep=shape.keep,
        persist="sync",
        capture_rng=False,
        save_on_close=False,
        storage_options=options,
    )


# --------------------------------------------------------------------------- broken commits


class ManifestFirstCommit(MarkerCommit):
    """Deliberately broken: the data goes to a staging prefix, the manifest is put
    (conditionally) before it is copied to where the manifest says it is."""

    def begin(self, step: int) -> Attempt:
        attempt = super().begin(step)
        return dataclasses.replace(attempt, staging=f".staging/{attempt.staging}")

    def commit(self, attempt: Attempt, manifest: bytes) -> bool:
        s = self.storage
        if not s.put_if_absent(f"{attempt.final}/{MANIFEST}", manifest):
            raise StorageError(17, f"step {attempt.step} was committed by another writer")
        for name in s.list_dir(attempt.staging):
            s.write(f"{attempt.final}/{attempt.key(name)}", [s.read(f"{attempt.staging}/{name}")])
        s.delete(attempt.staging)
        return False


def delete_data_first(self: MarkerCommit, step: int) -> None:
    """Deliberately broken retention: an old step's data goes before its manifest."""
    final = step_dir(step)
    for name in self.storage.list_dir(final):
        if name != MANIFEST:
            self.storage.delete(f"{final}/{name}")
    self.storage.delete(f"{final}/{MANIFEST}")


BROKEN = {"manifest-first": 0, "retention-data-first": 2}
"""Each broken path, and the index in `SHAPES` of the shape whose kill sweep runs on it."""


def apply_broken(kind: str | None) -> None:
    """In a writer process: commit (or retain) the broken way ``kind``."""
    if kind is None:
        return
    if kind == "manifest-first":

        def committer_for(storage: Storage, **kw: Any) -> Any:
            return ManifestFirstCommit(storage)

        resumable.pipeline._worker_jobs.committer_for = committer_for
    elif kind == "retention-data-first":
        MarkerCommit.delete = delete_data_first  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown broken path {kind!r}")


def throttling_scale(seconds: float) -> float:
    """Set botocore's throttling back-off base (1 s by default; 50 ms here, as
    ``tests/test_s3_faults.py`` does); returns the one it replaces."""
    import botocore.retries.standard

    config = botocore.retries.standard.ExponentialBackoff._DEFAULT_BACKOFF_CONFIG
    old: float = config["throttling_base_scale"]
    config["throttling_base_scale"] = seconds
    return old


# --------------------------------------------------------------------------- the writer


def writer(conn: Any, url: str, options: dict[str, Any], shape: Shape, broken: str | None) -> None:
    """The child: open the root and restore (as a relaunched job does; then a save's
    requests do not depend on how many steps the root holds), say ``ready`` and the
    step restored, then save the steps it is told to, one by one, saying how each
    went, until told to close."""
    logging.getLogger("resumable").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    throttling_scale(0.05)
    apply_broken(broken)
    state = make_state(shape)
    try:
        ck = open_checkpointer(url, state, shape, options)
    except CheckpointError as exc:
        conn.send(("open failed", type(exc).__name__, str(exc)[:300]))
        return
    except Exception as exc:
        conn.send(("unexpected", type(exc).__name__, str(exc)[:300]))
        return
    try:
        restored = ck.restore()
    except CheckpointError as exc:
        conn.send(("open failed", type(exc).__name__, str(exc)[:300]))
        with contextlib.suppress(CheckpointError):
            ck.close()
        return
    conn.send(("ready", restored))
    while True:
        command, step = conn.recv()
        if command == "close":
            try:
                ck.close()
            except CheckpointError:
                pass
            conn.send(("closed",))
            return
        set_state(state, step)
        try:
            ck.save(step)
            conn.send(("committed", step))
        except CheckpointError as exc:
            conn.send(("failed", type(exc).__name__, str(exc)[:300]))
        except Exception as exc:
            conn.send(("unexpected", type(exc).__name__, str(exc)[:300]))


class Writer:
    """A writer process and its end of the pipe."""

    def __init__(self, url: str, options: dict[str, Any], shape: Shape, broken: str | None) -> None:
        ctx = multiprocessing.get_context("forkserver")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=writer, args=(child, url, options, shape, broken), daemon=True
        )
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def reply(self, timeout: float) -> tuple[Any, ...] | None:
        """The next message; None if the writer died or said nothing within ``timeout``."""
        ready = multiprocessing.connection.wait([self.conn, self.proc.sentinel], timeout)
        if self.conn in ready:
            try:
                return tuple(self.conn.recv())
            except (EOFError, OSError):  # the writer died
                return None
        return None

    def send(self, command: str, step: int = 0) -> None:
        self.conn.send((command, step))

    def end(self) -> int | None:
        """Close politely if alive, kill after a while; the exit code."""
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.send("close")
            self.reply(30)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        return self.proc.exitcode


# --------------------------------------------------------------------------- the checks


class Checker:
    """Checks the listed steps of a root, straight at the server. A step is checked in
    full (verify, then its tensors against the ones saved) once per manifest; after
    that, while its manifest stays the same, its files are checked to be all there."""

    def __init__(self, storage: S3Storage, shape: Shape) -> None:
        self.storage = storage
        self.shape = shape
        self.checked: dict[int, str] = {}  # step -> checksum of the manifest checked
        self.reported: set[tuple[int, str]] = set()  # a torn step is one failure, not many
        self.full_checks = 0

    def listed(self, where: str, problems: list[str]) -> list[int]:
        """The listed steps; a problem for each one that is not whole and exact."""
        steps = list_committed(self.storage)
        for step in steps:
            why = ""
            try:
                self.check(step)
            except CheckpointError as exc:
                why = f"torn: {exc}"
            except AssertionError as exc:
                why = str(exc)
            if why:
                self.checked.pop(step, None)
                if (step, why) not in self.reported:
                    self.reported.add((step, why))
                    problems.append(f"{where}: step {step} is listed but {why}")
        for gone in set(self.checked) - set(steps):
            del self.checked[gone]
        return steps

    def check(self, step: int) -> None:
        sum_ = checksum(self.storage.read(f"{step_dir(step)}/{MANIFEST}"))
        reader = CheckpointReader(self.storage, step)
        if self.checked.get(step) == sum_:
            reader.check_files()
            return
        reader.verify()
        differ = same_bits(reader.tensors(verify=False), expected(self.shape, step))
        if differ:
            raise AssertionError(f"its tensors differ from the ones saved: {differ[:5]}")
        self.checked[step] = sum_
        self.full_checks += 1


def manifest_landed(proxy: FaultProxy, since: int, step: int) -> bool:
    """Whether a PUT of ``step``'s manifest reached the server (from request ``since``)."""
    suffix = f"/{step_dir(step)}/{MANIFEST}"
    for r in proxy.requests[since:]:
        if r.method != "PUT" or not r.path.split("?", 1)[0].endswith(suffix):
            continue
        if r.action == "lost_response" or (r.status is not None and r.status in (200, 412)):
            return True
    return False


def fresh_writer(
    url: str, options: dict[str, Any], shape: Shape, want: int, where: str, problems: list[str]
) -> int | None:
    """In this process: restore (must be ``want``, bit for bit), save the next step.
    Returns the step saved, None if that failed (a problem)."""
    state = make_state(shape)
    try:
        with open_checkpointer(url, state, shape, options) as ck:
            got = ck.restore()
            if got != want:
                problems.append(f"{where}: a fresh writer restored step {got}, not {want}")
            elif got:
                differ = same_bits(
                    {k: v for k, v in capture(state, include_rng=False).tensors.items()},
                    expected(shape, got),
                )
                if differ:
                    problems.append(f"{where}: step {got} restored with {differ[:5]} different")
            set_state(state, max(got, want) + 1)
            ck.save(max(got, want) + 1)
            return max(got, want) + 1
    except CheckpointError as exc:
        problems.append(f"{where}: a fresh writer could not restore and save: {exc}")
        return None


class Killer:
    """The proxy's callback: SIGKILL writer ``pid`` at request ``at`` (``dropped``: that
    request is dropped unsent) or at the first request after it (``landed``: request
    ``at`` is forwarded and its answer lost, by the schedule)."""

    def __init__(self, pid: int, at: int, mode: str) -> None:
        self.pid, self.at, self.mode = pid, at, mode
        self.request = ""

    def __call__(self, index: int, method: str, path: str) -> None:
        if self.request:
            return
        due = index == self.at if self.mode == "dropped" else index > self.at
        if due:
            self.request = f"{index}: {method} {path.split('?', 1)[0]}"
            os.kill(self.pid, signal.SIGKILL)
            raise Killed(self.request)


class Killed(Exception):
    """Raised in the proxy's callback once the writer is killed: the request is dropped."""


# --------------------------------------------------------------------------- the sweeps


@dataclass
class Tally:
    trials: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def kill_sweep(
    server: S3Server,
    proxy: FaultProxy,
    bucket: str,
    shape: Shape,
    rep: int,
    cfg: dict[str, Any],
    tally: Tally,
    broken: str | None = None,
) -> None:
    """One root of ``shape``: count a save's requests, then a writer killed at each."""
    url = f"s3://{bucket}/kill-{SHAPES.index(shape)}-{rep}"
    direct = s3_options(server.endpoint, server)
    through = s3_options(proxy.endpoint, server)
    checker = Checker(S3Storage(url, **direct), shape)
    problems = tally.problems
    newest = 0
    for _ in range(2):
        saved = fresh_writer(url, direct, shape, newest, f"{shape.name}: base", problems)
        if saved is None:
            return
        newest = saved
    # Count the requests of one save (the writer is open and idle when told to save).
    w = Writer(url, through, shape, broken)
    hello = w.reply(OPEN_TIMEOUT_S)
    if hello != ("ready", newest):
        problems.append(f"{shape.name}: the counting writer did not open: {hello}")
        w.end()
        return
    base = proxy.count
    w.send("save", newest + 1)
    answer = w.reply(SAVE_TIMEOUT_S)
    count = proxy.count - base
    w.end()
    if answer != ("committed", newest + 1):
        problems.append(f"{shape.name}: the unkilled save did not commit: {answer}")
        return
    newest += 1
    stats = tally.details.setdefault(
        shape.name,
        {"requests_per_save": count, "kills": {}, "not_reached": 0, "steps_committed": 0},
    )
    listed = checker.listed(f"{shape.name}, rep {rep}", problems)
    for mode in cfg["modes"]:
        indices = range(0, count, cfg["stride"])
        for i in reversed(indices) if cfg.get("last_first") else indices:
            where = f"{shape.name}, rep {rep}, {mode} at request {i}"
            before = listed
            step = newest + 1
            w = Writer(url, through, shape, broken)
            hello = w.reply(OPEN_TIMEOUT_S)
            if hello != ("ready", newest):
                problems.append(f"{where}: the writer did not open and restore {newest}: {hello}")
                w.end()
                continue
            since = proxy.count
            killer = Killer(w.pid, since + i, mode)
            if mode == "landed":
                proxy.schedule({since + i: "lost_response"})
            proxy.on_request(killer)
            w.send("save", step)
            answer = w.reply(SAVE_TIMEOUT_S)
            proxy.on_request(None)
            proxy.clear_faults()
            code = w.end()
            tally.trials += 1
            if killer.request:
                stats["kills"][mode] = stats["kills"].get(mode, 0) + 1
                if code != -signal.SIGKILL:
                    problems.append(f"{where}: writer exited {code} after the kill")
            elif answer == ("committed", step):
                stats["not_reached"] += 1
            else:
                problems.append(f"{where}: not killed, and the save answered {answer}")
            listed = checker.listed(where, problems)
            if before and before[-1] not in listed:
                problems.append(f"{where}: the newest earlier step {before[-1]} is gone")
            extra = set(listed) - set(before) - {step}
            if extra:
                problems.append(f"{where}: steps {sorted(extra)} listed from nowhere")
            if shape.keep is None and set(before) - set(listed):
                problems.append(f"{where}: steps {sorted(set(before) - set(listed))} lost")
            landed = manifest_landed(proxy, since, step)
            if (step in listed) != landed:
                problems.append(
                    f"{where}: step {step} is {'' if step in listed else 'not '}listed, but its "
                    f"manifest {'reached' if landed else 'did not reach'} the server"
                )
            if problems and cfg.get("until_caught"):
                return
            stats["steps_committed"] += step in listed
            saved = fresh_writer(url, direct, shape, max(listed, default=0), where, problems)
            if saved is None:
                return
            listed = checker.listed(f"{where} (fresh writer)", problems)
            if saved not in listed:
                problems.append(f"{where}: the fresh writer's step {saved} is not listed")
            newest = saved
    leftovers = MarkerCommit(checker.storage, gc_grace_s=0).stale()
    stats["abandoned_attempts"] = stats.get("abandoned_attempts", 0) + len(leftovers)
    stats["full_checks"] = stats.get("full_checks", 0) + checker.full_checks


def fault_mix(rate: float) -> dict[str, Any]:
    return {
        "error_rate": rate * FAULT_SHARES["error"],
        "error_codes": (500, 502, 503, 504),
        "reset_rate": rate * FAULT_SHARES["reset"],
        "lost_response_rate": rate * FAULT_SHARES["lost_response"],
        "delay_rate": rate * FAULT_SHARES["delay"],
        "delay_s": DELAY_S,
    }


def fault_sweep(
    server: S3Server,
    proxy: FaultProxy,
    bucket: str,
    shape: Shape,
    rate: float,
    saves: int,
    tally: Tally,
) -> None:
    """``saves`` saves of ``shape`` with ``rate`` of the requests failing."""
    name = f"{rate:.0%}"
    url = f"s3://{bucket}/faults-{name[:-1]}-{SHAPES.index(shape)}"
    through = s3_options(proxy.endpoint, server, **FAULT_OPTIONS)
    checker = Checker(S3Storage(url, **s3_options(server.endpoint, server)), shape)
    problems = tally.problems
    out = tally.details.setdefault(
        name,
        {
            "saves": 0,
            "outcomes": {},
            "opens_failed": {},
            "restored_older_than_newest": 0,
            "max_save_s": 0.0,
            "injected": {},
            "requests": 0,
        },
    )
    outcomes: dict[str, int] = out["outcomes"]
    first = proxy.count
    listed: list[int] = []
    step = done = opens = 0
    proxy.set_faults(**fault_mix(rate))
    try:
        while done < saves:
            opens += 1
            if opens > 4 * saves:
                problems.append(f"{name} {shape.name}: writers keep failing to open")
                return
            w = Writer(url, through, shape, None)
            hello = w.reply(OPEN_TIMEOUT_S)
            if hello is None or hello[0] != "ready":
                if hello is not None and hello[0] == "open failed":
                    out["opens_failed"][hello[1]] = out["opens_failed"].get(hello[1], 0) + 1
                else:
                    problems.append(f"{name} {shape.name}: writer did not open: {hello}")
                w.end()
                continue
            if hello[1] != max(listed, default=0):
                out["restored_older_than_newest"] += 1
            for _ in range(min(10, saves - done)):
                before = listed
                step += 1
                done += 1
                where = f"{name} {shape.name}, save of step {step}"
                t0 = time.monotonic()
                w.send("save", step)
                answer = w.reply(SAVE_TIMEOUT_S)
                seconds = time.monotonic() - t0
                out["max_save_s"] = max(out["max_save_s"], round(seconds, 2))
                tally.trials += 1
                if answer is None:
                    problems.append(f"{where}: no answer in {seconds:.0f} s (hung or died)")
                    break
                listed = checker.listed(where, problems)
                if answer[0] == "committed":
                    outcome = "committed"
                    if step not in listed:
                        problems.append(f"{where}: save returned but the step is not listed")
                elif answer[0] == "failed":
                    outcome = f"raised {answer[1]}"
                    if step in listed:
                        outcome += ", committed anyway"
                else:
                    outcome = f"unexpected {answer[1]}"
                    problems.append(f"{where}: raised {answer[1]}: {answer[2]}")
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if before and before[-1] not in listed:
                    problems.append(f"{where}: the newest earlier step {before[-1]} is gone")
                extra = set(listed) - set(before) - {step}
                if extra:
                    problems.append(f"{where}: steps {sorted(extra)} listed from nowhere")
            w.end()
    finally:
        proxy.clear_faults()
        out["saves"] += done
        for r in proxy.requests[first:]:
            if r.action != "pass":
                out["injected"][r.action] = out["injected"].get(r.action, 0) + 1
        out["requests"] += proxy.count - first


# --------------------------------------------------------------------------- the campaign


@contextlib.contextmanager
def serving() -> Iterator[tuple[S3Server, FaultProxy]]:
    """SeaweedFS and the proxy, and the writers' fork server, for one run."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["stress.objectstore"])
    with (
        tempfile.TemporaryDirectory(prefix="objectstore-") as tmp,
        run_seaweedfs(Path(tmp), volume_size_mb=256) as server,
        FaultProxy(server.endpoint, seed=SEED) as proxy,
    ):
        yield server, proxy


def run(
    size: str, *, broken: str | None = None, shapes: tuple[Shape, ...] = SHAPES
) -> dict[str, Any]:
    """The campaign; ``broken`` (one of `BROKEN`) runs only the kill sweep on that
    broken save path. Raises `SeaweedUnavailable` if SeaweedFS cannot start."""
    cfg = SIZES[size]
    t0 = time.perf_counter()
    kills, faults = Tally(), Tally()
    logger = logging.getLogger("resumable")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # the takeovers of dead writers' leases, on purpose
    scale = throttling_scale(0.05)
    try:
        with serving() as (server, proxy):
            bucket = server.new_bucket("campaign")
            t1 = time.perf_counter()
            for rep in range(cfg["reps"]):
                for shape in shapes:
                    kill_sweep(server, proxy, bucket, shape, rep, cfg, kills, broken)
            t2 = time.perf_counter()
            if broken is None:
                for rate in cfg["rates"]:
                    for shape in shapes:
                        fault_sweep(server, proxy, bucket, shape, rate, cfg["saves"], faults)
            kills.details["seconds"] = round(t2 - t1, 1)
            faults.details["seconds"] = round(time.perf_counter() - t2, 1)
            proxy_errors = [repr(e) for e in proxy.errors if not isinstance(e, Killed)]
    finally:
        logger.setLevel(level)
        throttling_scale(scale)
    problems = kills.problems + faults.problems
    return {
        "trials": kills.trials + faults.trials,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "kill_sweep": {
                "trials": kills.trials,
                "failures": len(kills.problems),
                "repetitions": cfg["reps"],
                "kill_every_nth_request": cfg["stride"],
                "modes": list(cfg["modes"]),
                "seconds": kills.details.pop("seconds"),
                "shapes": kills.details,
            },
            "fault_sweep": {
                "trials": faults.trials,
                "failures": len(faults.problems),
                "saves_per_rate_and_shape": cfg["saves"],
                "fault_shares": FAULT_SHARES,
                "options": FAULT_OPTIONS,
                "delay_s": DELAY_S,
                "seconds": faults.details.pop("seconds"),
                "rates": faults.details,
            },
            "proxy_errors": proxy_errors[:5],
            "problems": problems[:10],
            "seed": SEED,
        },
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The kill sweep, at every request, on each broken save path of `BROKEN`."""
    out = {}
    for kind, shape in BROKEN.items():
        r = run("able", broken=kind, shapes=(SHAPES[shape],))
        out[kind] = {"trials": r["trials"], "failures": r["failures"]}
    return out


def warm_up() -> None:
    """Make one S3 client, so that this process's boto3 session has loaded the S3
    service model (~0.3 s): the writers, forked from the fork server, which imported
    this module, then make theirs in milliseconds. No request is sent."""
    S3Storage(
        "s3://warm-up",
        endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="-",
        aws_secret_access_key="-",
        region_name="us-east-1",
    )


warm_up()

__all__ = ["SeaweedUnavailable", "able_to_fail", "run"]
