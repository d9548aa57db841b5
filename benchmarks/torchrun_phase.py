"""What the framework phases (`ds_bench.py`, `mcore_bench.py`) share: one ``torchrun``
launch of a worker per configuration, the statistics of its samples, the floors of a
configuration, the loop over configurations, the Markdown of a block and where the block
goes in docs/performance.md. Like the phases, it imports neither torch nor a framework,
so that `report.py` can render the blocks anywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORLD = 2
RESTORE_FACTOR = 3
"""Restore rounds per save round (DeepSpeed and Megatron phases): a restore takes a tenth
of a second, and five samples of a ratio near 1.0 decided its goal by chance (ZeRO 3:
0.91x, 1.24x, 1.16x in three runs of the same code; Megatron TP1 x DP2: resumable's five
restores 0.15 to 0.86 s in one run of `make bench`)."""
HOW = "torchrun --nproc-per-node=2, gloo, OMP_NUM_THREADS=1; rank-max times"

Log = Callable[[str], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stat(samples: list[float], warmup: int = 1) -> dict[str, Any]:
    """Sample 0 apart as ``first``; median and min over the samples after the ``warmup``
    ones."""
    rest = samples[warmup:] or samples
    return {
        "samples": [round(s, 6) for s in rest],
        "median": round(statistics.median(rest), 6),
        "min": round(min(rest), 6),
        "first": round(samples[0], 6),
    }


def launch(
    worker: Path, args: list[str], workdir: Path, *, what: str, timeout_s: float
) -> dict[str, Any]:
    """One ``torchrun --nproc-per-node=WORLD`` launch of ``worker`` with ``args`` (and
    ``--dir``, ``--out`` in ``workdir``, emptied first); its JSON, raw. The launch's
    output goes to ``torchrun-<workdir's name>.log`` beside ``workdir``; a launch that
    leaves no result raises, ``what`` (the configuration) in the message."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    out = workdir / "result.json"
    log_path = workdir.parent / f"torchrun-{workdir.name}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={WORLD}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(worker),
        *args,
        f"--dir={workdir}",
        f"--out={out}",
    ]
    src = str(HERE.parent / "src")
    path = os.environ.get("PYTHONPATH")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=src + (os.pathsep + path if path else ""),
    )
    rc, tail = run_logged(cmd, env, log_path, timeout_s)
    # Judged by the result file: a rank can abort in gloo's shutdown after its work is done.
    if not out.exists():
        why = f"timed out after {timeout_s:g} s" if rc is None else f"exit code {rc}"
        raise RuntimeError(f"torchrun, {what}: {why}, no result; log tail:\n{tail}")
    return json.loads(out.read_text())


def run_logged(
    cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float
) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own, its output into ``log_path``; its exit code
    (None: killed with its whole process group after ``timeout_s``) and the log's tail."""
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, log_path.read_text(errors="replace")[-1500:]


def add_bytes(save: dict[str, Any], raw: dict[str, Any], files_of: Callable[[str], str]) -> None:
    """Each save entry's ``bytes`` and ``files``: those the worker counted for the method
    ``files_of(name)`` (a method and its fsynced variant write the same files)."""
    for name, entry in save.items():
        files = raw["bytes"][files_of(name)]
        entry["bytes"] = sum(files.values())
        entry["files"] = files


def floors(
    raw: dict[str, Any], save: dict[str, Any], restore: dict[str, Any], peer: str
) -> dict[str, Any]:
    """The write and warm read floors of one configuration (the worker's ``write_floor``
    samples, the ``read_floor`` restore samples, which this takes out of ``restore``), and
    each method's bytes at those bandwidths: ``peer``'s and resumable's reads."""
    write = stat([max(rank[0] for rank in rep) for rep in raw["saves"]["write_floor"]])
    read = restore.pop("read_floor")
    nbytes = raw["floor_bytes"]
    write_bps, read_bps = nbytes / write["median"], nbytes / read["median"]
    return {
        "bytes": nbytes,
        "write": write,
        "read_warm": read,
        "write_gbps": round(write_bps / 1e9, 3),
        "read_warm_gbps": round(read_bps / 1e9, 3),
        "write_s": {n: round(e["bytes"] / write_bps, 6) for n, e in save.items()},
        "read_warm_s": {
            peer: round(save[peer]["bytes"] / read_bps, 6),
            "resumable": round(save["resumable_sync"]["bytes"] / read_bps, 6),
        },
    }


def gc_in_calls(raw: dict[str, Any]) -> dict[str, dict[str, float]] | None:
    """The most time Python's garbage collector took inside one timed call of each
    method, over the rounds after the first (the slowest rank's; the workers settle the
    collector before every call: `ds_worker.GcClock`); None from a worker without it."""
    got = raw.get("gc_in_calls")
    if not isinstance(got, dict):
        return None
    return {
        kind: {name: round(max(v[1:] or v or [0.0]), 6) for name, v in per.items()}
        for kind, per in got.items()
    }


def gc_sentence(entries: list[tuple[str, Any]], theirs: str, label: str) -> list[str]:
    """The paragraph on the garbage collector for a section: how the rounds settle it,
    and the most it took inside one timed call, per configuration (``entries``: label,
    summary), of ``theirs`` (the peer's method name, shown as ``label``) and resumable;
    nothing for runs made before the workers measured it."""
    parts = []
    for name, e in entries:
        got = e.get("gc_in_calls_s") if isinstance(e, dict) else None
        if not got:
            continue
        sv, rs = got.get("saves", {}), got.get("restores", {})
        parts.append(
            f"{name}: saves {fmt_s(sv.get(theirs))} s ({label}) / "
            f"{fmt_s(max((v for k, v in sv.items() if k.startswith('resumable')), default=None))}"
            f" s (resumable), restores {fmt_s(rs.get(theirs))} / {fmt_s(rs.get('resumable'))} s"
        )
    if not parts:
        return []
    return [
        "",
        "Before every timed call of every method a full collection of Python's garbage "
        "collector runs, outside the timing (`ds_worker.GcClock`): a generation-2 "
        "collection walks every container object of the process, the framework's as well "
        "as the library's, and would otherwise land in whichever call crosses its "
        "threshold. The most the collector still took inside one call, rounds after the "
        "first, slowest rank: " + "; ".join(parts) + ".",
    ]


def ratio(x: float, y: float) -> float | None:
    return round(x / y, 4) if y else None


def not_importable(code: str) -> str | None:
    """None when ``code`` (its imports) runs in a fresh interpreter, else the tail of its
    error. Asked only after a launch failed: a launch that works proves it."""
    probe = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    return None if probe.returncode == 0 else probe.stderr[-300:]


def run_configs(
    workdir: Path,
    reps: int,
    key: str,
    configs: Iterable[tuple[str, str, str, Callable[[Path], dict[str, Any]]]],
    summarise: Callable[[dict[str, Any]], dict[str, Any]],
    log: Log,
    *,
    imports: str,
    needs: str,
) -> dict[str, Any]:
    """Every configuration in turn (its name, its folder under ``workdir``, what the log
    calls it, and its launch into that folder), each summarised under
    ``out[key][name]``; one that fails is recorded with its error and the others still
    run. Raises when ``imports`` fails in a fresh interpreter, saying that ``needs`` is
    not importable (`run.py` records it). ``workdir`` is removed at the end."""
    out: dict[str, Any] = {
        "reps": reps,
        "world_size": WORLD,
        "cpu_count": os.cpu_count(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "how": HOW,
        key: {},
    }
    started = time.perf_counter()
    try:
        for name, folder, what, run in configs:
            log(f"{what}: {WORLD} ranks, {reps} reps")
            t0 = time.perf_counter()
            try:
                raw = run(workdir / folder)
                raw["launch_wall_s"] = round(time.perf_counter() - t0, 1)
                out[key][name] = summarise(raw)
            except Exception as exc:
                why = not_importable(imports)
                if why is not None:
                    raise RuntimeError(f"{needs} not importable: {why}") from exc
                log(f"{what} failed: {exc!r}"[:500])
                out[key][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                shutil.rmtree(workdir / folder, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out["wall_s"] = round(time.perf_counter() - started, 1)
    return out


def measured(out: Any, key: str) -> bool:
    """Whether ``out`` holds at least one measured configuration under ``key``."""
    configs = out.get(key) if isinstance(out, dict) else None
    return isinstance(configs, dict) and any(
        isinstance(e, dict) and "save" in e for e in configs.values()
    )


def not_measured(out: Any, lines: list[str], end: str) -> str:
    """The block of a result with an ``error`` (or none at all)."""
    err = " ".join(str(out.get("error") or "").split()) if isinstance(out, dict) else ""
    return "\n".join([*lines, f"Not measured{': ' + err[:300] if err else ''}.", end])


def fmt_s(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def fmt_x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def fmt_mb(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e6:.0f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def write_block(docs: Path, begin: str, end: str, block: str, after: str | None = None) -> None:
    """Rewrite the block between ``begin`` and ``end`` in ``docs``; where the page has
    none yet, insert it after the line ``after`` (another phase's end marker) if the page
    has it, else before the data position section (where `report.py` renders it)."""
    text = docs.read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    elif after is not None and after in text:
        text = text.replace(after, f"{after}\n\n{block}", 1)
    elif "\n## Data position" in text:
        text = text.replace("\n## Data position", f"\n{block}\n\n## Data position", 1)
    else:
        text = text.rstrip("\n") + f"\n\n{block}\n"
    docs.write_text(text)


def newest(results_dir: Path, prefix: str) -> Path | None:
    """The newest standalone result (``<prefix>-<date>.json``: the date sorts)."""
    files = sorted(results_dir.glob(f"{prefix}-*.json"))
    return files[-1] if files else None


def save_result(
    out: dict[str, Any], results_dir: Path, prefix: str, write_docs: Callable[[Any, str], None]
) -> Path:
    """Stamp ``out``, write it as ``<prefix>-<date>.json`` and rewrite its block."""
    path = results_dir / f"{prefix}-{out['date']}.json"
    out["file"] = path.name
    path.write_text(json.dumps(out, indent=1) + "\n")
    write_docs(out, f"benchmarks/results/{path.name}")
    return path
