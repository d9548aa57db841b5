"""Several ranks on real gloo process groups (world 1, 2 and 4, CPU), launched by torchrun.

The rank-side work is in `dist_job` (one or more phases per launch; each rank reports what it saw
as JSON, rank 0 dumps the full gathered model and optimizer state of each case), and the
assertions are here. A few launches are shared by the module (`runs`):

1. ``save2`` at world 2: FSDP2 and DDP checkpoints, and a save whose rank-1 write fails;
2. a plain single process (this one) saves ``plain1``;
3. ``world4`` at world 4: an FSDP2 checkpoint, and the world-2 one resharded to 4;
4. ``load2`` at world 2: same-world restores, 4->2, 1->2, and the next start after the
   failed save.

The background persists and the hung-rank case share one launch (``background``, then
``hang``), the mirror, overlap and agreement cases another; the torchrun restart of
``examples/distributed/train_fsdp.py`` has launches of its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_job
from launch import kill_session, run, start, torchrun_cmd
from resumable.commit import step_dir
from resumable.errors import StateMismatchError
from resumable.reader import CheckpointReader
from resumable.storage import open_storage

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

JOB = Path(__file__).with_name("dist_job.py")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed" / "train_fsdp.py"
LAUNCH_TIMEOUT_S = 240.0


def torchrun(
    nproc: int, script: Path, *args: Any, restarts: int = 0, env: dict[str, str] | None = None
) -> str:
    """Run ``script`` on ``nproc`` local ranks; returns stdout+stderr, fails on rc != 0."""
    cmd = torchrun_cmd(nproc, script, *args, restarts=restarts)
    rc, output = run(cmd, env=env, timeout=LAUNCH_TIMEOUT_S)
    assert rc == 0, f"{' '.join(cmd)} exited {rc}:\n{output[-6000:]}"
    return output


@dataclass
class Runs:
    """The output folder of a set of launches, and readers for what they left there."""

    out: Path

    def report(self, phase: str, rank: int) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.out / f"{phase}-rank{rank}.json").read_text())
        assert "crash" not in data, f"{phase} rank {rank} crashed:\n{data['crash']}"
        return data

    def reports(self, phase: str, world: int) -> list[dict[str, Any]]:
        return [self.report(phase, r) for r in range(world)]

    def state(self, name: str) -> tuple[dict[str, torch.Tensor], Any]:
        from safetensors.torch import load_file

        groups = json.loads((self.out / f"{name}.json").read_text())
        return load_file(str(self.out / f"{name}.safetensors")), groups

    def manifest(self, root: str, step: int) -> dict[str, Any]:
        """The whole manifest, its parts merged (format version 4), validated."""
        return CheckpointReader(open_storage(str(self.out / root)), step).manifest


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    out = tmp_path_factory.mktemp("dist")
    torchrun(2, JOB, "save2", out)
    model, optim = dist_job.build("plain")
    dist_job.train(model, optim, range(1, 4))
    with dist_job.open_ck(out / "plain1", model, optim) as ck:
        ck.save(3)
    dist_job.dump(out, "ref-plain1", model, optim)
    torchrun(4, JOB, "world4", out)
    torchrun(2, JOB, "load2", out)
    yield Runs(out)


def assert_same_state(runs: Runs, want: str, got: str) -> None:
    """Full model and optimizer state ``got`` equals ``want`` bit for bit, tensor by tensor."""
    want_t, want_groups = runs.state(want)
    got_t, got_groups = runs.state(got)
    assert sorted(got_t) == sorted(want_t)
    assert len(want_t) == 4 + 4 * 3  # 4 parameters, each with step, exp_avg, exp_avg_sq
    different = [
        k
        for k in want_t
        if got_t[k].dtype != want_t[k].dtype
        or got_t[k].shape != want_t[k].shape
        or not torch.equal(
            got_t[k].reshape(-1).view(torch.uint8), want_t[k].reshape(-1).view(torch.uint8)
        )
    ]
    assert not different, f"{got} differs from {want} in {different}"
    assert got_groups == want_groups


def test_a_saves_reports_reach_rank_0_alone_and_a_decisions_answers_every_rank(
    runs: Runs,
) -> None:
    """`Group.gather` (the reports of a save on the sync path: O(N) messages) gives rank
    0 every rank's report, of whatever length, in rank order, and the others nothing;
    `Group.all_gather` gives every rank every answer."""
    reports = runs.reports("world4", 4)
    assert reports[0]["gathered"] == [{"rank": r, "pad": "x" * (300 * r)} for r in range(4)]
    assert [r["gathered"] for r in reports[1:]] == [[], [], []]
    assert [r["all_gathered"] for r in reports] == [[0, 10, 20, 30]] * 4


def restored(report: dict[str, Any], case: str) -> int:
    result = report[case]
    assert "value" in result, f"rank {report['rank']}: {case} failed: {result}"
    value: int = result["value"]
    return value


# --------------------------------------------------------------------------- 1. same world


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_restore_at_the_same_world_size_is_bit_identical(runs: Runs, kind: str) -> None:
    for report in runs.reports("load2", 2):
        assert restored(report, f"got-{kind}2") == 3
    assert_same_state(runs, f"ref-{kind}2", f"got-{kind}2")


def test_a_restored_fsdp2_model_trains_on(runs: Runs) -> None:
    ref, _ = runs.state("ref-fsdp2")
    trained, _ = runs.state("trained-fsdp2")
    assert all(torch.isfinite(t).all() for t in trained.values())
    assert not torch.equal(trained["model/0.weight"], ref["model/0.weight"])
    assert trained["optim/0.weight/step"].item() == ref["optim/0.weight/step"].item() + 1


# --------------------------------------------------------------------------- 2. resharding

RESHARDS = [
    # (saved root, dumped case, phase that loaded it, its world size)
    ("fsdp4", "got-fsdp4to2", "load2", 2),
    ("fsdp2", "got-fsdp2to4", "world4", 4),
    ("plain1", "got-plain1to2", "load2", 2),
]


@pytest.mark.parametrize(("root", "case", "phase", "world"), RESHARDS, ids=lambda v: str(v))
def test_reshard_matches_the_saved_state(
    runs: Runs, root: str, case: str, phase: str, world: int
) -> None:
    for report in runs.reports(phase, world):
        assert restored(report, case) == 3
    assert_same_state(runs, f"ref-{root}", case)


def test_reshard_2_to_1_into_a_plain_process(runs: Runs) -> None:
    model, optim = dist_job.build("plain")
    with dist_job.open_ck(runs.out / "fsdp2", model, optim) as ck:
        with pytest.raises(StateMismatchError, match="__rng__"):
            ck.restore()
        assert ck.restore(reset_per_rank_state=True) == 3
    dist_job.dump(runs.out, "got-fsdp2to1", model, optim)
    assert_same_state(runs, "ref-fsdp2", "got-fsdp2to1")


@pytest.mark.parametrize(
    ("case", "phase", "world"),
    [
        ("no-reset-fsdp2to4", "world4", 4),
        ("no-reset-fsdp4to2", "load2", 2),
        ("no-reset-plain1to2", "load2", 2),
    ],
    ids=lambda v: str(v),
)
def test_world_size_change_refuses_per_rank_state_on_every_rank(
    runs: Runs, case: str, phase: str, world: int
) -> None:
    for report in runs.reports(phase, world):
        result = report[case]
        assert result.get("error") == "StateMismatchError", f"rank {report['rank']}: {result}"
        assert "'__rng__'" in result["message"]
        assert "reset_per_rank_state=True" in result["message"]


# --------------------------------------------------------------------------- 3. who writes what


def global_pieces(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in manifest["tensors"].values() if "fqn" in e]


def bytes_by_file(pieces: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in pieces:
        out[e["file"]] = out.get(e["file"], 0) + e["offsets"][1] - e["offsets"][0]
    return out


def test_ddp_replicated_state_is_written_once_in_total_and_spread(runs: Runs) -> None:
    m = runs.manifest("ddp2", 3)
    pieces = global_pieces(m)
    fqns = [e["fqn"] for e in pieces]
    assert len(fqns) == len(set(fqns)) == 16, fqns  # 4 params + 4 x (step, exp_avg, exp_avg_sq)
    assert sum(f.startswith("model/") for f in fqns) == 4
    for e in pieces:
        assert e["shape"] == e["global_shape"] and not any(e["global_offset"]), e
    per_file = bytes_by_file(pieces)
    total = sum(per_file.values())
    assert sorted(per_file) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    for fname, nbytes in per_file.items():
        assert 0.35 * total <= nbytes <= 0.65 * total, (fname, per_file)
    # Per-rank state is each rank's own, in its own file.
    for r in (0, 1):
        rng = [n for n in m["tensors"] if n.startswith(f"rank{r}/__rng__")]
        assert rng and all(m["tensors"][n]["file"] == f"rank-{r:05d}.safetensors" for n in rng)


@pytest.mark.parametrize(("root", "world"), [("fsdp2", 2), ("fsdp4", 4)])
def test_fsdp2_rank_files_hold_only_their_shards(runs: Runs, root: str, world: int) -> None:
    m = runs.manifest(root, 3)
    pieces = global_pieces(m)
    sharded = [e for e in pieces if e["global_shape"]]  # all but the 0-dim step counts
    for e in sharded:
        rows = e["global_shape"][0]
        per_rank = -(-rows // world)  # FSDP2 shards dim 0 in chunks of ceil(rows / world)
        r = int(e["file"][len("rank-") : -len(".safetensors")])
        assert e["global_offset"][0] == r * per_rank, e
        assert e["shape"][0] == min(per_rank, rows - r * per_rank), e
        assert e["shape"] != e["global_shape"], f"{e['fqn']} written whole by rank {r}"
    steps = [e["fqn"] for e in pieces if not e["global_shape"]]
    assert len(steps) == len(set(steps)) == 4  # replicated: once in total
    if world == 2:
        per_file = bytes_by_file(pieces)
        total = sum(per_file.values())
        for fname, nbytes in per_file.items():
            assert 0.35 * total <= nbytes <= 0.65 * total, (fname, per_file)


# --------------------------------------------------------------------------- 4. a failing rank


def test_a_rank_whose_write_fails_commits_nothing_anywhere(runs: Runs) -> None:
    staging2 = f".tmp-{step_dir(2)}."
    for report in runs.reports("save2", 2):
        result = report["fail_save2"]
        assert result.get("error") == "PersistError", f"rank {report['rank']}: {result}"
        assert "rank 1: StorageError: injected" in result["message"]
        assert report["fail_steps"] == [1]
        assert step_dir(2) not in report["fail_listing"]
        assert not [n for n in report["fail_listing"] if n.startswith(staging2)]
    for report in runs.reports("load2", 2):
        at_start = report["fail_listing_at_start"]
        assert step_dir(2) not in at_start
        assert not [n for n in at_start if n.startswith(staging2)]
        assert restored(report, "fail_restore") == 1
        assert report["fail_save3"].get("value") is True, report["fail_save3"]
        assert report["fail_steps_after"] == [1, 3]
    assert runs.manifest("fail2", 3)["world_size"] == 2


# ------------------------------------------------------------------- the memory tier per rank


def test_memory_tier_per_rank_restores_when_every_rank_has_the_step(runs: Runs) -> None:
    """Step 3 lived only in each rank's shared memory (step 2 committed): the next launch
    restores it from there on every rank, bit-identically, and commits it."""
    for report in runs.reports("save2", 2):
        assert report["mem_steps"] == [2]
    for report in runs.reports("load2", 2):
        assert restored(report, "mem_restore") == 3
        assert report["mem_steps_after"] == [2, 3]
    assert_same_state(runs, "ref-mem2", "got-mem2")
    assert runs.manifest("mem2", 3)["world_size"] == 2


def test_memory_tier_restores_a_state_of_per_rank_values_only(runs: Runs) -> None:
    """No module or optimizer (nothing global, as with a DeepSpeed engine): the
    snapshots still record their world size, and every rank restores its own step 3."""
    for r, report in enumerate(runs.reports("load2", 2)):
        assert restored(report, "perrank_restore") == 3
        assert report["perrank_x"] == [r * 10 + 3.0] * 4


def test_a_restore_without_global_tensors_does_not_capture_the_live_state(runs: Runs) -> None:
    """Each rank's own tensors of a stateful object, restored from storage at the same
    world size: no ``state_dict()`` of the live object is taken to place them (on a
    DeepSpeed ZeRO 3 engine that gathers every parameter), and each rank gets its own."""
    for r, report in enumerate(runs.reports("load2", 2)):
        assert restored(report, "counted_restore") == 3
        assert report["counted_calls"] == 0
        assert report["counted_sd"] == {"w": [r + 1.0] * 8, "m": [-(r + 1.0)] * 3}


def test_memory_tier_falls_back_together_when_a_rank_lacks_the_step(runs: Runs) -> None:
    """Rank 1 lost its snapshot of step 3: no rank uses its own; all restore step 2."""
    for report in runs.reports("load2", 2):
        assert restored(report, "memlost_restore") == 2


# --------------------------------------------------------------------------- 5. a hung rank


@pytest.fixture(scope="module")
def background_and_hang(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """One launch at world 2 for two phases: ``background``, then ``hang`` (which leaves
    the group broken, so it comes last)."""
    out = tmp_path_factory.mktemp("background-hang")
    torchrun(2, JOB, "background+hang", out)
    return Runs(out)


@pytest.fixture(scope="module")
def hang_run(background_and_hang: Runs) -> Runs:
    return background_and_hang


def test_a_hung_rank_makes_the_others_fail_in_bounded_time(hang_run: Runs) -> None:
    r0, r1 = hang_run.reports("hang", 2)
    result = r0["hang_save2"]
    assert result.get("error") == "PersistError", result
    assert "checkpoint coordination with the other ranks failed" in result["message"]
    assert dist_job.DIST_TIMEOUT_S - 0.5 <= result["seconds"] <= dist_job.DIST_TIMEOUT_S + 10
    assert r1["hang_save2"].get("error") == "PersistError", r1["hang_save2"]
    for report in (r0, r1):
        assert step_dir(2) not in report["hang_listing"]
    root = hang_run.out / "hang"
    assert not (root / step_dir(2)).exists()
    # The next start (rank 0 of the failed save is gone) removes the attempt's leftovers.
    model, optim = dist_job.build("plain")
    with dist_job.open_ck(root, model, optim) as ck:
        assert ck.steps() == [1]
        assert not [n for n in os.listdir(root) if n.startswith(f".tmp-{step_dir(2)}")]
        assert ck.restore(reset_per_rank_state=True) == 1


def test_the_coordinator_removes_its_attempt_when_a_rank_hangs(hang_run: Runs) -> None:
    # Rank 0 lists the root right after its PersistError (5 s), before the hung rank
    # wakes up (8 s) and writes its own late file.
    r0 = hang_run.report("hang", 0)
    assert not [n for n in r0["hang_listing"] if n.startswith(f".tmp-{step_dir(2)}")]


# --------------------------------------------------------------------------- 6. torchrun restart


RUN_ARGS = ["--steps", 12, "--save-every", 4]
FINAL = re.compile(r"final step=12 params_sha256=([0-9a-f]{64})")
RESUMED = re.compile(r"rank (\d) attempt (\d+): resumed from step (\d+)")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final params hash of the example run without interruption (the memory tier
    and preemption handling do not change training, so one reference serves all)."""
    plain = torchrun(2, EXAMPLE, "--dir", tmp_path_factory.mktemp("plain"), *RUN_ARGS)
    want = FINAL.findall(plain)
    assert len(want) == 1, plain[-3000:]
    return str(want[0])


def resumed_after_restart(output: str) -> set[tuple[int, int]]:
    """(rank, step) each rank resumed from in a restarted attempt."""
    return {(int(r), int(s)) for r, a, s in RESUMED.findall(output) if int(a) > 0}


def test_torchrun_restart_after_a_killed_rank_resumes_everywhere(
    tmp_path: Path, uninterrupted: str
) -> None:
    killed = torchrun(
        2,
        EXAMPLE,
        "--dir",
        tmp_path / "killed",
        *RUN_ARGS,
        restarts=3,
        env={"KILL_AT_STEP": "6", "KILL_RANK": "1"},
    )
    assert FINAL.findall(killed) == [uninterrupted], killed[-3000:]
    assert "rank 1: killing myself after step 6" in killed
    assert resumed_after_restart(killed) == {(0, 4), (1, 4)}, killed[-3000:]
    attempts = sorted(int(a) for _, a, _ in RESUMED.findall(killed))
    assert attempts == [0, 0, 1, 1], killed[-3000:]


def test_sigterm_to_one_rank_stops_every_rank_at_one_step(
    tmp_path: Path, uninterrupted: str
) -> None:
    """Only rank 1 gets SIGTERM (after step 6): at the next maybe_save every rank takes
    the emergency checkpoint of step 7 together and exits 75; torchrun restarts, every
    rank resumes from step 7, and the run ends as an uninterrupted one."""
    stopped = torchrun(
        2,
        EXAMPLE,
        "--dir",
        tmp_path / "term",
        *RUN_ARGS,
        "--memory-every",
        restarts=1,
        env={"TERM_AT_STEP": "6", "KILL_RANK": "1"},
    )
    assert FINAL.findall(stopped) == [uninterrupted], stopped[-3000:]
    assert "rank 1: SIGTERM to myself after step 6" in stopped
    assert resumed_after_restart(stopped) == {(0, 7), (1, 7)}, stopped[-3000:]
    audit = [
        json.loads(line) for line in (tmp_path / "term" / "audit.jsonl").read_text().splitlines()
    ]
    emergency = [e for e in audit if e["event"] == "emergency_commit"]
    assert [e["step"] for e in emergency] == [7], emergency
    assert emergency[0]["within_grace"] is True


@pytest.fixture(scope="module")
def solo_run(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("solo")
    torchrun(1, JOB, "solo", out)
    return Runs(out)


@pytest.mark.parametrize("persist", ["sync", "process"])
def test_fsdp2_on_one_rank_round_trips(solo_run: Runs, persist: str) -> None:
    """World size 1 keeps the single-process path; DTensors on a one-rank mesh save and
    restore there too, in either persist mode."""
    runs = solo_run
    assert restored(runs.report("solo", 0), f"solo_{persist}") == 3
    assert_same_state(runs, f"ref-solo-{persist}", f"got-solo-{persist}")


# ------------------------------------------------------------- 8. background persists


@pytest.fixture(scope="module")
def background_run(background_and_hang: Runs) -> Runs:
    return background_and_hang


def assert_failed_then_recovered(runs: Runs, root: str, case: str) -> None:
    """``case`` raised `PersistError` on every rank; step 2 was not committed and left
    nothing behind; the next persist committed on every rank."""
    for report in runs.reports("background", 2):
        assert report[f"{root}_mode"] in ("process", "thread")
        failed = report[case]
        assert "PersistError" in failed.get("bases", []), f"rank {report['rank']}: {failed}"
        assert report[f"{root}_steps"] == [1]
        assert restored(report, f"{root}_save3")
        assert report[f"{root}_steps_after"] == [1, 3]
    leftovers = [n for n in os.listdir(runs.out / root) if n.startswith(".tmp")]
    assert leftovers == []
    assert runs.manifest(root, 3)["world_size"] == 2


def test_background_persist_with_a_failing_rank_commits_nothing(background_run: Runs) -> None:
    """Rank 1's write of step 2 fails in its worker: save() returned on both ranks after
    the snapshot; every rank gets PersistError at wait(); the next save commits."""
    for report in background_run.reports("background", 2):
        assert restored(report, "bgfail_save2") is True
        assert step_dir(2) not in report["bgfail_listing"]
    assert_failed_then_recovered(background_run, "bgfail", "bgfail_wait2")


def test_background_restore_falls_back_together_when_one_rank_cannot_read(
    background_run: Runs,
) -> None:
    """Rank 1's file of the newest step (3) is damaged. Persisting in the background,
    the ranks tell each other their verdicts through the coordination store, not the
    side group: rank 1's reaches rank 0, and both restore step 1."""
    for report in background_run.reports("background", 2):
        assert report["bgrestore_mode"] == "thread"
        assert restored(report, "bgrestore") == 1


def test_background_persist_with_a_killed_worker_commits_nothing(background_run: Runs) -> None:
    """Rank 1's worker is SIGKILLed with step 2 queued: its trainer reports the loss in
    the worker's place, so rank 0's worker aborts at once, not at the 600 s default
    timeout (the launch would run over its limit)."""
    r0, r1 = background_run.reports("background", 2)
    assert r1["bgkill_workers"] == 1
    for report in (r0, r1):
        assert step_dir(2) not in report["bgkill_listing"]
    assert "persist process" in r1["bgkill_wait2"]["message"]
    assert_failed_then_recovered(background_run, "bgkill", "bgkill_wait2")


def test_background_persist_with_a_hung_worker_fails_at_the_timeout(background_run: Runs) -> None:
    """Rank 1's worker hangs: rank 0's worker stops waiting at dist_timeout_s, names the
    rank it waited for, removes its attempt and commits nothing."""
    r0, _ = background_run.reports("background", 2)
    assert "rank(s) [1]" in r0["bghang_wait2"]["message"], r0["bghang_wait2"]
    assert step_dir(2) not in r0["bghang_listing"]
    assert not [n for n in r0["bghang_listing"] if n.startswith(".tmp")]
    assert_failed_then_recovered(background_run, "bghang", "bghang_wait2")


# ------------------------------------------------- 9. SIGKILLs at random moments


CAMPAIGN_ARGS = ["--steps", 400, "--save-every", 5, "--memory-every"]
CAMPAIGN_FINAL = re.compile(r"final step=400 params_sha256=([0-9a-f]{64})")


def trainer_pids(agent: int) -> list[int]:
    """The example's rank processes: descendants of torchrun's agent ``agent``."""
    found, todo = [], [agent]
    while todo:
        pid = todo.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train_fsdp.py") for a in cmd) and b"torch.distributed.run" not in cmd:
            found.append(pid)
    return sorted(found)


def killed_at_random(out: Path, kills: int, seed: int) -> str:
    """The example under ``torchrun --max-restarts``: in ``kills`` of its attempts (the
    newest one each time; an attempt that ends by itself is not killed), once both ranks
    have restored and rank 0 has reported 1-4 more saves
    (every 5 steps), one rank is SIGKILLed after a further random 0-0.3 s (in a training
    step, a snapshot, a background persist or its commit); returns the output.

    Counting saves rather than seconds keeps every kill inside the run whatever the
    machine's speed: a fixed 0.1-1.5 s let an unloaded machine finish the 400 steps
    after 4 of 12 kills."""
    import random
    import threading
    import time

    rng = random.Random(seed)
    proc = start(torchrun_cmd(2, EXAMPLE, "--dir", out, *CAMPAIGN_ARGS, restarts=kills + 4))
    assert proc.stdout is not None
    lines: list[str] = []
    done: list[int] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    resumed_line = re.compile(r"rank (\d) attempt (\d+): resumed")
    step_line = re.compile(r"step \d+ loss")

    def newest_attempt_resumed() -> int:
        """The newest attempt both ranks have resumed in (-1: none yet)."""
        seen: dict[int, set[str]] = {}
        for x in lines:  # two ranks' prints can share a line
            for m in resumed_line.finditer(x):
                seen.setdefault(int(m.group(2)), set()).add(m.group(1))
        return max((a for a, ranks in seen.items() if len(ranks) == 2), default=-1)

    def killer() -> None:
        # Each kill goes to the newest attempt once both its ranks resumed: an attempt
        # that ends by itself (torchrun restarts the group) does not stall the killer.
        last = -1
        while len(done) < kills:
            while (attempt := newest_attempt_resumed()) <= last:
                if proc.poll() is not None:
                    return
                time.sleep(0.02)
            last = attempt
            resumed, saves = len(lines), rng.randint(1, 4)
            while sum(len(step_line.findall(x)) for x in lines[resumed:]) < saves:
                if proc.poll() is not None:
                    return
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            pids = trainer_pids(proc.pid)
            if not pids:
                return
            os.kill(rng.choice(pids), signal.SIGKILL)
            done.append(attempt)

    threads = [threading.Thread(target=f, daemon=True) for f in (reader, killer)]
    for t in threads:
        t.start()
    try:
        proc.wait(timeout=LAUNCH_TIMEOUT_S + 20 * kills)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        proc.wait()
        pytest.fail("the campaign ran over its time:\n" + "".join(lines)[-4000:])
    for t in threads:
        t.join(timeout=10)
    output = "".join(lines)
    (out.parent / f"{out.name}-output.log").write_text(output)  # kept with tmp_path
    assert proc.returncode == 0, output[-6000:]
    assert len(done) == kills, f"{len(done)} of {kills} kills landed:\n{output[-3000:]}"
    return output


@pytest.fixture(scope="module")
def campaign_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    plain = torchrun(2, EXAMPLE, "--dir", tmp_path_factory.mktemp("ref"), *CAMPAIGN_ARGS)
    want = CAMPAIGN_FINAL.findall(plain)
    assert len(want) == 1, plain[-3000:]
    return str(want[0])


def _campaign(tmp_path: Path, reference: str, kills: int, seed: int) -> None:
    output = killed_at_random(tmp_path / "ck", kills, seed)
    assert CAMPAIGN_FINAL.findall(output) == [reference], output[-4000:]
    # Every kill led to a restart that resumed; on a loaded machine an attempt can also
    # fail at its start (gloo's connect) and torchrun restarts once more (kills + 4 allowed).
    attempts = {int(a) for _, a, _ in RESUMED.findall(output)}
    assert 0 in attempts and len(attempts) >= kills + 1, output[-4000:]
    leftovers = [n for n in os.listdir(tmp_path / "ck") if n.startswith(".tmp")]
    assert leftovers == []


def test_random_sigkills_of_a_two_rank_job_end_bit_identical(
    tmp_path: Path, campaign_reference: str
) -> None:
    """Three SIGKILLs of a random rank at random moments of training: each time the
    job restarts from the newest commit (or every rank's shared-memory snapshot) and it
    ends bit-identical to an uninterrupted run."""
    _campaign(tmp_path, campaign_reference, kills=3, seed=11)


@pytest.mark.slow
@pytest.mark.timeout(900)  # its launch waits up to 480 s; the default 300 s cut it short
@pytest.mark.parametrize("seed", [1, 2])
def test_twelve_random_sigkills_of_a_two_rank_job_end_bit_identical(
    tmp_path: Path, campaign_reference: str, seed: int
) -> None:
    _campaign(tmp_path, campaign_reference, kills=12, seed=seed)


# ------------------------------------------------------------ 10. a mirror


@pytest.fixture(scope="module")
def background_phases(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """One launch at world 2 for the phases of sections 10 and 11, run in turn by the
    same ranks (each with roots and marks of its own under one out folder)."""
    out = tmp_path_factory.mktemp("phases")
    torchrun(2, JOB, "mirror+overlap+agree_early+agree", out)
    return Runs(out)


def test_a_mirror_with_several_ranks_uploads_once_and_restores_an_empty_disk(
    background_phases: Runs,
) -> None:
    """Two ranks persisting in the background with a mirror: rank 0's worker uploads
    each committed checkpoint once; after the local root is lost, both ranks restore
    the newest checkpoint from the mirror, bit-identically."""
    runs = background_phases
    for report in runs.reports("mirror", 2):
        assert report["mirror_mode"] == "process"
        assert report["mirror_steps"] == [2, 4]  # local keeps 1; the mirror keeps all
        assert restored(report, "mirror_restore") == 4
    assert_same_state(runs, "ref-mirror", "got-mirror")
    remote = runs.out / "remote"
    assert sorted(p.name for p in remote.glob("step-*")) == [step_dir(2), step_dir(4)]
    assert json.loads((remote / step_dir(4) / "manifest.json").read_text())["world_size"] == 2
    audit = [json.loads(x) for x in (remote / "audit.jsonl").read_text().splitlines()]
    uploads = [e["step"] for e in audit if e["event"] == "commit"]
    assert uploads == [2, 4]  # each once, whichever rank


def test_overlap_mode_with_several_ranks_snapshots_the_right_step(
    background_phases: Runs,
) -> None:
    """FSDP2 at 2 ranks with overlap=True: the parameters and moments of step 5 are
    copied while step 6 trains, and the checkpoint of step 5 holds step 5's state."""
    runs = background_phases
    for report in runs.reports("overlap", 2):
        # parameters and moments (all but the step counts) were copied in the background
        assert report["overlapped"] >= report["state_bytes"] > 0
        assert restored(report, "overlap_restore") == 5
    assert_same_state(runs, "ref-overlap", "got-overlap")


# ------------------------------------------------------------ 11. agreed without a collective


def test_a_save_asks_whether_to_persist_before_its_snapshot_copy(
    background_phases: Runs,
) -> None:
    """Rank 0, its worker busy, is held inside its snapshot of step 7 until rank 1's
    save of step 7 returned: rank 1, free, still gets rank 0's "busy" (both skip),
    since rank 0 asked before copying. Step 8 then commits on both."""
    for report in background_phases.reports("agree_early", 2):
        assert restored(report, "save6") is True
        assert restored(report, "save7") is False, report["save7"]
        assert "value" in report["wait7"], report["wait7"]
        assert restored(report, "save8") is True
        assert report["steps"] == [6, 8], report
        assert report["skips"] == 1


def test_background_persists_are_agreed_without_a_collective(background_phases: Runs) -> None:
    """Two ranks persisting in the background: a save never waits for the other rank's
    save (rank 1 saves step 1 only once rank 0's save returned) and calls no
    collective; the first rank to reach a due persist decides for both. Rank 1, free,
    decides step 3 first: rank 0, its worker still busy with step 2, waits for it and
    persists step 3 too. Rank 0, busy with step 4, decides step 5 first: both skip it.
    Then, with another checkpointer: rank 0's worker never finishes step 12, rank 1
    decides step 13: rank 0 waits up to the timeout, forgoes its part of step 13 and
    raises; rank 1 learns it from rank 0's report; step 14 commits on both."""
    r0, r1 = background_phases.reports("agree", 2)
    assert r0["pending3"] == 1 and r0["pending5"] == 1  # rank 0's worker was busy
    for report in (r0, r1):
        assert [restored(report, f"save{step}") for step in range(1, 6)] == [
            True,
            True,
            True,
            True,
            False,
        ], report
        assert report["steps3"] == [1, 2, 3]
        assert report["steps5"] == [1, 2, 3, 4]
        assert report["skips"] == 1
        assert report["collectives"] == []
        assert restored(report, "save14") is True
        assert report["steps14"] == [11, 12, 14]
    # rank 0, told to persist step 13 while its worker never finished step 12
    assert r0["save13"].get("error") == "PersistError", r0["save13"]
    assert "did not finish within" in r0["save13"]["message"], r0["save13"]
    # rank 1's worker stopped at rank 0's report (not at its own timeout: that says
    # "wait for rank 0's attempt")
    assert r1["wait13"].get("error") == "PersistError", r1["wait13"]
    assert (
        "rank 0: its previous persist did not finish before step 13's" in (r1["wait13"]["message"])
    ), r1["wait13"]
