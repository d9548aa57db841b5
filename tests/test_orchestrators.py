"""The orchestrator examples (examples/orchestrators/): the Kubernetes Job is parsed and
checked against the exit-code contract, the Slurm batch script's header and requeue logic
are checked, and the resume paths run for real: the Slurm script under a fake ``srun`` and
``scontrol``, and ``torchrun --max-restarts``, each preempted by a signal part-way and
ending bit-identical to an uninterrupted run."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

import resumable

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "orchestrators"
TRAIN_PY = EXAMPLES / "train.py"
SBATCH = EXAMPLES / "slurm" / "train.sbatch"
JOB_YAML = EXAMPLES / "kubernetes" / "job.yaml"
RUN_SH = EXAMPLES / "torchrun" / "run.sh"

REQUEUE_EXIT_CODE = resumable.REQUEUE_EXIT_CODE
STEPS = 60
HOLD_AT = 30  # not a multiple of the example's persist_every=20: only an emergency save has it
JOB_ID = "4242"


# JobSpec fields of batch/v1 (Kubernetes 1.34); an unknown key is a typo the API server
# would drop or reject.
JOB_SPEC_FIELDS = {
    "activeDeadlineSeconds",
    "backoffLimit",
    "backoffLimitPerIndex",
    "completionMode",
    "completions",
    "managedBy",
    "manualSelector",
    "maxFailedIndexes",
    "parallelism",
    "podFailurePolicy",
    "podReplacementPolicy",
    "selector",
    "successPolicy",
    "suspend",
    "template",
    "ttlSecondsAfterFinished",
}
RULE_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}


def load_train_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("orchestrators_train", TRAIN_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- Kubernetes


def load_job_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(JOB_YAML.read_text()) if d is not None]


def policy_action(
    rules: list[dict[str, Any]], *, container: str, exit_code: int, conditions: set[str]
) -> str:
    """What the Job controller does with a failed pod: the first matching rule's action,
    ``Count`` when none matches (the podFailurePolicy semantics)."""
    for rule in rules:
        on_exit = rule.get("onExitCodes")
        if on_exit is not None:
            if on_exit.get("containerName") not in (None, container) or exit_code == 0:
                continue
            inside = exit_code in on_exit["values"]
            if inside == (on_exit["operator"] == "In"):
                return str(rule["action"])
        for pattern in rule.get("onPodConditions", []):
            if pattern["type"] in conditions and pattern.get("status", "True") == "True":
                return str(rule["action"])
    return "Count"


def job_problems(docs: list[dict[str, Any]], requeue_code: int = REQUEUE_EXIT_CODE) -> list[str]:
    """Everything wrong with the example's Job for the preemption contract ([] if none)."""
    problems: list[str] = []
    jobs = [d for d in docs if d.get("kind") == "Job"]
    if len(jobs) != 1 or jobs[0].get("apiVersion") != "batch/v1":
        kinds = [(d.get("apiVersion"), d.get("kind")) for d in docs]
        return [f"expected one batch/v1 Job, found {kinds}"]
    spec = jobs[0]["spec"]
    if set(spec) - JOB_SPEC_FIELDS:
        problems.append(f"unknown JobSpec fields {sorted(set(spec) - JOB_SPEC_FIELDS)}")
    backoff = spec.get("backoffLimit")
    if not (isinstance(backoff, int) and backoff >= 1):
        problems.append(f"backoffLimit must be set to a positive int, found {backoff!r}")
    if spec.get("podReplacementPolicy", "Failed") != "Failed":
        problems.append("podReplacementPolicy must be Failed (one pod at a time on the volume)")
    pod = spec["template"]["spec"]
    if pod.get("restartPolicy") != "Never":
        problems.append(f"restartPolicy must be Never, found {pod.get('restartPolicy')!r}")
    containers = {c["name"]: c for c in pod["containers"]}

    rules = spec.get("podFailurePolicy", {}).get("rules", [])
    for rule in rules:
        if rule.get("action") not in RULE_ACTIONS:
            problems.append(f"unknown podFailurePolicy action {rule.get('action')!r}")
        if ("onExitCodes" in rule) == ("onPodConditions" in rule):
            problems.append(f"a rule needs exactly one of onExitCodes/onPodConditions: {rule}")
        on_exit = rule.get("onExitCodes")
        if on_exit is not None:
            values = on_exit.get("values", [])
            if on_exit.get("operator") not in ("In", "NotIn"):
                problems.append(f"onExitCodes operator {on_exit.get('operator')!r}")
            if values != sorted(set(values)) or not values:
                problems.append(f"onExitCodes values must be sorted and unique: {values}")
            if on_exit.get("operator") == "In" and 0 in values:
                problems.append("exit code 0 cannot be used with operator In")
            if on_exit.get("containerName") not in (None, *containers):
                problems.append(f"rule names container {on_exit.get('containerName')!r}")
    train = containers.get("train")
    if train is None:
        return [*problems, f"no container named 'train' (found {sorted(containers)})"]
    if (
        policy_action(rules, container="train", exit_code=requeue_code, conditions=set())
        != "Ignore"
    ):
        problems.append(f"exit code {requeue_code} of 'train' is not ignored by podFailurePolicy")
    disrupted = policy_action(
        rules, container="train", exit_code=137, conditions={"DisruptionTarget"}
    )
    if disrupted != "Ignore":
        problems.append("a DisruptionTarget pod condition is not ignored by podFailurePolicy")
    if policy_action(rules, container="train", exit_code=1, conditions=set()) != "Count":
        problems.append("a crash (exit code 1) must count against backoffLimit")

    command = [*train.get("command", []), *train.get("args", [])]
    if not command or Path(command[0]).name in ("sh", "bash") or "-c" in command[:2]:
        problems.append(f"the container must exec python directly (PID 1), found {command}")
    env = {e["name"]: e.get("value") for e in train.get("env", [])}
    grace = float(env.get("PREEMPT_GRACE_SECONDS") or 30)
    if "--grace-seconds" in command:
        grace = float(command[command.index("--grace-seconds") + 1])
    period = pod.get("terminationGracePeriodSeconds", 30)
    if not period > grace:
        problems.append(f"terminationGracePeriodSeconds {period} must exceed the grace {grace}")

    ckpt_dir = env.get("CKPT_DIR")
    claims = {d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in train.get("volumeMounts", [])}
    if not ckpt_dir:
        problems.append("CKPT_DIR is not set in the container's env")
    else:
        under = [p for p in mounts if ckpt_dir == p or ckpt_dir.startswith(p.rstrip("/") + "/")]
        if not under:
            problems.append(f"CKPT_DIR {ckpt_dir} is on no volumeMount ({sorted(mounts)})")
        else:
            volume = volumes.get(mounts[max(under, key=len)], {})
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim is None or claim not in claims:
                problems.append(f"CKPT_DIR's volume {volume} is not the PVC in this file {claims}")
    shm = volumes.get(mounts.get("/dev/shm", ""), {})
    if shm.get("emptyDir", {}).get("medium") != "Memory":
        problems.append("/dev/shm must be an emptyDir with medium Memory (64 MiB by default)")
    return problems


def test_job_yaml_satisfies_the_exit_code_contract() -> None:
    docs = load_job_docs()
    assert job_problems(docs) == []
    job = next(d for d in docs if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    train = pod["containers"][0]
    # The container runs the example script of this repository.
    assert train["command"][1].endswith("examples/orchestrators/train.py")
    assert train["name"] == "train" and pod["restartPolicy"] == "Never"
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["onExitCodes"] == {
        "containerName": "train",
        "operator": "In",
        "values": [REQUEUE_EXIT_CODE],
    }
    assert rule["action"] == "Ignore"


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


_DELETE = object()
POD = "spec.template.spec"
TRAIN = f"{POD}.containers.0"


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (f"{POD}.restartPolicy", "OnFailure", "restartPolicy must be Never"),
        ("spec.podFailurePolicy.rules.0.onExitCodes.values", [1], "is not ignored"),
        ("spec.podFailurePolicy.rules.0.onExitCodes.containerName", "trainer", "names container"),
        ("spec.podFailurePolicy.rules.0.action", "Count", "is not ignored"),
        (
            "spec.podFailurePolicy.rules.1",
            {
                "action": "Ignore",
                "onExitCodes": {"operator": "NotIn", "values": [REQUEUE_EXIT_CODE]},
            },
            "must count",
        ),
        ("spec.podFailurePolicy.rules.1.onPodConditions.0.type", "Ready", "DisruptionTarget"),
        (f"{POD}.terminationGracePeriodSeconds", 90, "must exceed the grace"),
        (f"{TRAIN}.env.1.value", "200", "must exceed the grace"),
        (f"{TRAIN}.env.0.value", "/data/ckpt", "is on no volumeMount"),
        (f"{TRAIN}.volumeMounts.0.mountPath", "/mnt", "is on no volumeMount"),
        (f"{TRAIN}.command", ["sh", "-c", "python train.py"], "exec python directly"),
        ("spec.podReplacementPolicy", "TerminatingOrFailed", "podReplacementPolicy"),
        ("spec.backoffLimit", _DELETE, "backoffLimit"),
        ("spec.backofLimit", 3, "unknown JobSpec fields"),
        (f"{POD}.volumes.1.emptyDir", {}, "/dev/shm"),
    ],
)
def test_job_checks_reject_broken_manifests(path: str, value: Any, expected: str) -> None:
    docs = copy.deepcopy(load_job_docs())
    job = next(d for d in docs if d["kind"] == "Job")
    _set(job, path, value)
    problems = job_problems(docs)
    assert any(expected in p for p in problems), problems


def test_job_checks_follow_the_library_exit_code() -> None:
    assert job_problems(load_job_docs(), requeue_code=REQUEUE_EXIT_CODE + 1) != []


# --------------------------------------------------------------------------- Slurm header


def sbatch_directives(text: str) -> list[str]:
    """``#SBATCH`` options as sbatch reads them: up to the first non-comment line."""
    options: list[str] = []
    for line in text.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            options.append(stripped.split(None, 1)[1].split(" #")[0].strip())
    return options


def test_sbatch_header_signals_the_steps_and_requeues() -> None:
    text = SBATCH.read_text()
    options = sbatch_directives(text)
    assert text.startswith("#!/bin/bash\n")
    # Every directive is in the header: one after the first command would be ignored.
    assert len(options) == text.count("\n#SBATCH")
    assert "--requeue" in options and "--no-requeue" not in options
    assert "--open-mode=append" in options
    assert any(o.startswith("--time=") for o in options)
    signals = [o.split("=", 1)[1] for o in options if o.startswith("--signal=")]
    assert len(signals) == 1
    match = re.fullmatch(r"(?:([RB]+):)?(?:SIG)?(\w+)(?:@(\d+))?", signals[0])
    assert match is not None, signals[0]
    flags, name, seconds = match.groups()
    # No "B:": the signal must reach the training processes of the job step, not only the
    # batch shell (which would have to forward it).
    assert "B" not in (flags or "")
    assert f"SIG{name}" in load_train_module().PREEMPTION_SIGNALS
    assert seconds is not None and int(seconds) > 0


# --------------------------------------------------------------------------- shell scripts


@pytest.mark.parametrize("script", [SBATCH, RUN_SH], ids=["sbatch", "torchrun"])
def test_shell_scripts_parse(script: Path) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    out = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"


def test_bash_syntax_check_catches_a_broken_script(tmp_path: Path) -> None:
    broken = tmp_path / "broken.sh"
    broken.write_text(SBATCH.read_text().replace("\nfi\n", "\n", 1))
    out = subprocess.run(["bash", "-n", str(broken)], capture_output=True, text=True)
    assert out.returncode != 0


# --------------------------------------------------------------------------- Slurm, faked


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def slurm_bin(tmp_path: Path) -> Path:
    """A directory with a fake ``srun`` (runs its command, as a one-task step does) and a
    fake ``scontrol`` (logs its arguments to $SCONTROL_LOG, exits $SCONTROL_RC)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(
        bin_dir / "srun",
        '#!/bin/bash\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',
    )
    write_exe(
        bin_dir / "scontrol",
        '#!/bin/bash\necho "$*" >> "$SCONTROL_LOG"\nexit "${SCONTROL_RC:-0}"\n',
    )
    return bin_dir


def slurm_env(tmp_path: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "EXAMPLE_", "CKPT_", "PREEMPT_"))
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NAME="resumable-test",
        SLURM_SUBMIT_DIR=str(ROOT),
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        CKPT_DIR=str(tmp_path / "ckpt"),
        PYTHON=sys.executable,
    )
    env.update(extra)
    return env


def scontrol_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def fake_step(tmp_path: Path, body: str) -> Path:
    """A stand-in for the training step: records its argv and environment, then ``body``."""
    return write_exe(
        tmp_path / "fake_python",
        f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/argv\nenv > {tmp_path}/env\n' + body,
    )


@pytest.mark.parametrize(
    ("step_rc", "extra", "scontrol_rc", "script_rc", "requeued"),
    [
        (REQUEUE_EXIT_CODE, {}, 0, 0, True),
        (REQUEUE_EXIT_CODE, {"SLURM_RESTART_COUNT": "3"}, 0, 0, True),
        (REQUEUE_EXIT_CODE, {"SLURM_RESTART_COUNT": "5", "MAX_RESTARTS": "5"}, 0, None, False),
        (REQUEUE_EXIT_CODE, {}, 1, REQUEUE_EXIT_CODE, True),  # requeue refused
        (0, {}, 0, 0, False),
        (1, {}, 0, 1, False),
        (REQUEUE_EXIT_CODE + 1, {}, 0, REQUEUE_EXIT_CODE + 1, False),
    ],
)
def test_sbatch_requeues_only_on_the_requeue_exit_code(
    tmp_path: Path,
    slurm_bin: Path,
    step_rc: int,
    extra: dict[str, str],
    scontrol_rc: int,
    script_rc: int | None,
    requeued: bool,
) -> None:
    fake = fake_step(tmp_path, f"exit {step_rc}\n")
    env = slurm_env(tmp_path, slurm_bin, PYTHON=str(fake), SCONTROL_RC=str(scontrol_rc), **extra)
    out = subprocess.run(
        ["bash", str(SBATCH), "--steps", "7"], env=env, capture_output=True, text=True, timeout=30
    )
    expected_rc = step_rc if script_rc is None else script_rc
    assert out.returncode == expected_rc, out.stdout + out.stderr
    assert scontrol_calls(tmp_path) == ([f"requeue {JOB_ID}"] if requeued else [])
    # The step ran the example with the checkpoint directory and the script's arguments.
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv == ["examples/orchestrators/train.py", "--dir", env["CKPT_DIR"], "--steps", "7"]


def test_sbatch_grace_fits_in_the_signal_lead_time(tmp_path: Path, slurm_bin: Path) -> None:
    fake = fake_step(tmp_path, "exit 0\n")
    out = subprocess.run(
        ["bash", str(SBATCH)], env=slurm_env(tmp_path, slurm_bin, PYTHON=str(fake)), timeout=30
    )
    assert out.returncode == 0
    step_env = dict(
        line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line
    )
    signal_option = next(
        o for o in sbatch_directives(SBATCH.read_text()) if o.startswith("--signal=")
    )
    lead_s = int(signal_option.rsplit("@", 1)[1])
    assert 0 < float(step_env["PREEMPT_GRACE_SECONDS"]) < lead_s
    assert step_env["CKPT_DIR"] == str(tmp_path / "ckpt")


def test_sbatch_survives_sigterm_while_the_step_saves(tmp_path: Path, slurm_bin: Path) -> None:
    """Preemption signals the batch shell too: it must wait for the step's exit status and
    requeue, not die and leave the step's checkpoint unaccounted for."""
    fake = fake_step(
        tmp_path,
        f"trap 'echo step-saved; exit {REQUEUE_EXIT_CODE}' TERM\n"
        'echo "step-pid $$"\n'
        "while :; do sleep 0.05; done\n",
    )
    proc = subprocess.Popen(
        ["bash", str(SBATCH)],
        env=slurm_env(tmp_path, slurm_bin, PYTHON=str(fake)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step-pid "):
            proc.send_signal(signal.SIGTERM)  # the batch shell
            os.kill(int(line.split()[1]), signal.SIGTERM)  # the step
    rc = proc.wait(timeout=30)
    text = "".join(lines)
    assert rc == 0, text
    assert "step-saved" in text and f"training step exited with {REQUEUE_EXIT_CODE}" in text
    assert scontrol_calls(tmp_path) == [f"requeue {JOB_ID}"]


# --------------------------------------------------------------------------- real runs


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "EXAMPLE_", "CKPT_", "PREEMPT_"))
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def reference_line(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], str]]:
    """The final line of an uninterrupted run, started in the background right away."""
    directory = tmp_path_factory.mktemp("reference")
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN_PY), "--dir", str(directory / "ckpt"), "--steps", str(STEPS)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    result: dict[str, str] = {}

    def get() -> str:
        if "line" not in result:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
            assert "resumed" not in out
            result["line"] = out.strip().splitlines()[-1]
        return result["line"]

    yield get
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (the processes of a Slurm job step)."""
    found = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            found.extend(descendants(int(child)))
    return found


def run_until_held(
    cmd: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[str], list[str], int]:
    """Start ``cmd`` and read its output up to the example's "holding at step" line."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        held = re.match(r"holding at step (\d+) \(pid (\d+)\)", line)
        if held:
            assert int(held.group(1)) == HOLD_AT
            return proc, lines, int(held.group(2))
    proc.wait()
    raise AssertionError("the run never reached the hold step:\n" + "".join(lines))


def finish(proc: subprocess.Popen[str], lines: list[str]) -> str:
    assert proc.stdout is not None
    lines.extend(proc.stdout)
    proc.wait(timeout=240)
    return "".join(lines)


def audit(directory: Path) -> list[dict[str, Any]]:
    text = (directory / "audit.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def worker_pids() -> set[int]:
    """Live persist-worker processes started by this test process."""
    pids = set()
    for pid in descendants(os.getpid())[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"resumable.pipeline._worker" in cmdline and state != "Z":
            pids.add(pid)
    return pids


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_persist_worker_outlives_step_wide_signals(tmp_path: Path) -> None:
    """Slurm signals every process of the step, torchrun and Ctrl-C a process group: the
    persist worker must leave them to the trainer and go on persisting."""
    state = {"w": torch.zeros(8)}
    with resumable.Checkpointer(tmp_path / "ckpt", state, persist="process") as ckpt:
        ckpt.save(1)
        ckpt.wait()
        before = worker_pids()
        assert len(before) == 1
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(next(iter(before)), sig)
        ckpt.save(2)
        ckpt.wait()
        assert worker_pids() == before
    assert ckpt.steps()[-1] == 2


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_slurm_signal_requeue_resume_is_bit_identical(
    tmp_path: Path, slurm_bin: Path, reference_line: Callable[[], str]
) -> None:
    env = slurm_env(tmp_path, slurm_bin, EXAMPLE_HOLD_AT_STEPS=str(HOLD_AT))
    cmd = ["bash", str(SBATCH), "--steps", str(STEPS)]

    # Launch 1: --signal=USR1@90 fires; slurmstepd signals every process of the step.
    proc, lines, pid = run_until_held(cmd, env)
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    first = finish(proc, lines)
    assert proc.returncode == 0, first
    assert f"training step exited with {REQUEUE_EXIT_CODE}" in first
    assert scontrol_calls(tmp_path) == [f"requeue {JOB_ID}"]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / f"step-{HOLD_AT:012d}").is_dir()
    events = audit(ckpt)
    assert [e["step"] for e in events if e["event"] == "preempt"] == [HOLD_AT]
    assert not [e for e in events if e["event"] == "failure"], events

    # Launch 2: Slurm starts the same script again, same job id, one restart later.
    env["SLURM_RESTART_COUNT"] = "1"
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"slurm job {JOB_ID} restart 1" in second.stdout
    assert f"resumed from step {HOLD_AT}\n" in second.stdout
    assert "training step exited with 0" in second.stdout
    assert scontrol_calls(tmp_path) == [f"requeue {JOB_ID}"]  # no second requeue
    final = [x for x in second.stdout.splitlines() if x.startswith("final ")]
    assert final == [reference_line()]


def test_torchrun_restarts_a_preempted_worker_and_resumes(
    tmp_path: Path, reference_line: Callable[[], str]
) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = clean_env(
        TORCHRUN=str(torchrun),
        CKPT_DIR=str(tmp_path / "ckpt"),
        EXAMPLE_HOLD_AT_STEPS=str(HOLD_AT),
    )
    proc, lines, pid = run_until_held(["bash", str(RUN_SH), "--steps", str(STEPS)], env)
    os.kill(pid, signal.SIGUSR1)  # the worker, as a scheduler or a spot notice would
    text = finish(proc, lines)
    assert proc.returncode == 0, text
    assert "torchrun restart 0" in text and "torchrun restart 1" in text
    assert f"resumed from step {HOLD_AT}\n" in text
    final = [x for x in text.splitlines() if x.startswith("final ")]
    assert final == [reference_line()]
