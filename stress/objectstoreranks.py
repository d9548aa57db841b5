"""Campaign 6b, object storage faults at two ranks: campaign 6 (`stress.objectstore`)
for a job of two ranks in a real ``torch.distributed`` gloo process group, saving into
one root on SeaweedFS through the fault proxy.

Each launch starts two rank processes from the campaign's fork server (torch and the
library imported once; no proxy threads inherited). They join a gloo group through a
``TCPStore`` this process hosts on a free loopback port (one prefix per launch) and open
the root with a `Checkpointer` (``persist="sync"``: the coordinated commit of
``docs/distributed.md``, each rank uploading its own data file and rank 0 the manifest;
``dist_timeout_s`` of `DIST_TIMEOUT_S`); every rank holds a replicated model that
depends only on the step and a tensor of its own that depends on the step and the rank.
The campaign drives both ranks in lockstep, one save at a time, and checks what landed
straight at the server (not through the proxy):

- **Fault-rate sweep.** At each failure rate (`stress.objectstore.RATES`, the same mix
  of 5xx answers, resets, lost responses and delays), for each save shape, the ranks
  save one step after another. Both ranks must end each save the same way (both
  commit, or both raise `CheckpointError`) within `SAVE_TIMEOUT_S`; a commit must be
  listed; a failed save may be listed anyway only if whole (its manifest landed and a
  later request failed). After every save, every listed step must verify
  (`CheckpointReader.verify`: both ranks' files, sizes, checksums), hold world size 2
  and both ranks' files, and nothing may be listed that was not being saved; the newest
  step listed before stays listed.
- **Kill sweep.** For each shape, launches one after another: both ranks restore (the
  same step, the newest listed one or newer, with exactly the values saved at it), save
  0-2 steps, then one rank (either) or both are SIGKILLed at a random moment of the
  next save (0-300 ms into it). A surviving rank must end that save by itself with a
  `CheckpointError` within `SURVIVOR_TIMEOUT_S` (its collective fails on the dead
  peer). Then the listed steps are checked as above.

No request faults are injected during the kill sweep, so that every kill lands inside
the coordinated commit's own requests and waits, not inside retries.

**Able to fail**: the kill sweep with rank 0's commit replaced by
`stress.objectstore.ManifestFirstCommit` (the manifest put before the data is copied
next to it) must leave a torn checkpoint listed.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import time
from datetime import timedelta
from typing import Any

import torch

from resumable import Checkpointer
from resumable.commit import step_dir
from resumable.errors import CheckpointError
from resumable.format import MANIFEST, checksum
from resumable.reader import CheckpointReader
from resumable.storage.s3 import S3Storage
from stress import objectstore
from stress.objectstore import (
    FAULT_OPTIONS,
    RATES,
    SHAPES,
    Shape,
    apply_broken,
    fault_mix,
    make_state,
    s3_options,
    serving,
    set_state,
    throttling_scale,
)

SEED = 62
WORLD = 2
DIST_TIMEOUT_S = 10.0
SAVE_TIMEOUT_S = 120.0
OPEN_TIMEOUT_S = 120.0
SURVIVOR_TIMEOUT_S = 3 * DIST_TIMEOUT_S
SIZES: dict[str, dict[str, Any]] = {
    "small": {"rates": (0.10,), "saves": 4, "launches": 3, "shapes": (2,)},
    "full": {"rates": RATES, "saves": 30, "launches": 30, "shapes": (0, 1, 2)},
    "able": {"rates": (), "saves": 0, "launches": 12, "shapes": (0,)},
    "caught": {"rates": (), "saves": 0, "launches": 12, "shapes": (0,), "until_caught": True},
}
"""``saves``: per rate and shape; ``launches``: killed launches per shape; ``caught``:
``able``'s launches, ended by the first after which a problem is found (`make test`'s
proof that the checks catch a broken commit)."""


def _mine(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(256, generator=g)


def _state(shape: Shape) -> dict[str, Any]:
    state = make_state(shape)
    state["mine"] = torch.zeros(256)
    return state


def _set(state: dict[str, Any], step: int, rank: int) -> None:
    set_state(state, step)
    state["mine"].copy_(_mine(step, rank))


def _same(state: dict[str, Any], step: int, rank: int, shape: Shape) -> bool:
    want = _state(shape)
    _set(want, step, rank)
    names = [k for k in want if k != "model"]
    a = [*state["model"].state_dict().values(), *(state[k] for k in names)]
    b = [*want["model"].state_dict().values(), *(want[k] for k in names)]
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- a rank


def rank_main(
    conn: Any,
    rank: int,
    port: int,
    launch: int,
    url: str,
    options: dict[str, Any],
    shape: Shape,
    broken: str | None,
) -> None:
    """One rank: join the group, open the root and restore, say ``ready`` with the step
    and whether its values are the ones saved, then save the steps it is told to."""
    import torch.distributed as dist

    logging.getLogger("resumable").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    throttling_scale(0.05)
    apply_broken(broken)
    timeout = timedelta(seconds=DIST_TIMEOUT_S)
    store = dist.PrefixStore(
        f"launch-{launch}",
        dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    state = _state(shape)
    try:
        ck = Checkpointer(
            url,
            state,
            keep=shape.keep,
            persist="sync",
            capture_rng=False,
            save_on_close=False,
            storage_options=options,
            dist_timeout_s=DIST_TIMEOUT_S,
        )
        restored = ck.restore()
    except CheckpointError as exc:
        conn.send(("open failed", type(exc).__name__, str(exc)[:300]))
        os._exit(0)
    conn.send(("ready", restored, restored == 0 or _same(state, restored, rank, shape)))
    while True:
        command, step = conn.recv()
        if command == "close":
            with contextlib.suppress(CheckpointError):
                ck.close()
            conn.send(("closed",))
            conn.close()
            os._exit(0)  # no interpreter teardown: gloo's exit race
        _set(state, step, rank)
        try:
            ck.save(step)
            conn.send(("committed", step))
        except CheckpointError as exc:
            conn.send(("failed", type(exc).__name__, str(exc)[:300]))
        except Exception as exc:
            conn.send(("unexpected", type(exc).__name__, str(exc)[:300]))


class Rank:
    """A rank process and its end of the pipe."""

    def __init__(self, rank: int, port: int, launch: int, url: str, options: Any, shape: Shape,
                 broken: str | None) -> None:  # fmt: skip
        ctx = multiprocessing.get_context("forkserver")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=rank_main,
            args=(child, rank, port, launch, url, options, shape, broken),
            daemon=True,
        )
        self.proc.start()
        child.close()

    def reply(self, timeout: float) -> tuple[Any, ...] | None:
        ready = multiprocessing.connection.wait([self.conn, self.proc.sentinel], timeout)
        if self.conn in ready:
            try:
                return tuple(self.conn.recv())
            except (EOFError, OSError):
                return None
        return None

    def send(self, command: str, step: int = 0) -> None:
        with contextlib.suppress(OSError):
            self.conn.send((command, step))

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def end(self) -> None:
        if self.proc.is_alive():
            self.send("close")
            self.reply(30)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class Job:
    """The two ranks of one launch."""

    def __init__(self, port: int, launch: int, url: str, options: Any, shape: Shape,
                 broken: str | None = None) -> None:  # fmt: skip
        self.ranks = [Rank(r, port, launch, url, options, shape, broken) for r in range(WORLD)]

    def replies(self, timeout: float) -> list[tuple[Any, ...] | None]:
        deadline = time.monotonic() + timeout
        return [r.reply(max(0.0, deadline - time.monotonic())) for r in self.ranks]

    def save(self, step: int, timeout: float = SAVE_TIMEOUT_S) -> list[tuple[Any, ...] | None]:
        for r in self.ranks:
            r.send("save", step)
        return self.replies(timeout)

    def end(self) -> None:
        for r in self.ranks:
            r.end()


# --------------------------------------------------------------------------- the checks


class Checker(objectstore.Checker):
    """Campaign 6's checker of the listed steps, straight at the server, where a step's
    full check is: verify (both ranks' files, sizes, checksums) and hold world size 2
    and both ranks' files."""

    def __init__(self, storage: S3Storage) -> None:
        super().__init__(storage, SHAPES[0])

    def check(self, step: int) -> None:
        sum_ = checksum(self.storage.read(f"{step_dir(step)}/{MANIFEST}"))
        if self.checked.get(step) == sum_:
            return
        reader = CheckpointReader(self.storage, step)
        reader.verify()
        files = sorted(reader.manifest.get("files", {}))
        names = [f.rsplit("/", 1)[-1] for f in files]  # object stores: "<attempt>/rank-..."
        ranks = {r for r in range(WORLD) for f in names if f.startswith(f"rank-{r:05d}")}
        if reader.manifest.get("world_size") != WORLD or len(ranks) != WORLD:
            raise AssertionError(f"world {reader.manifest.get('world_size')}, files {files}")
        self.checked[step] = sum_
        self.full_checks += 1


def _outcome(reply: tuple[Any, ...] | None) -> str:
    if reply is None:
        return "no answer"
    if reply[0] == "committed":
        return "committed"
    if reply[0] == "failed":
        return "raised"
    return f"unexpected {reply[1:]}"


# --------------------------------------------------------------------------- the sweeps


def _open(
    store_port: int, launch: list[int], url: str, options: Any, shape: Shape, broken: str | None
) -> tuple[Job | None, list[tuple[Any, ...] | None]]:
    launch[0] += 1
    job = Job(store_port, launch[0], url, options, shape, broken)
    hello = job.replies(OPEN_TIMEOUT_S)
    if all(h is not None and h[0] == "ready" for h in hello):
        return job, hello
    for r in job.ranks:
        r.kill()
    job.end()
    return None, hello


def fault_sweep(
    server: Any, proxy: Any, port: int, launch: list[int], bucket: str, shape: Shape,
    rate: float, saves: int, problems: list[str], out: dict[str, Any],
) -> int:  # fmt: skip
    """``saves`` coordinated saves of ``shape`` with ``rate`` of the requests failing;
    returns the trials."""
    name = f"{rate:.0%} {shape.name}"
    url = f"s3://{bucket}/ranks-faults-{rate:.2f}-{SHAPES.index(shape)}"
    through = s3_options(proxy.endpoint, server, **FAULT_OPTIONS)
    checker = Checker(S3Storage(url, **s3_options(server.endpoint, server)))
    outcomes: dict[str, int] = out.setdefault("outcomes", {})
    listed: list[int] = []
    step = done = opens = 0
    first = proxy.count
    proxy.set_faults(**fault_mix(rate))
    try:
        while done < saves:
            opens += 1
            if opens > 4 * saves:
                problems.append(f"{name}: the ranks keep failing to open")
                break
            job, hello = _open(port, launch, url, through, shape, None)
            if job is None:
                out["opens_failed"] = out.get("opens_failed", 0) + 1
                continue
            restored = {h[1] for h in hello if h is not None}
            if len(restored) != 1 or not all(h[2] for h in hello if h is not None):
                problems.append(f"{name}: the ranks restored {hello}")
            for _ in range(min(10, saves - done)):
                before = listed
                step += 1
                done += 1
                where = f"{name}, save of step {step}"
                replies = job.save(step)
                ends = [_outcome(r) for r in replies]
                listed = checker.listed(where, problems)
                key = ends[0] if len(set(ends)) == 1 else " / ".join(ends)
                if key == "raised" and step in listed:
                    key = "raised, committed anyway"
                outcomes[key] = outcomes.get(key, 0) + 1
                if len(set(ends)) != 1 or ends[0] not in ("committed", "raised"):
                    problems.append(f"{where}: the ranks ended {ends}: {replies}"[:500])
                    break
                if ends[0] == "committed" and step not in listed:
                    problems.append(f"{where}: the save returned but the step is not listed")
                if before and before[-1] not in listed:
                    problems.append(f"{where}: the newest earlier step {before[-1]} is gone")
                extra = set(listed) - set(before) - {step}
                if extra:
                    problems.append(f"{where}: steps {sorted(extra)} listed from nowhere")
            job.end()
    finally:
        proxy.clear_faults()
        out["saves"] = out.get("saves", 0) + done
        injected: dict[str, int] = out.setdefault("injected", {})
        for r in proxy.requests[first:]:
            if r.action != "pass":
                injected[r.action] = injected.get(r.action, 0) + 1
    return done


def kill_sweep(
    server: Any, proxy: Any, port: int, launch: list[int], bucket: str, shape: Shape,
    launches: int, rng: random.Random, problems: list[str], out: dict[str, Any],
    broken: str | None, until_caught: bool = False,
) -> int:  # fmt: skip
    """``launches`` launches of ``shape``, each killed in a save (``until_caught``: up to
    the first after which a problem is found); returns the kills."""
    url = f"s3://{bucket}/ranks-kills-{SHAPES.index(shape)}-{broken or 'ok'}"
    through = s3_options(proxy.endpoint, server)
    checker = Checker(S3Storage(url, **s3_options(server.endpoint, server)))
    victims: dict[str, int] = out.setdefault("killed", {"rank 0": 0, "rank 1": 0, "both": 0})
    survivors: dict[str, int] = out.setdefault("survivor_ended", {})
    kills = 0
    listed: list[int] = []
    step = 0
    for k in range(launches):
        where = f"kills {shape.name}, launch {k}"
        job, hello = _open(port, launch, url, through, shape, broken)
        if job is None:
            problems.append(f"{where}: the ranks did not open: {hello}"[:500])
            continue
        restored = {h[1] for h in hello if h is not None}
        newest = max(listed, default=0)
        if len(restored) != 1 or min(restored) < newest:
            problems.append(f"{where}: the ranks restored {restored}, the newest listed {newest}")
        if not all(h[2] for h in hello if h is not None):
            problems.append(f"{where}: restored values differ from the ones saved")
        step = max([step, *restored])
        for _ in range(rng.randint(0, 2)):
            step += 1
            ends = [_outcome(r) for r in job.save(step)]
            if ends != ["committed"] * WORLD:
                problems.append(f"{where}: an unkilled save of step {step} ended {ends}")
        before = checker.listed(where, problems)
        step += 1
        victim = rng.choice(((0,), (1,), (0, 1)))
        for each in job.ranks:
            each.send("save", step)
        time.sleep(rng.uniform(0.0, 0.3))
        for v in victim:
            job.ranks[v].kill()
        kills += 1
        victims["both" if len(victim) == WORLD else f"rank {victim[0]}"] += 1
        for n, rank in enumerate(job.ranks):
            if n in victim:
                continue
            reply = rank.reply(SURVIVOR_TIMEOUT_S)
            end = _outcome(reply)
            if end == "committed":  # the kill came after the commit: the step is listed
                end = "committed before the kill"
            survivors[end] = survivors.get(end, 0) + 1
            if end not in ("raised", "committed before the kill"):
                problems.append(f"{where}: rank {n} survived its peer and ended {end}")
            rank.kill()
        job.end()
        listed = checker.listed(where, problems)
        if before and before[-1] not in listed:
            problems.append(f"{where}: the newest earlier step {before[-1]} is gone")
        extra = set(listed) - set(before) - {step}
        if extra:
            problems.append(f"{where}: steps {sorted(extra)} listed from nowhere")
        if until_caught and problems:
            break
    return kills


def run(size: str, *, broken: str | None = None) -> dict[str, Any]:
    from torch.distributed import TCPStore

    cfg = SIZES[size]
    shapes = [SHAPES[i] for i in cfg["shapes"]]
    rng = random.Random(SEED)
    t0 = time.perf_counter()
    problems: list[str] = []
    kills_out: dict[str, Any] = {}
    faults_out: dict[str, Any] = {}
    trials = 0
    logger = logging.getLogger("resumable")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    scale = throttling_scale(0.05)
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    launch = [0]
    try:
        with serving() as (server, proxy):
            bucket = server.new_bucket("ranks")
            for shape in shapes:
                trials += kill_sweep(
                    server, proxy, store.port, launch, bucket, shape, cfg["launches"], rng,
                    problems, kills_out.setdefault(shape.name, {}), broken,
                    cfg.get("until_caught", False),
                )  # fmt: skip
            t1 = time.perf_counter()
            for rate in cfg["rates"]:
                for shape in shapes:
                    trials += fault_sweep(
                        server, proxy, store.port, launch, bucket, shape, rate, cfg["saves"],
                        problems, faults_out.setdefault(f"{rate:.0%} {shape.name}", {}),
                    )  # fmt: skip
    finally:
        logger.setLevel(level)
        throttling_scale(scale)
        del store
    return {
        "trials": trials,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "ranks": WORLD,
            "dist_timeout_s": DIST_TIMEOUT_S,
            "launches": launch[0],
            "kill_sweep": kills_out,
            "fault_sweep": faults_out,
            "fault_sweep_seconds": round(time.perf_counter() - t1, 1) if cfg["rates"] else 0,
            "problems": problems[:10],
            "seed": SEED,
        },
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The kill sweep with the manifest put before the data."""
    r = run("able", broken="manifest-first")
    return {"manifest written first": {"trials": r["trials"], "failures": r["failures"]}}
