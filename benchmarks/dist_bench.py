"""Distributed phase: an FSDP2 model saved by `resumable` and by
``torch.distributed.checkpoint`` at world sizes 1, 2 and 4 on CPU (gloo), in the same run.

    python benchmarks/dist_bench.py                        # this phase alone: 128 MiB, 3 + 10
    python benchmarks/dist_bench.py --size-mb 32 --reps 2 --worlds 1 2
    python benchmarks/dist_bench.py --docs                 # ... and rewrite its section

(`run.py` calls `run_phase`; alone, this prints the results JSON and, with ``--docs``,
writes ``benchmarks/results/dist-<date>.json`` and rewrites the "Several ranks" section
of docs/performance.md from it with `report.dist_section`, as ``make bench`` would.)

For each world size W, one ``torchrun --standalone --nproc-per-node=W`` launch of
`dist_worker.py` builds an MLP whose parameters plus AdamW's moments take about
``size_mb`` MiB in total (sharded over the W ranks by ``fully_shard``, on a one-rank
mesh at W=1), and interleaves ``warmup + reps`` rounds of: resumable ``save()``
(``persist="sync"``: the save returns after the coordinated, durable commit),
``dcp.save`` and ``dcp.async_save`` (thread executor, gloo side group), the first method
rotating each round; also resumable with its default background persist, and the copy
floor, which then get ``pair_reps`` more rounds of the two alone (30 by default),
alternating which goes first: the goal of several ranks reads their ratio. Each sample
is the slowest rank's time after a barrier; round 0 is reported apart as *first*, and
medians are of the rounds after the warm-up ones (3 by default: the first saves into a
new directory ran slower here than the later ones). Bytes are the sizes
of each rank's data file (``rank-RRRRR.safetensors``, ``__R_0.distcp``) and of the rest
(manifest, ``.metadata``). ``OMP_NUM_THREADS`` is the machine's cores ÷ W, so the W
ranks share the cores as W trainers would. The data directories live under the bench
directory (on the repository's disk) and are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchrun_phase import run_logged
from torchrun_phase import stat as _stat

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_worker.py"
WORLDS = (1, 2, 4)
REPS = 10  # timed rounds: one round is about a second at 128 MiB (the loop takes minutes)
WARMUP = 3  # rounds before them
# Rounds after those of the background save and the copy floor alone, alternating which
# goes first: the 4-rank ratio of the two moved by more than its goal's margin from run
# to run on 10 samples; one such round is a fraction of a full one.
PAIR_REPS = 30
LABELS = {
    "resumable": 'resumable `save()`, `persist="sync"` (coordinated commit at W > 1)',
    "resumable_process": 'resumable `save()`, `persist="process"` (background), + `wait()`',
    "copy_floor": "floor: copy this rank's state into preallocated buffers",
    "dcp_save": "`get_state_dict` + `dcp.save`",
    "dcp_async": "`get_state_dict` + `dcp.async_save` (thread executor)",
}

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(f"[dist {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def launch(
    world: int,
    size_mb: float,
    reps: int,
    workdir: Path,
    *,
    background: bool,
    timeout_s: float,
    loop_steps: int = 0,
    warmup: int = 1,
    pair_reps: int = 0,
) -> dict[str, Any]:
    """One torchrun launch of `dist_worker.py` with ``world`` ranks; its JSON, raw."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    out = workdir / "result.json"
    log_path = workdir.parent / f"torchrun-w{world}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(WORKER),
        f"--size-mb={size_mb:g}",
        f"--reps={reps}",
        f"--warmup={warmup}",
        f"--dir={workdir}",
        f"--out={out}",
    ]
    if background:
        cmd.append("--background")
    if loop_steps:
        cmd.append(f"--loop-steps={loop_steps}")
    if pair_reps and background:
        cmd.append(f"--pair-reps={pair_reps}")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
    rc, tail = run_logged(cmd, env, log_path, timeout_s)
    if rc != 0 or not out.exists():
        why = f"timed out after {timeout_s:g} s" if rc is None else f"exit code {rc}"
        raise RuntimeError(f"torchrun with {world} rank(s): {why}; log tail:\n{tail}")
    return json.loads(out.read_text())


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Per method: blocking and total (slowest rank per sample), bytes per rank; and the
    ratios of resumable's medians to DCP's."""
    methods: dict[str, Any] = {}
    warmup = int(raw.get("warmup", 1))
    for name, m in raw["methods"].items():
        methods[name] = {
            "label": LABELS.get(name, name),
            "blocking": _stat(m["blocking"], warmup),
            "total": _stat(m["total"], warmup),
            "per_rank_blocking": m["per_rank_blocking"],
            "per_rank_total": m["per_rank_total"],
            "bytes": m["bytes"],
        }
        if m.get("per_rank_cpu"):  # CPU seconds of each rank's process in the call
            per = [c for rep in m["per_rank_cpu"][warmup:] for c in rep]
            methods[name]["cpu_per_rank"] = {
                "median": round(statistics.median(per), 6) if per else None,
                "per_rank": m["per_rank_cpu"],
            }
        for key in ("span_blocking", "span_total"):  # first rank's start to last's return
            if m.get(key):
                methods[name][key] = _stat(m[key], warmup)
        if "snapshot" in m:  # the background save's own snapshot time (slowest rank)
            methods[name]["snapshot"] = _stat(m["snapshot"], warmup)
            methods[name]["per_rank_snapshot"] = m["per_rank_snapshot"]
        if m.get("layers"):  # rounds after the timed ones, the save's layers timed
            methods[name]["layers"] = layers(m["layers"])

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = methods.get(a, {}).get(key, {}), methods.get(b, {}).get(key, {})
        if not x or not y or not y.get("median"):
            return None
        return round(x["median"] / y["median"], 4)

    return {
        "world_size": raw["world_size"],
        "warmup": warmup,
        "torch_threads": raw["torch_threads"],
        "model": raw["model"],
        "order": raw["order"],
        "methods": methods,
        "ratios": {
            "resumable_over_dcp_save_total": ratio("resumable", "dcp_save", "total"),
            "resumable_over_dcp_async_blocking": ratio("resumable", "dcp_async", "blocking"),
            "resumable_over_dcp_async_total": ratio("resumable", "dcp_async", "total"),
            "background_over_dcp_async_blocking": ratio(
                "resumable_process", "dcp_async", "blocking"
            ),
            "background_over_copy_floor_blocking": ratio(
                "resumable_process", "copy_floor", "blocking"
            ),
            "background_over_dcp_save_total": ratio("resumable_process", "dcp_save", "total"),
        },
        "loop": raw.get("loop"),
    }


LAYERS = ("copy", "capture", "take", "ask", "answer", "hand_off")  # `dist_worker.save_layers`


def layers(rounds: list[list[dict[str, float]]]) -> dict[str, Any]:
    """The background save's layers (`dist_worker.layers`: per round, every rank's
    milliseconds): each round's *slot* added (the snapshot less its capture and copy: the
    slot, its metadata) and *rest* (the blocking less the snapshot, the decision and the
    hand-off), and per rank the mean of each over the rounds. Means, so that the layers
    add up to the blocking as they do in each round: a rank that loses its core for a
    while loses it inside one layer or another, a different one from round to round,
    which each layer's median would leave out. ``slowest``: the rank whose mean blocking
    is the largest."""
    for rnd in rounds:
        for row in rnd:
            row["slot"] = round(row["take"] - row["copy"] - row["capture"], 4)
            outside = row["take"] + row["ask"] + row["answer"] + row["hand_off"]
            row["rest"] = round(row["blocking"] - outside, 4)
    per_rank = [
        {k: round(statistics.fmean(rnd[r][k] for rnd in rounds), 4) for k in rounds[0][r]}
        for r in range(len(rounds[0]))
    ]
    slowest = max(range(len(per_rank)), key=lambda r: per_rank[r]["blocking"])
    return {"rounds": rounds, "per_rank_ms": per_rank, "slowest": slowest}


def run_phase(
    workdir: Path,
    size_mb: float,
    reps: int,
    log: Log = _print,
    *,
    worlds: tuple[int, ...] = WORLDS,
    background: bool = True,
    timeout_s: float = 900.0,
    loop_steps: int = 300,
    warmup: int = WARMUP,
    pair_reps: int = PAIR_REPS,
) -> dict[str, Any]:
    """Every world size in turn; a world size that fails is recorded with its error and
    the others still run. ``workdir`` is emptied and removed at the end."""
    out: dict[str, Any] = {
        "size_mb": size_mb,
        "reps": reps,
        "warmup": warmup,
        "pair_reps": pair_reps if background else 0,
        "cpu_count": os.cpu_count(),
        "how": "torchrun --standalone, gloo, FSDP2 fully_shard on a CPU mesh; rank-max times",
        "worlds": {},
    }
    try:
        for w in worlds:
            log(
                f"distributed: {w} rank(s), {size_mb:g} MiB, {warmup} + {reps} rounds"
                + (f", then {pair_reps} of the background save and the floor" if pair_reps else "")
            )
            try:
                raw = launch(
                    w,
                    size_mb,
                    reps,
                    workdir / f"w{w}",
                    background=background,
                    timeout_s=timeout_s,
                    loop_steps=loop_steps,
                    warmup=warmup,
                    pair_reps=pair_reps,
                )
                out["worlds"][str(w)] = summarise(raw)
            except Exception as exc:
                log(f"distributed, {w} rank(s), failed: {exc!r}"[:500])
                out["worlds"][str(w)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                shutil.rmtree(workdir / f"w{w}", ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=128, help="model + AdamW state, MiB (128)")
    ap.add_argument(
        "--reps", type=int, default=REPS, help=f"timed rounds after the warm-up ({REPS})"
    )
    ap.add_argument(
        "--warmup", type=int, default=WARMUP, help=f"rounds before the timed ones ({WARMUP})"
    )
    ap.add_argument(
        "--pair-reps",
        type=int,
        default=PAIR_REPS,
        help=f"rounds after those of the background save and the copy floor alone ({PAIR_REPS})",
    )
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="(1 2 4)")
    ap.add_argument("--no-background", action="store_true", help="skip persist='process'")
    ap.add_argument("--loop-steps", type=int, default=300, help="training loop steps (300)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per launch (900)")
    ap.add_argument("--bench-dir", type=Path, default=HERE.parent / "runs" / "bench-dist")
    ap.add_argument(
        "--docs", action="store_true", help="save the results, rewrite docs/performance.md"
    )
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    out = run_phase(
        args.bench_dir,
        args.size_mb,
        max(1, args.reps),
        worlds=tuple(args.worlds),
        background=not args.no_background,
        timeout_s=args.timeout_s,
        loop_steps=args.loop_steps,
        warmup=max(1, args.warmup),
        pair_reps=max(0, args.pair_reps),
    )
    print(json.dumps(out, indent=1))
    if args.docs:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = HERE / "results" / f"dist-{stamp}.json"
        out["load_after"] = os.getloadavg()
        path.write_text(json.dumps({"dist": out, "load_before": load_before}, indent=1))
        write_docs(out, load_before, f"benchmarks/results/{path.name}")
        _print(f"wrote {path} and its section of {DOCS}")
    return 0


DOCS = HERE.parent / "docs" / "performance.md"
SECTION = "\n## Several ranks (FSDP2 on CPU, gloo)\n"


def write_docs(
    out: dict[str, Any], load_before: tuple[float, ...], source: str, docs: Path = DOCS
) -> None:
    """Replace the "Several ranks" section of ``docs`` (up to the next section or the end)
    with `report.dist_section` of ``out``, saying which results file it comes from."""
    sys.path.insert(0, str(HERE))
    from report import dist_section

    lines = dist_section({"dist": out})
    load = " ".join(f"{x:.2f}" for x in load_before)
    after = " ".join(f"{x:.2f}" for x in out.get("load_after", ()))
    lines[2:2] = [
        f"Measured by `benchmarks/dist_bench.py --docs`; figures from `{source}` "
        f"(load average {load} → {after}).",
        "",
    ]
    section = "\n".join(lines)
    text = docs.read_text()
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n" + section + "\n"
    else:
        # up to the next section, or the marker another phase's section begins with
        ends = [text.find(m, start + len(SECTION)) for m in ("\n## ", "\n<!-- ")]
        end = min((e for e in ends if e >= 0), default=-1)
        rest = text[end:] if end >= 0 else "\n"
        text = text[:start] + section + "\n" + rest
    docs.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
