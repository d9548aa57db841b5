"""Memory-snapshot replicas on simulated nodes: what ``replicas=2`` costs a training loop,
and what it saves when a node is replaced.

    python benchmarks/replicas_bench.py                     # 6 MiB MLP + Adam, 3 repeats
    python benchmarks/replicas_bench.py --param-mib 1 --repeats 1 --steps 10 --no-s3

Two simulated nodes of two ranks each: one ``torchrun --nnodes=2 --node-rank=K`` launcher
per node on 127.0.0.1, each node with its own memory directory (under ``/dev/shm`` when it
has room), DDP on gloo, an MLP of ``--param-mib`` MiB of parameters trained with Adam
(`replicas_worker.py`). Every figure comes from the run:

1. **Throughput.** The same job (``--warmup`` steps, then ``--steps`` timed steps, a
   memory snapshot every step, no persist) at ``replicas=1`` and ``replicas=2``. A step's
   time is the slowest rank's wall time of forward, backward, optimizer step and
   ``maybe_save``; the figure is the median over the timed steps. Bytes sent per step are
   the replication's own counter (``ck._memory.replication.stats["bytes_sent"]``) over
   the timed steps, summed over the ranks, divided by the timed steps.
2. **Recovery.** The job trains to step ``--stop`` with a persist every
   ``--persist-every`` steps (so the newest commit is well before it), waits until that
   commit is durable and the newest snapshot is on the peers, then every launcher is
   SIGKILLed with its ranks, node 1's memory directory is deleted (a replaced machine)
   and the job is relaunched; each rank times ``ck.restore()``. (a) ``replicas=2``: node
   1's ranks fetch their snapshots from node 0; (b) ``replicas=1``: the ranks fall back
   to the root on the local disk (one directory both nodes share; its files are in the
   page cache, so this is a warm read); (c) ``replicas=1`` with the root on ``s3://``
   (a SeaweedFS server on loopback, started as the tests start it).

Runs alternate (replicas=1 and 2, then each recovery kind, once per repeat); figures are
medians over ``--repeats``. Writes ``benchmarks/results/replicas-<UTC timestamp>.json``
(every raw sample) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "replicas_worker.py"
RESULTS = HERE / "results"
MiB = 2**20

sys.path.insert(0, str(REPO))  # the simulated nodes' launcher kill, shared with stress/
from stress.nodes import free_port, kill_node  # noqa: E402

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(f"[replicas {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Settings:
    nodes: int = 2
    per_node: int = 2
    param_mib: float = 6.0
    warmup: int = 5
    steps: int = 40
    stop: int = 30
    persist_every: int = 20
    repeats: int = 3
    s3: bool = True
    timeout_s: float = 300.0
    src: str = str(REPO / "src")


# ---------------------------------------------------------------------------- processes


def launch(
    s: Settings,
    mode: str,
    root: str,
    shm: list[Path],
    out: Path,
    extra: list[str],
    env: dict[str, str | None],
) -> list[subprocess.Popen[str]]:
    """One ``torchrun`` launcher per simulated node, each in a session of its own; a
    variable ``None`` in ``env`` is unset."""
    port = free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": s.src}
    for name, value in env.items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={s.nodes}",
                f"--node-rank={k}",
                f"--nproc-per-node={s.per_node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                str(WORKER),
                mode,
                root,
                str(shm[k]),
                str(out),
                f"--param-mib={s.param_mib}",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,
        )
        for k in range(s.nodes)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> str:
    """Wait for every node to exit 0; RuntimeError with the output's tail otherwise."""
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out = kill_node(p) + f"\n(killed after {timeout:.0f} s)"
            outputs.append(out or "")
    finally:
        for p in procs:
            if p.poll() is None:
                kill_node(p)
    text = "\n".join(outputs)
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a node failed (exit {[p.returncode for p in procs]}):\n{text[-4000:]}")
    return text


def read_all(out: Path, prefix: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{prefix}-r{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------- runs


class Workspace:
    """Fresh directories for one run: the out directory, one memory directory per node
    (under ``/dev/shm`` when it has room, else the work directory) and a local root."""

    def __init__(self, base: Path, shm_base: Path, name: str, nodes: int) -> None:
        self.out = base / name / "out"
        self.out.mkdir(parents=True)
        self.root = base / name / "ck"
        self.shm = [shm_base / name / f"node{k}" for k in range(nodes)]
        for d in self.shm:
            d.mkdir(parents=True)

    def replace_node(self, k: int) -> None:
        shutil.rmtree(self.shm[k])
        self.shm[k].mkdir()


def throughput_run(
    s: Settings, ws: Workspace, replicas: int, env: dict[str, str | None]
) -> dict[str, Any]:
    """The timed training loop at ``replicas``; the job's step times (slowest rank per
    step) and the replication's counters over the timed steps."""
    world = s.nodes * s.per_node
    extra = [f"--replicas={replicas}", f"--warmup={s.warmup}", f"--steps={s.steps}"]
    t0 = time.monotonic()
    finish(launch(s, "throughput", str(ws.root), ws.shm, ws.out, extra, env), s.timeout_s)
    wall = time.monotonic() - t0
    ranks = read_all(ws.out, "throughput", world)
    job_steps = [max(r["step_s"][i] for r in ranks) for i in range(s.steps)]
    sent = sum(int(r["replication"]["bytes_sent"]) for r in ranks)
    return {
        "median_step_ms": statistics.median(job_steps) * 1e3,
        "job_step_s": job_steps,
        "bytes_sent_per_step": sent / s.steps,
        "bytes_sent": sent,
        # a peer's copy of bytes it already holds is not sent (where the library counts it)
        "bytes_held_per_step": (
            sum(int(r["replication"]["bytes_held"]) for r in ranks) / s.steps
            if all("bytes_held" in r["replication"] for r in ranks)
            else None
        ),
        "pushes": sum(int(r["replication"]["pushes"]) for r in ranks),
        "push_s": sum(float(r["replication"]["push_s"]) for r in ranks),
        "failures": sum(int(r["replication"]["failures"]) for r in ranks),
        "snapshots": [r["snapshots"] for r in ranks],
        "state_bytes_per_rank": ranks[0]["state_bytes"],
        "ranks": ranks,
        "wall_s": wall,
    }


def recovery_run(
    s: Settings, ws: Workspace, replicas: int, root: str, env: dict[str, str | None]
) -> dict[str, Any]:
    """Train to ``stop``, SIGKILL every node, replace node 1's memory, relaunch and time
    every rank's ``restore()``."""
    world = s.nodes * s.per_node
    extra = [f"--replicas={replicas}", f"--stop={s.stop}", f"--persist-every={s.persist_every}"]
    procs = launch(s, "train", root, ws.shm, ws.out, extra, env)
    try:
        deadline = time.monotonic() + s.timeout_s
        while time.monotonic() < deadline:
            if all((ws.out / f"stop-r{r}.json").exists() for r in range(world)):
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        ended = [p for p in procs if p.poll() is not None]
    finally:
        outputs = [kill_node(p) for p in procs]
    if ended or not all((ws.out / f"stop-r{r}.json").exists() for r in range(world)):
        raise RuntimeError(
            f"the job did not reach step {s.stop} in time or a node ended early:\n"
            + "\n".join(outputs)[-4000:]
        )
    stopped = read_all(ws.out, "stop", world)
    ws.replace_node(1)
    t0 = time.monotonic()
    output = finish(
        launch(s, "restore", root, ws.shm, ws.out, [f"--replicas={replicas}"], env), s.timeout_s
    )
    relaunch = time.monotonic() - t0
    ranks = read_all(ws.out, "restore", world)
    restored = [int(r["step"]) for r in ranks]
    replaced = range(s.per_node, 2 * s.per_node)  # node 1's ranks
    restore_line = next((ln for ln in output.splitlines() if "restored step" in ln), "")
    return {
        "root": root,
        "stop": s.stop,
        "last_commit": max(int(r.get("last_commit") or 0) for r in stopped),
        "restored": restored,
        "steps_lost": s.stop - min(restored),
        "restore_s": [float(r["restore_s"]) for r in ranks],
        "restore_s_max": max(float(r["restore_s"]) for r in ranks),
        "restore_s_replaced": max(float(ranks[r]["restore_s"]) for r in replaced),
        "fetches": [int(r["fetches"]) for r in ranks],
        "replication_at_stop": [r["replication"] for r in stopped],
        "relaunch_s": relaunch,
        "restore_line": restore_line.strip()[-300:],
    }


# ---------------------------------------------------------------------------- S3


@contextlib.contextmanager
def seaweedfs(workdir: Path, log: Log) -> Iterator[tuple[Any, dict[str, str | None]]]:
    """SeaweedFS on loopback as the tests start it (``tests/s3server.py``); yields the
    server and the AWS environment the launchers get."""
    sys.path.insert(0, str(REPO / "tests"))
    from s3server import run_seaweedfs

    t0 = time.monotonic()
    with run_seaweedfs(workdir, volume_size_mb=256) as server:
        log(f"SeaweedFS up at {server.endpoint} in {time.monotonic() - t0:.1f} s")
        missing = workdir / "aws-config-missing"
        env: dict[str, str | None] = {
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_DEFAULT_REGION": server.region,
            "AWS_REGION": server.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(missing / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(missing / "credentials"),
            "AWS_PROFILE": None,
            "AWS_DEFAULT_PROFILE": None,
            "AWS_SESSION_TOKEN": None,
            "AWS_ENDPOINT_URL_S3": None,
        }
        yield server, env


# ---------------------------------------------------------------------------- phase


def why(exc: Exception) -> str:
    """One line for a table: the error's first line and the last line naming an error
    in the output it quotes."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    errors = [ln for ln in lines[1:] if "Error" in ln or "Exception" in ln or "Unavailable" in ln]
    text = first + (f": {errors[-1]}" if errors else "")
    return text.replace("|", "/")[:300]


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def shm_base(work: Path) -> tuple[Path, bool]:
    """A directory for the nodes' memory: under /dev/shm when it has 2 GiB free."""
    dev = Path("/dev/shm")
    if dev.is_dir() and shutil.disk_usage(dev).free > 2 * 2**30:
        return Path(tempfile.mkdtemp(prefix="resumable-replicas-bench-", dir=dev)), True
    return work / "shm", False


def nvrx_python() -> str | None:
    """The interpreter of NVRx's environment (``make bench-nvrx-env``), if there is one:
    ``NVRX_PYTHON``, else ``.venv-nvrx/bin/python`` of this checkout."""
    found = os.environ.get("NVRX_PYTHON") or str(REPO / ".venv-nvrx" / "bin" / "python")
    return found if os.access(found, os.X_OK) else None


def nvrx_run(s: Settings, work: Path, log: Log) -> dict[str, Any]:
    """The peer: NVRx's local checkpoints with peer replication on the same state
    (`benchmarks/peer_nvrx.py`, in its own environment); its JSON, or why not."""
    python = nvrx_python()
    if python is None:
        return {"not_measured": "not measured: no NVRx environment (make bench-nvrx-env)"}
    out = work / "nvrx.json"
    log("peer: nvidia-resiliency-ext local checkpoints, replication factor 2")
    cmd = [
        python,
        str(HERE / "peer_nvrx.py"),
        f"--param-mib={s.param_mib:g}",
        f"--repeats={s.repeats}",
        f"--out={out}",
    ]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=s.timeout_s * 2, check=False
        )
        if done.returncode != 0 or not out.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            return {"not_measured": f"not measured: peer_nvrx.py failed ({tail[0][:200]})"}
        return dict(json.loads(out.read_text()))
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {"not_measured": f"not measured: peer_nvrx.py failed ({why(exc)})"}


def run_phase(work: Path, s: Settings, log: Log = _print) -> dict[str, Any]:
    """Every run of the benchmark; returns the results (raw samples and medians)."""
    work.mkdir(parents=True, exist_ok=True)
    memory, on_dev_shm = shm_base(work)
    t_start = time.monotonic()
    kinds = ["peers", "disk"] + (["s3"] if s.s3 else [])
    tp: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    rec: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    not_measured: dict[str, str] = {}
    if not s.s3:
        not_measured["s3"] = "not measured: --no-s3"
    with contextlib.ExitStack() as stack:
        s3_env: dict[str, str | None] = {}
        server = None
        if s.s3:
            try:
                server, s3_env = stack.enter_context(seaweedfs(work / "seaweedfs", log))
            except Exception as exc:  # binary missing, server not up: said, not fatal
                not_measured["s3"] = f"not measured: SeaweedFS did not start ({why(exc)})"
                kinds.remove("s3")
                del rec["s3"]
        try:
            for rep in range(s.repeats):
                for replicas in (1, 2):
                    log(f"repeat {rep + 1}/{s.repeats}: throughput, replicas={replicas}")
                    ws = Workspace(work, memory, f"tp{replicas}-{rep}", s.nodes)
                    got = throughput_run(s, ws, replicas, {})
                    log(
                        f"  median step {got['median_step_ms']:.1f} ms, "
                        f"{got['bytes_sent_per_step'] / MiB:.2f} MiB sent per step"
                    )
                    tp[replicas].append(got)
                for kind in list(kinds):
                    log(f"repeat {rep + 1}/{s.repeats}: recovery from {kind}")
                    ws = Workspace(work, memory, f"rec-{kind}-{rep}", s.nodes)
                    if kind == "s3":
                        assert server is not None
                        try:
                            root = f"s3://{server.new_bucket('replicas')}/ck"
                            got = recovery_run(s, ws, 1, root, s3_env)
                        except Exception as exc:  # the S3 side failing is said, not fatal
                            log(f"  s3 failed: {exc}")
                            not_measured["s3"] = f"not measured: the s3:// run failed ({why(exc)})"
                            kinds.remove("s3")
                            del rec["s3"]
                            continue
                    else:
                        got = recovery_run(s, ws, 2 if kind == "peers" else 1, str(ws.root), {})
                    log(
                        f"  restored {got['restored']} (stopped at {s.stop}), restore "
                        f"{got['restore_s_max']:.3f} s slowest rank"
                    )
                    rec[kind].append(got)
        finally:
            if on_dev_shm:
                shutil.rmtree(memory, ignore_errors=True)
    nvrx = nvrx_run(s, work, log)
    if "not_measured" in nvrx:
        not_measured["nvrx"] = nvrx["not_measured"]

    summary: dict[str, Any] = {"throughput": {}, "recovery": {}}
    for replicas, runs in tp.items():
        summary["throughput"][f"replicas={replicas}"] = {
            "median_step_ms": median([r["median_step_ms"] for r in runs]),
            "bytes_sent_per_step": median([r["bytes_sent_per_step"] for r in runs]),
            "bytes_held_per_step": median(
                [r["bytes_held_per_step"] for r in runs if r["bytes_held_per_step"] is not None]
            ),
        }
    t1 = summary["throughput"]["replicas=1"]["median_step_ms"]
    t2 = summary["throughput"]["replicas=2"]["median_step_ms"]
    summary["throughput"]["ratio"] = t2 / t1 if t1 and t2 else None
    for kind, runs in rec.items():
        summary["recovery"][kind] = {
            "restore_s_max": median([r["restore_s_max"] for r in runs]),
            "restore_s_replaced": median([r["restore_s_replaced"] for r in runs]),
            "restored": median([min(r["restored"]) for r in runs]),
            "steps_lost": median([r["steps_lost"] for r in runs]),
            "last_commit": median([r["last_commit"] for r in runs]),
            "relaunch_s": median([r["relaunch_s"] for r in runs]),
        }
    peers = summary["recovery"].get("peers", {}).get("restore_s_max")
    for kind in summary["recovery"]:
        mine = summary["recovery"][kind]["restore_s_max"]
        summary["recovery"][kind]["vs_peers"] = mine / peers if peers and mine else None
    if "median_s" in nvrx:
        load = nvrx["median_s"]["load_apply"]
        summary["nvrx"] = {
            "save_s": nvrx["median_s"]["save"],
            "load_s": load,
            "vs_peers": load / peers if peers and load else None,
            "version": nvrx.get("nvidia_resiliency_ext"),
            "ranks": nvrx.get("ranks"),
        }
    summary["not_measured"] = not_measured
    return {
        "nvrx_run": nvrx,
        "settings": asdict(s),
        "memory_dir": "/dev/shm" if on_dev_shm else "disk (no room in /dev/shm)",
        "summary": summary,
        "throughput_runs": {f"replicas={k}": v for k, v in tp.items()},
        "recovery_runs": rec,
        "wall_s": time.monotonic() - t_start,
    }


# ---------------------------------------------------------------------------- report


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(results: dict[str, Any]) -> str:
    s = results["settings"]
    summ = results["summary"]
    tp = summ["throughput"]
    state_mib = results["throughput_runs"]["replicas=1"][0]["state_bytes_per_rank"] / MiB
    lines = [
        f"{s['nodes']} simulated nodes x {s['per_node']} ranks (DDP, gloo), MLP of "
        f"{s['param_mib']:g} MiB of parameters + Adam: {state_mib:.1f} MiB of state per rank; "
        f"medians of {s['repeats']} repeat(s).",
        "",
        f"Throughput, a memory snapshot every step ({s['steps']} timed steps after "
        f"{s['warmup']} warm-up):",
        "",
        "| | replicas=1 | replicas=2 | ratio |",
        "|---|---|---|---|",
        f"| median step time (ms) | {_f(tp['replicas=1']['median_step_ms'], '.1f')} | "
        f"{_f(tp['replicas=2']['median_step_ms'], '.1f')} | {_f(tp['ratio'], '.2f')} |",
        f"| bytes sent by replication per step, whole job (MiB) | "
        f"{_f(tp['replicas=1']['bytes_sent_per_step'] / MiB, '.2f')} | "
        f"{_f(tp['replicas=2']['bytes_sent_per_step'] / MiB, '.2f')} | |",
    ]
    held = tp["replicas=2"]["bytes_held_per_step"]
    if held is not None:
        lines.append(
            "| bytes not sent, the peer held them, per step, whole job (MiB) | | "
            f"{held / MiB:.2f} | |"
        )
    lines += [
        "",
        f"Recovery after node 1 is replaced at step {s['stop']} (persist every "
        f"{s['persist_every']} steps):",
        "",
        "| restore from | restore() s, slowest rank | replaced node's ranks s | "
        "step restored | steps lost | x peers |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "peers": "peers' replicas (replicas=2)",
        "disk": "local disk, warm (replicas=1)",
        "s3": "s3:// SeaweedFS (replicas=1)",
    }
    for kind, r in summ["recovery"].items():
        lines.append(
            f"| {names[kind]} | {_f(r['restore_s_max'], '.3f')} | "
            f"{_f(r['restore_s_replaced'], '.3f')} | {_f(r['restored'], 'g')} | "
            f"{_f(r['steps_lost'], 'g')} | {_f(r['vs_peers'], '.2f')} |"
        )
    for kind, reason in summ["not_measured"].items():
        if kind in names:
            lines.append(f"| {names[kind]} | {reason} | | | | |")
    nv = summ.get("nvrx")
    title = "Peer: NVIDIA Resiliency Extension's local checkpoints, replication factor 2:"
    lines += ["", title, ""]
    if nv is None:
        lines.append(summ["not_measured"].get("nvrx", "not measured"))
    else:
        lines += [
            "| | NVRx " + str(nv["version"]) + f" ({nv['ranks']} ranks, one node) | "
            "resumable replicas=2 |",
            "|---|---|---|",
            f"| save, blocking (s) | {_f(nv['save_s'], '.3f')} | a snapshot per step "
            "(step times above) |",
            f"| load after a rank lost its own copy (s) | {_f(nv['load_s'], '.3f')} | "
            f"{_f(summ['recovery'].get('peers', {}).get('restore_s_max'), '.3f')} "
            f"(x{_f(nv['vs_peers'], '.2f')} NVRx / ours) |",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    d = Settings()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-node", type=int, default=d.per_node, help="ranks per simulated node")
    ap.add_argument("--param-mib", type=float, default=d.param_mib)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--stop", type=int, default=d.stop)
    ap.add_argument("--persist-every", type=int, default=d.persist_every)
    ap.add_argument("--no-s3", action="store_true", help="skip recovery from s3://")
    ap.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per launch")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument(
        "--src", default=d.src, help="the `resumable` package's parent directory the ranks import"
    )
    ap.add_argument(
        "--render", type=Path, help="only write this results file's table into docs/replicas.md"
    )
    args = ap.parse_args(argv)
    if args.render is not None:
        done = json.loads(args.render.read_text())
        done["table"] = table(done)
        write_doc(DOC, done, args.render.resolve())
        print(done["table"])
        return done
    if args.stop % args.persist_every == 0:
        ap.error("--stop must not be a multiple of --persist-every (no steps would be lost)")
    s = Settings(
        per_node=args.per_node,
        param_mib=args.param_mib,
        warmup=args.warmup,
        steps=args.steps,
        stop=args.stop,
        persist_every=args.persist_every,
        repeats=args.repeats,
        s3=not args.no_s3,
        timeout_s=args.timeout_s,
        src=str(Path(args.src).resolve()),
    )
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    with tempfile.TemporaryDirectory(prefix="replicas-bench-") as tmp:
        results = run_phase(Path(tmp), s)
    import torch

    results.update(
        {
            "utc": stamp,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "commit": subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip(),
        }
    )
    results["table"] = table(results)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"replicas-{stamp}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(results["table"])
    print(f"\nresults: {path} ({results['wall_s']:.0f} s)")
    if args.results_dir.resolve() == RESULTS.resolve() and DOC.exists():
        write_doc(DOC, results, path)
    return results


DOC = REPO / "docs" / "replicas.md"
BEGIN, END = "<!-- replicas-bench:begin -->", "<!-- replicas-bench:end -->"


def write_doc(doc: Path, results: dict[str, Any], path: Path) -> None:
    """Put a run's table (and where it came from) between the markers of ``doc``."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        return
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    body = (
        f"Run of `benchmarks/replicas_bench.py` (`make bench`) at {results['utc']} on "
        f"{results['host']} ({results['cpus']} CPUs), commit {results['commit'][:7]}, "
        f"{results['wall_s']:.0f} s; raw samples in `{where}`.\n\n{results['table']}"
    )
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    main()
