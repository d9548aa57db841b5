"""`resumable.integrations.megatron`: a tiny Megatron-Core GPT under ``torchrun`` (two
CPU ranks, gloo), at TP=1 (data parallel over 2) and TP=2; the job is `megatron_job`.

- a run SIGKILLed (torchrun and every rank, as a lost node) at a random moment and
  relaunched ends bit-identical to an uninterrupted run at the same TP;
- a checkpoint written at one TP restores at another (2 -> 1, 1 -> 2, and into one
  process) with equal values: the digests of the global parameters and optimizer state
  the relaunch prints after its restore are those the saving run ended with; and it
  trains on;
- relaunched at another TP after a crash, the ranks skip their memory snapshots (TP=2
  shards) and restore the newest commit, resharded;
- layouts that torch's ``Shard`` would place otherwise are refused.

Success is judged by the job's result markers (``final step=N params_sha256=...``),
not by torchrun's exit code alone. Each launch takes 8-11 s on an idle 2-core machine
(Megatron's import is ~3 s of it). The short version, ``make test``, runs five launches:
the TP=2 reference run (launched at its first use, with the refusals), two killed TP=2
runs and their two relaunches (at TP=2, and at TP=1 after the crash). ``make campaign``
(``slow``) adds the TP=1 reference run, the kill at TP=1, repeated kills, the TP changes
from a finished run, four ranks and SGD.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from launch import start, torchrun_cmd
from s3server import free_ports

from .jobs import steps_in

# The launches import Megatron; this process only needs to know it is there (importing
# megatron.core here would cost every collection ~3 s).
if (
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None
):
    pytest.skip("needs megatron-core (the [megatron] extra)", allow_module_level=True)

pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
    pytest.mark.timeout(600),
]

JOB = Path(__file__).with_name("megatron_job.py")
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 180.0
STEPS = 12
DIGESTS = r"step=(\d+) params_sha256=([0-9a-f]{64}) optim_sha256=([0-9a-f]{64})"
FINAL = re.compile("final " + DIGESTS)
RESTORED = re.compile("restored " + DIGESTS)
AT = re.compile("at " + DIGESTS)
RESUMED = re.compile(r"rank (\d) resumed step=(\d+)")
STEP = re.compile(r"^step (\d+) loss", re.M)


@dataclass(frozen=True)
class Final:
    """The job's result marker."""

    step: int
    params: str
    optim: str


def command(nproc: int, directory: Path, *args: str) -> list[str]:
    """``torchrun`` of the job on ``nproc`` local ranks, on a port of its own."""
    (port,) = free_ports(1)
    return torchrun_cmd(nproc, JOB, "--dir", directory, "--steps", STEPS, *args, port=port)


def launch(nproc: int, directory: Path, *args: str) -> tuple[Final, str]:
    """Run the job to its end; its result marker (required) and output."""
    proc = start(command(nproc, directory, *args))
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_all(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"the launch ran over {LAUNCH_TIMEOUT_S} s:\n{output[-4000:]}")
    found = FINAL.findall(output)
    assert len(found) == 1, f"no result marker (rc {proc.returncode}):\n{output[-6000:]}"
    step, params, optim = found[0]
    return Final(int(step), params, optim), output


def killed(
    nproc: int, directory: Path, rng: random.Random, *args: str, committed: bool = False
) -> int:
    """Launch the job and SIGKILL torchrun and all its descendants (ranks, persist
    workers: a lost node) after a random iteration 2..STEPS-2 and a further random 0-0.3 s
    (in a step, a snapshot or a background persist); the last iteration rank 0 printed
    before the kill. With ``committed``, not before a checkpoint was committed.

    That iteration is read from all the output, drained after the kill: a busy test
    process reads its pipe late, so lines of later iterations may already wait there
    when the chosen one is read (a CI run resumed at 5 from a kill "at 2")."""
    at = rng.randint(2, STEPS - 2)
    proc = start(command(nproc, directory, "--sleep", "0.15", *args))
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for line in proc.stdout:
            seen.append(line)
            m = STEP.match(line)
            if m and int(m.group(1)) >= at and (not committed or steps_in(directory)):
                time.sleep(rng.uniform(0.0, 0.3))
                break
            assert time.monotonic() < deadline, "the job to kill ran over its time"
    finally:
        kill_all(proc.pid)
        rest, _ = proc.communicate()
    reached = max((int(s) for s in STEP.findall("".join(seen) + rest)), default=0)
    assert 0 < reached < STEPS, f"the job ended before the kill (reached {reached})"
    return reached


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts each rank in a session of its
    own, so a process group does not reach them)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def kill_all(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants, found before any of them dies."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def restored(output: str) -> Final:
    """The job's ``restored`` marker (required)."""
    found = RESTORED.findall(output)
    assert len(found) == 1, output[-4000:]
    step, params, optim = found[0]
    return Final(int(step), params, optim)


def resumed_at(output: str) -> set[int]:
    return {int(s) for _, s in RESUMED.findall(output)}


@dataclass(frozen=True)
class Reference:
    """An uninterrupted run: its result, checkpoint root and output."""

    final: Final
    root: Path
    output: str

    def at(self, step: int) -> Final:
        """The digests at ``step`` (any step: a persist deferred by a busy worker
        commits the next iteration, 7 rather than 6 in a CI run)."""
        found = {int(s): Final(int(s), p, o) for s, p, o in AT.findall(self.output)}
        return found[step]


class References:
    """Uninterrupted runs at TP=1 and TP=2 (two ranks each), each launched at its first
    use and kept for the module: `make test` needs only TP=2's, ``make campaign`` both.
    The TP=2 one also tries the layouts and objects the wrappers must refuse, before it
    trains."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._factory = tmp_path_factory
        self._runs: dict[int, Reference] = {}

    def __getitem__(self, tp: int) -> Reference:
        if tp not in self._runs:
            root = self._factory.mktemp(f"ref-tp{tp}") / "ck"
            extra = ("--check-refusals",) if tp == 2 else ()
            final, output = launch(2, root, "--tp", str(tp), *extra)
            assert final.step == STEPS and resumed_at(output) == {0}, output[-3000:]
            self._runs[tp] = Reference(final, root, output)
        return self._runs[tp]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory)


def test_what_would_checkpoint_wrongly_is_refused(reference: References) -> None:
    """A Megatron model given to a Checkpointer as it is (its TP shards would be taken
    for replicas) is refused at the first snapshot. TP shards whose offsets disagree
    with torch's ``Shard`` placement (here: TP ranks in reverse order) would reshard into
    scrambled tensors: refused when the wrapper is made, as are an object that is not a
    torch optimizer and one over other parameters."""
    found = re.findall(r"^refused ([\w ]+): (\w+): ", reference[2].output, re.M)
    refused = {case: error for case, error in found}
    assert "accepted" not in reference[2].output
    assert refused == {
        "raw model": "UnsupportedStateError",
        "offsets": "UnsupportedStateError",
        "optimizer": "UnsupportedStateError",
        "foreign parameters": "UnsupportedStateError",
    }


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_a_sigkilled_run_resumes_bit_identical(
    tmp_path: Path, reference: References, tp: int
) -> None:
    root = tmp_path / "ck"
    reached = killed(2, root, random.Random(tp), "--tp", str(tp))
    final, output = launch(2, root, "--tp", str(tp))
    (step,) = resumed_at(output)
    # From a commit or every rank's memory snapshot; a rank snapshots an iteration
    # before rank 0 prints it, so the kill may fall between the two.
    assert 0 < step <= reached + 1
    assert final == reference[tp].final


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_three_sigkills_at_tp2_end_bit_identical(
    tmp_path: Path, reference: References, seed: int
) -> None:
    root, rng = tmp_path / "ck", random.Random(seed)
    for _ in range(3):
        killed(2, root, rng, "--tp", "2")
    final, _ = launch(2, root, "--tp", "2")
    assert final == reference[2].final


@pytest.mark.parametrize(
    "saved, nproc, tp, extra",
    [
        pytest.param(2, 2, 1, (), marks=pytest.mark.slow),  # TP 2 -> 1 (DP 2), same ranks
        pytest.param(1, 2, 2, (), marks=pytest.mark.slow),  # TP 1 -> 2
        pytest.param(2, 1, 1, ("--reset-per-rank",), marks=pytest.mark.slow),  # one process
    ],
)
def test_a_tp_change_restores_equal_values_and_trains_on(
    tmp_path: Path,
    reference: References,
    saved: int,
    nproc: int,
    tp: int,
    extra: tuple[str, ...],
) -> None:
    """Relaunched at another TP from the saving run's last step: the digests of the
    restored global parameters and optimizer state are the saving run's final ones, and
    training goes on for 4 more iterations."""
    want = reference[saved].final
    root = tmp_path / "ck"
    shutil.copytree(reference[saved].root, root)
    final, output = launch(nproc, root, "--tp", str(tp), *extra, "--steps", str(STEPS + 4))
    assert resumed_at(output) == {STEPS}
    assert restored(output) == want
    assert final.step == STEPS + 4 and final != want
    losses = [float(x) for x in re.findall(r"step \d+ loss (\d+\.\d+)", output)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


def test_a_tp_change_after_a_crash_restores_the_newest_commit(
    tmp_path: Path, reference: References
) -> None:
    """Killed at TP=2, relaunched at TP=1 on the same two ranks: each rank's memory
    snapshot holds TP=2 shards and is not restored without resharding, so every rank
    skips it and restores the newest commit, resharded: its global values are those the
    uninterrupted TP=2 run had at that step. Then it trains to the end."""
    root = tmp_path / "ck"
    killed(2, root, random.Random(3), "--tp", "2", "--sleep", "0.4", committed=True)
    newest = steps_in(root)[-1]
    final, output = launch(2, root, "--tp", "1")
    assert "skipping the shared-memory snapshot" in output
    assert resumed_at(output) == {newest}
    assert restored(output) == reference[2].at(newest)
    assert final.step == STEPS


@pytest.mark.slow
def test_tp2_dp2_on_four_ranks_restores_at_tp1_on_two(tmp_path: Path) -> None:
    """TP=2 x DP=2 on four ranks (each DP replica writes its TP shards; the manifest
    keeps one entry per shard) restores into TP=1 x DP=2 on two ranks with the same
    global values."""
    root = tmp_path / "ck"
    want, _ = launch(4, root, "--tp", "2")
    final, output = launch(2, root, "--tp", "1", "--reset-per-rank", "--steps", str(STEPS + 2))
    assert restored(output) == want
    assert final.step == STEPS + 2


@pytest.mark.slow
def test_a_fresh_sgd_restores_its_momentum(tmp_path: Path) -> None:
    """SGD's momentum buffers appear at its first step, so a relaunch's fresh optimizer
    has no shards to restore into: from a rank's memory snapshot it takes the rank's own
    shard (a SIGKILLed run at TP=2 resumes bit-identical), from storage it reads the
    whole buffers and keeps its shard (TP 2 -> 1, the saving run's values)."""
    root = tmp_path / "ref"
    want, _ = launch(2, root, "--tp", "2", "--optimizer", "sgd")
    crashed = tmp_path / "crashed"
    killed(2, crashed, random.Random(7), "--tp", "2", "--optimizer", "sgd")
    final, _ = launch(2, crashed, "--tp", "2", "--optimizer", "sgd")
    assert final == want
    final, output = launch(2, root, "--tp", "1", "--optimizer", "sgd", "--steps", str(STEPS + 2))
    assert restored(output) == want
    assert final.step == STEPS + 2


SCHEDULER_JOB = """
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from resumable.integrations.megatron import MegatronScheduler

def scheduler():
    optim = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    return OptimizerParamScheduler(
        optim, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=4, lr_decay_steps=20,
        lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=20,
        wd_incr_style="linear")

s = scheduler()
for _ in range(5):
    s.step(increment=1)
saved, lr5 = s.state_dict(), s.optimizer.param_groups[0]["lr"]
for _ in range(3):
    s.step(increment=1)
raw = scheduler()
for _ in range(3):
    raw.step(increment=1)
raw.load_state_dict(saved)
MegatronScheduler(s).load_state_dict(saved)
print("raw", raw.num_steps, "wrapped", s.num_steps, s.optimizer.param_groups[0]["lr"] == lr5)
"""


def test_a_scheduler_restored_in_a_running_job_takes_the_saved_step() -> None:
    """Megatron's own load_state_dict adds the saved step count to the scheduler's
    (8 here, where 5 was saved); through MegatronScheduler the count and the learning
    rate are the saved step's."""
    out = _python_job(SCHEDULER_JOB)
    assert out.split()[-5:] == ["raw", "8", "wrapped", "5", "True"], out


def _python_job(code: str, *args: str) -> str:
    """The stdout of ``code`` run by a fresh interpreter with ``args``, this checkout's
    library first on its path; fails the test if it fails."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


OWNS_JOB = """
import os, sys
sys.path.insert(0, sys.argv[1])
import megatron_shim
megatron_shim.install()
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from resumable._restore import _Own
from resumable.integrations.megatron import MegatronModel, MegatronOptimizer

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
megatron_shim.manual_seed(1234)
config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
    ffn_hidden_size=32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
    vocab_size=64, max_sequence_length=8)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
mo = MegatronOptimizer(optim, MegatronModel(model))
given = _Own(frozenset())(mo.state_dict())  # values as a restore hands them: its own memory

def storages(value, out):
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        out.add(value.untyped_storage().data_ptr())
    elif isinstance(value, dict):
        for v in value.values():
            storages(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            storages(v, out)
    return out

lent = storages(given, set())
mo.load_state_dict(given)
kept = storages([optim.state[p] for p in optim.state], set())
params = storages([p for g in optim.param_groups for p in g["params"]], set())
kept |= storages(optim.param_groups, set()) - params
print("kept", len(kept), "shared", len(kept & lent))
"""


def test_the_megatron_optimizer_keeps_no_tensor_it_is_given() -> None:
    """`MegatronOptimizer` sets ``resumable_copies_on_load``: a restore hands it the values
    it read (views of a shared-memory slot or of a read buffer, which later snapshots and
    reads reuse) without copying them first, so every tensor the optimizer keeps must be
    its own: the moments copied from their parts, the 0-d ``step`` cloned."""
    out = _python_job(OWNS_JOB, str(Path(__file__).parent), str(free_ports(1)[0]))
    words = out.split()
    assert words[-4] == "kept" and int(words[-3]) > 0, out
    assert words[-2:] == ["shared", "0"], out
