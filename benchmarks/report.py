"""Render ``docs/performance.md`` from one results JSON (the newest by default).

    python benchmarks/report.py                      # newest benchmarks/results/*.json
    python benchmarks/report.py results/x.json       # a given run

Every figure in the page is a median of one run's samples, or a ratio of two medians of
the same run; nothing is typed by hand. `targets` evaluates the issue's targets and is
also stored in the results JSON by `run.py`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import ds_bench  # noqa: E402
import goals  # noqa: E402
import incr_report  # noqa: E402
import mcore_bench  # noqa: E402
import small_report  # noqa: E402

Result = dict[str, Any]


def _loop_floor_rows(e2e: dict[str, Any]) -> list[list[str]]:
    """The copy floor and the guarded floor timed in the loop (`training._timed_kind`),
    where the run has them."""
    return _in_loop_rows(
        e2e,
        "floor",
        "copy floor in the loop (the same tensors, one `_foreach_copy_` into memory "
        "allocated once, after each step of its kind)",
        "floor_copy_s",
    ) + _in_loop_rows(
        e2e,
        "guarded",
        "guarded floor in the loop (`small_bench.guarded_snapshot`: the copy as the "
        "floor makes it, with the structure and tensor checks, two slots taken in turn "
        "and a record with its digest)",
        "guarded_call_s",
    )


def _interleaved_rows(e2e: dict[str, Any]) -> list[list[str]]:
    """A run whose kinds took turns step by step: each kind's throughput from its total
    time, and what the persists' background work cost the steps beside them."""
    if e2e.get("interleaved") != "step":
        return []
    rows = [
        [
            f"throughput ratio of the totals (baseline ÷ {what})",
            _f(e2e.get(key), "{:.3f}"),
        ]
        for key, what in (
            ("total_ratio", "checkpointed"),
            ("guarded_total_ratio", "the guarded floor"),
            ("fused_total_ratio", "the fused snapshot"),
            ("floor_total_ratio", "the copy alone"),
        )
        if e2e.get(key) is not None
    ]
    spill = _get(e2e, "persist_spill", "per_checkpointed_step_s")
    if isinstance(spill, (int, float)):
        rows.append(
            [
                "a persist's background work, charged to the checkpointed steps",
                f"{spill * 1000:.2f} ms per step",
            ]
        )
    return rows


def _in_loop_rows(e2e: dict[str, Any], kind: str, what: str, key: str) -> list[list[str]]:
    """A floor's fastest and median call in the loop, and its segments' throughput."""
    calls = e2e.get(key)
    if not isinstance(calls, dict):
        return []
    fastest, median = calls.get("min"), calls.get("median")
    return [
        [
            f"{what}: fastest, median",
            f"{_f(None if fastest is None else fastest * 1000, '{:.2f} ms')}, "
            f"{_f(None if median is None else median * 1000, '{:.2f} ms')}",
        ],
        [
            f"throughput ratio of the rounds' medians (baseline ÷ {kind})",
            _f(e2e.get(f"{kind}_throughput_ratio"), "{:.3f}"),
        ],
    ]


def _median(entry: Any, key: str = "median") -> float | None:
    """``entry[key]`` ("median" or "min") of a samples dict, computed from its samples
    when the key is missing."""
    if not isinstance(entry, dict):
        return None
    v = entry.get(key)
    if isinstance(v, (int, float)):
        return float(v)
    samples = entry.get("samples")
    if key == "min" and isinstance(samples, list) and samples:
        return float(min(samples))
    return None


def _get(out: Result, *path: str) -> Any:
    cur: Any = out
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def _m(out: Result, *path: str, key: str = "median") -> float | None:
    return _median(_get(out, *path), key)


def _bw(nbytes: float | None, seconds: float | None) -> float | None:
    if not nbytes or not seconds:
        return None
    return nbytes / seconds / 1e9


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fastest_floor(out: Result, names: tuple[str, ...], key: str) -> tuple[float | None, str]:
    """The fastest (highest GB/s) of the floors ``names`` the run has, and its name."""
    best: tuple[float | None, str] = (None, "")
    for name in names:
        entry = _get(out, "floors", name)
        bw = _bw(_get(entry, "bytes") if isinstance(entry, dict) else None, _median(entry, key))
        if bw is not None and (best[0] is None or bw > best[0]):
            best = (bw, name)
    return best


def write_floor(out: Result, key: str = "median") -> tuple[float | None, str]:
    """The faster (higher GB/s) of the two fsync write floors, and its name."""
    return _fastest_floor(out, ("write_python", "write_dd"), key)


def persist_floor(out: Result, key: str = "median") -> tuple[float | None, str]:
    """The fsync write floor a persist is held to: the faster of those timed in the
    save rounds, beside the persists (through the page cache and around it, as
    resumable writes large files), where the run has them; else `write_floor`."""
    best = _fastest_floor(out, ("write_python_rounds", "write_direct_rounds"), key)
    return best if best[0] is not None else write_floor(out, key)


def read_floor(out: Result, cache: str, key: str = "median") -> float | None:
    """Seconds to read the state's bytes at the read floor (scaled to the state size)."""
    entry = _get(out, "floors", f"read_{cache}")
    bw = _bw(_get(out, "floors", f"read_{cache}", "bytes"), _median(entry, key))
    nbytes = _get(out, "state", "bytes")
    return nbytes / (bw * 1e9) if bw and nbytes else None


def ours_blocking(out: Result, key: str = "median") -> tuple[float | None, str]:
    """resumable's snapshot blocking time: the memory snapshot where the API has one."""
    snap = _m(out, "methods", "resumable", "snapshot", key=key)
    if snap is not None:
        return snap, "memory snapshot"
    return _m(out, "methods", "resumable", "save_blocking", key=key), "save() (synchronous API)"


def targets(out: Result) -> list[dict[str, Any]]:
    """The issue's targets: name, measured value (ratio of medians), threshold, met (None:
    not measurable), and ``measured_min``, the same ratio of minimums: a cross-check on a
    noisy machine, where interference only ever adds time."""
    rows = _targets(out, "median")
    for row, alt in zip(rows, _targets(out, "min")):
        row["measured_min"] = alt["measured"]
    return rows


def _targets(out: Result, key: str) -> list[dict[str, Any]]:
    def m(*path: str) -> float | None:
        return _m(out, *path, key=key)

    copy = m("floors", "copy")
    copy_adj = m("floors", "copy_memory_phase") or copy
    blocking, what = ours_blocking(out, key)
    rows: list[dict[str, Any]] = []

    def row(name: str, value: float | None, op: str, limit: float, how: str) -> None:
        met = None
        if value is not None:
            met = value <= limit if op == "<=" else value >= limit
        rows.append(
            {"target": name, "measured": value, "op": op, "limit": limit, "met": met, "how": how}
        )

    row(
        "snapshot blocking ≤ 1.5x copy floor",
        _ratio(blocking, copy_adj),
        "<=",
        1.5,
        f"resumable {what} / copy floor of the memory phase (samples interleaved 1:1)",
    )
    row(
        "snapshot blocking ≥ 5x below dcp.async_save's",
        _ratio(m("methods", "dcp_async_default", "save_blocking"), blocking),
        ">=",
        5.0,
        f"dcp.async_save (defaults) blocking / resumable {what}",
    )
    row(
        "snapshot blocking ≥ 8x below torch.save's",
        _ratio(m("methods", "torch_save", "save_blocking"), blocking),
        ">=",
        8.0,
        f"torch.save + fsync / resumable {what}",
    )
    snap_here = m("methods", "resumable", "snapshot_save_phase")
    if snap_here is not None:
        row(
            "save() blocking (a persist starting) ≤ 1.1x a memory snapshot alone",
            _ratio(m("methods", "resumable", "save_blocking"), snap_here),
            "<=",
            1.1,
            "resumable save() blocking / resumable snapshot() taken right before each save "
            "(same rounds of the save phase)",
        )
    wbw, wname = persist_floor(out, key)
    nbytes = _get(out, "state", "bytes")
    persist = m("methods", "resumable", "save_persist")
    row(
        "persist throughput ≥ 80% of the fsync write floor",
        _ratio(_bw(nbytes, persist), wbw),
        ">=",
        0.8,
        f"state bytes / resumable persist time, over the {wname} floor's GB/s",
    )
    row(
        "stricter: persist throughput ≥ 90% of the fsync write floor",
        _ratio(_bw(nbytes, persist), wbw),
        ">=",
        0.9,
        "as above (a full persist: every byte of the state changed since the last one)",
    )
    copy_restore = m("floors", "copy_restore_memory")
    restore_memory = _ratio(m("methods", "resumable", "restore_memory"), copy_restore or copy)
    row(
        "restore from shared memory ≤ 1.5x copy floor",
        restore_memory,
        "<=",
        1.5,
        "resumable restore(tier='memory') / copy floor"
        + (" sampled between those restores (1:1)" if copy_restore else ""),
    )
    row(
        "stricter: restore from shared memory ≤ 1.2x copy floor",
        restore_memory,
        "<=",
        1.2,
        "as above",
    )
    hashed = m("floors", "hash_restore_memory")
    if hashed is not None and copy_restore is not None:
        row(
            "restore from shared memory ≤ 1.1x (copy + checksum floor), checksums verified",
            _ratio(m("methods", "resumable", "restore_memory"), copy_restore + hashed),
            "<=",
            1.1,
            "resumable restore(tier='memory') / (copy floor + XXH3-64 of the same bytes on "
            "one thread), both sampled between those restores (1:1)",
        )
    caches = [c for c in ("cold", "warm") if _get(out, "floors", f"read_{c}")]
    for i, cache in enumerate(caches):
        rf = read_floor(out, cache, key)
        floor = rf + copy if rf is not None and copy is not None else None
        restore = _ratio(m("methods", "resumable", f"restore_{cache}"), floor)
        row(
            f"restore from local disk ≤ 1.3x (read floor + one copy), {cache} page cache"
            + ("" if i == 0 else " (informational)"),
            restore,
            "<=",
            1.3,
            f"resumable restore from storage / ({cache} read floor + copy floor)",
        )
        if cache == "cold":
            row(
                "stricter: cold restore from local disk ≤ 1.1x (cold read floor + copy)",
                restore,
                "<=",
                1.1,
                "as above",
            )
    row(
        "training throughput with a snapshot every step ≥ 95% of no checkpoints",
        _ratio(m("e2e", "baseline_segment_s"), m("e2e", "checkpointed_segment_s")),
        ">=",
        0.95,
        "median baseline segment time / median checkpointed segment time"
        + (
            " (sync fallback: no memory tier)"
            if "sync fallback" in str(_get(out, "e2e", "mode"))
            else ""
        ),
    )
    if _get(out, "e2e_overlap", "baseline_segment_s"):
        row(
            "same, overlap mode (copy during the next forward/backward) ≥ 95%",
            _ratio(
                m("e2e_overlap", "baseline_segment_s"), m("e2e_overlap", "checkpointed_segment_s")
            ),
            ">=",
            0.95,
            "median baseline segment time / median checkpointed segment time, overlap=True",
        )
    return rows


# ---------------------------------------------------------------------------- rendering


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def _s(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 1 else f"{x:.2f}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


METHOD_ORDER = [
    "resumable",
    "torch_save",
    "dcp_save",
    "dcp_async_default",
    "dcp_async_shm",
    "dcp_async_process",
    "dlrover",
]


def render(out: Result) -> str:
    mach = out.get("machine", {})
    st = out.get("state", {})
    nbytes = st.get("bytes")
    copy = _m(out, "floors", "copy")
    blocking, what = ours_blocking(out)
    api = out.get("resumable_api", {})
    lines = [
        "# Performance",
        "",
        "<!-- GENERATED by benchmarks/report.py from benchmarks/results/"
        f"{out.get('file', '?')}; do not edit by hand: run `make bench`. -->",
        "",
        f"Generated by `benchmarks/report.py` from `benchmarks/results/{out.get('file', '?')}`"
        f" — run of {out.get('date', '?')} on host `{mach.get('host', '?')}`"
        + (f", commit `{out['git_commit']}`" if out.get("git_commit") else "")
        + ". Every figure is the median of that run's samples (rep 0 of each save is "
        "reported apart as *first*), and every ratio compares two medians of the same run. "
        "How to run and read it: `benchmarks/README.md`.",
        "",
        "## Machine and state",
        "",
    ]
    fs = mach.get("bench_fs", {})
    lines += _table(
        ["", ""],
        [
            ["CPU", f"{mach.get('cpu_model', '?')} ({mach.get('cpu_count')} cores)"],
            ["memory", _f((mach.get("memory_total_bytes") or 0) / 2**30, "{:.1f} GiB")],
            ["torch", str(mach.get("torch_version"))],
            ["bench dir filesystem", f"{fs.get('fstype', '?')} on {fs.get('device', '?')}"],
            ["/dev/shm is tmpfs", str(mach.get("dev_shm_is_tmpfs"))],
            [
                "load average (start → end)",
                f"{mach.get('loadavg_start', '?')} → {mach.get('loadavg_end', '?')}",
            ],
            [
                "state",
                f"{_f((nbytes or 0) / 2**20, '{:.1f}')} MiB fp32 in {st.get('tensors')} tensors "
                f"(GPT-like parameters + Adam exp_avg/exp_avg_sq; largest "
                f"{_f(st.get('largest_tensor_bytes', 0) / 2**20, '{:.1f}')} MiB, median "
                f"{_f(st.get('median_tensor_bytes', 0) / 2**10, '{:.1f}')} KiB)",
            ],
            ["repetitions", str(_get(out, "config", "reps"))],
            [
                "resumable API",
                (
                    "two-tier (memory snapshots + background persist)"
                    if api.get("tiers")
                    else "synchronous (no memory tier yet)"
                )
                + f", persist mode `{_get(out, 'methods', 'resumable', 'persist_mode')}`",
            ],
            ["run time", f"{out.get('wall_s', '?')} s"],
        ],
    )

    lines += ["", "## Floors", ""]
    frows = []
    for key, name in [
        ("copy", "copy: `dst.copy_(src)` of every tensor into preallocated tensors"),
        ("copy_memory_phase", "copy, memory-phase samples only (interleaved with snapshots)"),
        (
            "copy_restore_memory",
            "copy, samples interleaved with resumable's restores from shared memory",
        ),
        (
            "hash_restore_memory",
            "XXH3-64 (the checksum a restore verifies) of every tensor's bytes, one thread, "
            "interleaved with those restores",
        ),
        (
            "checked_copy_restore_memory",
            "copy that computes the XXH3-64 of what it copies, block by block, on the copy "
            "threads (the fastest checked copy), interleaved with those restores",
        ),
        ("write_python", "write + fsync from Python (random bytes)"),
        ("write_python_rounds", "the same, once per save round"),
        (
            "write_direct_rounds",
            "the same with `O_DIRECT` (around the page cache), once per save round; "
            "persists are held to the faster of the two",
        ),
        ("write_dd", "write + fsync: `dd if=/dev/zero bs=16M conv=fsync`"),
        ("read_cold", "read back, cold page cache"),
        ("read_warm", "read back, warm page cache"),
    ]:
        entry = _get(out, "floors", key)
        if not isinstance(entry, dict):
            continue
        if "error" in entry:
            frows.append([name, "—", "—", "—", "error: " + str(entry["error"])[:80]])
            continue
        b = entry.get("bytes", nbytes)
        frows.append(
            [
                name,
                _s(_median(entry)),
                _s(entry.get("min")),
                _f(_bw(b, _median(entry)), "{:.2f}"),
                str(len(entry.get("samples", []))),
            ]
        )
    lines += _table(["floor", "median s", "min s", "GB/s (median)", "samples"], frows)

    lines += [
        "",
        "## Saving: peers vs. resumable",
        "",
        "*Blocking*: how long the caller cannot touch its tensors. *Total*: until the "
        "checkpoint is complete (durable for all but DLRover, which does not fsync its data "
        "file). Ratios: blocking ÷ copy floor; total ÷ write floor (the one timed in "
        "each save round, beside the saves, in runs that have it; else the faster of the "
        "two write floors; scaled to the state's bytes); and each method's blocking ÷ "
        f"resumable's ({what}, {_s(blocking)} s).",
        "",
    ]
    wbw, _ = persist_floor(out)
    wsec = nbytes / (wbw * 1e9) if wbw and nbytes else None
    srows = []
    for name in METHOD_ORDER:
        e = _get(out, "methods", name)
        if not isinstance(e, dict):
            continue
        label = e.get("label", name)
        if "error" in e and _median(e.get("save_blocking")) is None:
            srows.append([label] + ["—"] * 7 + ["not measured: " + str(e["error"])[:120]])
            continue
        b, t = _median(e.get("save_blocking")), _median(e.get("save_total"))
        first = _get(e, "save_blocking", "first")
        srows.append(
            [
                label,
                _s(b),
                _f(_bw(nbytes, b), "{:.2f}"),
                _x(_ratio(b, copy)),
                _s(t),
                _x(_ratio(t, wsec)),
                _x(_ratio(b, blocking)),
                _s(first),
                str(e.get("notes", ""))[:160],
            ]
        )
    lines += _table(
        [
            "method",
            "blocking s",
            "blocking GB/s",
            "÷ copy floor",
            "total s",
            "total ÷ write floor",
            "blocking ÷ resumable",
            "first blocking s",
            "how",
        ],
        srows,
    )

    lines += [
        "",
        "## Memory snapshots",
        "",
        "Each is compared with the copy floor measured alongside it: resumable's with the "
        "memory-phase copies (interleaved 1:1) or, for the snapshots taken in the save "
        "rounds, with the copy sampled at the start of each of those rounds; DLRover's with "
        "the copies measured in its own process (it runs under torchrun, at another time "
        "of the run).",
        "",
    ]
    mrows = []
    dl_copy = _m(out, "methods", "dlrover", "copy_floor_in_process")
    copy_adj = _m(out, "floors", "copy_memory_phase") or copy
    for name, key_, label, floor in (
        ("resumable", "snapshot", "resumable snapshot()", copy_adj),
        (
            "resumable",
            "snapshot_save_phase",
            "resumable snapshot(), one before each save (save phase)",
            _m(out, "floors", "copy_save_phase"),
        ),
        ("dlrover", "snapshot", "DLRover save_checkpoint(StorageType.MEMORY)", dl_copy),
    ):
        e = _get(out, "methods", name, key_)
        if isinstance(e, dict):
            mrows.append(
                [
                    label,
                    _s(_median(e)),
                    _s(floor),
                    _x(_ratio(_median(e), floor)),
                    _x(_ratio(_median(e), copy)),
                    _s(e.get("first")),
                    str(len(e.get("samples", []))),
                ]
            )
    if mrows:
        lines += _table(
            [
                "method",
                "steady blocking s",
                "copy floor alongside s",
                "÷ that floor",
                "÷ run's copy floor",
                "first (allocates) s",
                "samples",
            ],
            mrows,
        )
    else:
        lines += [
            "No memory snapshots measured (the resumable API in this run has no memory tier)."
        ]

    lines += [
        "",
        "## Restoring",
        "",
        "A restore ends with the bytes in the live tensors (loaders that return new tensors "
        "pay the copy into them). Floors: read floor (same page-cache state) + copy floor; "
        "from shared memory: copy floor"
        + (
            " (resumable's: the copy floor sampled between its restores, 1:1)."
            if _get(out, "floors", "copy_restore_memory")
            else "."
        ),
        "",
    ]
    rrows = []
    rf = {c: read_floor(out, c) for c in ("cold", "warm")}
    for name in METHOD_ORDER:
        e = _get(out, "methods", name)
        if not isinstance(e, dict):
            continue
        cells = [e.get("label", name)]
        for cache in ("cold", "warm"):
            v = _median(e.get(f"restore_{cache}"))
            fl = rf[cache] + copy if rf[cache] is not None and copy is not None else None
            cells += [_s(v), _x(_ratio(v, fl))]
        mem = _median(e.get("restore_memory"))
        mem_floor = copy
        if name == "resumable":
            mem_floor = _m(out, "floors", "copy_restore_memory") or copy
        cells += [_s(mem), _x(_ratio(mem, mem_floor))]
        if any(c != "—" for c in cells[1:]):
            rrows.append(cells)
    lines += _table(
        [
            "method",
            "cold s",
            "÷ (cold read + copy)",
            "warm s",
            "÷ (warm read + copy)",
            "from memory s",
            "÷ copy floor",
        ],
        rrows,
    )
    if out.get("restore_page_cache") == ["warm"]:
        lines += ["", "The page cache could not be dropped: only warm restores were measured."]
    ab = out.get("restore_cold_ab")
    if isinstance(ab, dict) and isinstance(ab.get("resumable"), dict):
        peer = _get(out, "methods", ab.get("peer"), "label") or ab.get("peer")
        flushed = str(ab.get("cold_start", "")).startswith("flush")
        read = _median(ab.get("read_floor"))
        lines += [
            "",
            f"Cold restores timed again, resumable and the fastest peer of the table "
            f"({peer}), in {ab.get('pairs')} rounds"
            + (
                ", each restore (and the plain read of as many bytes beside them) after an "
                "unrelated file of the state's size was read through and the page cache "
                "dropped (a restore right after another of the same files found them in "
                "the virtual disk's own cache), the first of a round rotating"
                if flushed
                else " (the page cache dropped before each restore, the first of a pair "
                "alternating)"
            )
            + ", so that the goal is not decided by the luckiest of several medians: "
            f"resumable {_s(_median(ab['resumable']))} s, {peer} "
            f"{_s(_median(ab.get('peer_restore')))} s"
            + (f", the cold read floor {_s(read)} s" if read is not None else "")
            + f", ratio of medians {ab.get('ratio_of_medians')}, median of the rounds' "
            f"ratios {ab.get('median_pair_ratio')}; restored state equal: "
            f"{'yes' if ab.get('restored_equal') else 'no'}.",
        ]
    elif isinstance(ab, dict) and ab.get("error"):
        lines += ["", f"Cold restores timed again in rounds: not measured ({ab['error']})."]

    lines += ["", "## Targets", ""]
    trows = []
    for t in targets(out):
        met = {True: "**met**", False: "not met", None: "not measured"}[t["met"]]
        trows.append(
            [
                t["target"],
                _f(t["measured"], "{:.3f}"),
                f"{t['op']} {t['limit']}",
                met,
                _f(t.get("measured_min"), "{:.3f}"),
                t["how"],
            ]
        )
    lines += [
        "*measured*: the ratio of medians, which decides *result*. *ratio of minimums*: "
        "the same ratio from each side's fastest sample, a cross-check on this shared "
        "machine, where interference from other jobs only ever adds time.",
        "",
    ]
    lines += _table(
        ["target", "measured", "threshold", "result", "ratio of minimums", "measured as"], trows
    )

    e2e = out.get("e2e")
    lines += ["", "## End to end: training loop", ""]
    if isinstance(e2e, dict) and "throughput_ratio" in e2e:
        interleaved = e2e.get("interleaved") == "step"
        model = e2e.get("model", {})
        snap = _median(e2e.get("snapshot_blocking_s"))
        lines += _table(
            ["", ""],
            [
                [
                    "model",
                    f"MLP width {model.get('width')}, depth {model.get('depth')}, batch "
                    f"{model.get('batch')}, {model.get('params')} parameters, "
                    f"{_f(e2e.get('state_bytes', 0) / 2**20, '{:.1f}')} MiB state with AdamW, "
                    f"{e2e.get('torch_threads', '?')} torch thread(s)",
                ],
                ["checkpointing", str(e2e.get("mode"))],
                [
                    "rounds" if interleaved else "segments",
                    f"{e2e.get('rounds')} x {e2e.get('steps_per_segment')} steps each "
                    f"way, {e2e.get('persists')} persists"
                    + (", the kinds taking turns step by step (ABBA)" if interleaved else ""),
                ],
                ["step time without checkpoints", _f(e2e.get("step_ms_baseline"), "{:.2f} ms")],
                ["step time with checkpoints", _f(e2e.get("step_ms_checkpointed"), "{:.2f} ms")],
                [
                    "snapshot blocking in the loop",
                    _f(None if snap is None else snap * 1000, "{:.2f} ms"),
                ],
                [
                    "throughput ratio (median baseline ÷ median checkpointed segment)",
                    _f(e2e.get("throughput_ratio"), "{:.3f}"),
                ],
                ["median of per-pair ratios", _f(e2e.get("median_pair_ratio"), "{:.3f}")],
                *_interleaved_rows(e2e),
                *_loop_floor_rows(e2e),
            ],
        )
    else:
        err = _get(out, "e2e_error", "error")
        lines += [f"Not measured{': ' + err if err else ''}."]

    lines += small_section(out)
    lines += s3_section(out)
    lines += dist_section(out)
    lines += ds_section(out)
    lines += mcore_section(out)
    lines += hf_short_section(out)
    lines += incr_section(out)
    lines += data_section(out)
    lines += goals.goals_section(out)

    problems = []
    for w, e in sorted((_get(out, "dist", "worlds") or {}).items()):
        if isinstance(e, dict) and "error" in e:
            err = " ".join(str(e["error"]).split())
            problems.append(f"- several ranks, world size {w}: {err[:300]}")
    for stage, e in sorted((_get(out, "ds", "stages") or {}).items()):
        if isinstance(e, dict) and "error" in e:
            err = " ".join(str(e["error"]).split())
            problems.append(f"- DeepSpeed, ZeRO {stage}: {err[:300]}")
        for name, ok in (_get(e, "restored_equal") or {}).items():
            if ok is False:
                problems.append(f"- DeepSpeed, ZeRO {stage}, {name}: restored state differs!")
    for name, e in (_get(out, "mcore", "configs") or {}).items():
        if isinstance(e, dict) and "error" in e:
            err = " ".join(str(e["error"]).split())
            problems.append(f"- Megatron-Core, {name}: {err[:300]}")
        for method, ok in (_get(e, "restored_equal") or {}).items():
            if ok is False:
                problems.append(f"- Megatron-Core, {name}, {method}: restored state differs!")
    incr = out.get("incr") if isinstance(out.get("incr"), dict) else {}
    runs = {"fine-tuning": incr.get("finetune"), "fine-tuning mirror": incr.get("finetune_s3")}
    runs.update({f"embedding {p}": e for p, e in (incr.get("embedding") or {}).items()})
    for what, e in runs.items():
        if isinstance(e, dict) and "error" in e and not str(e["error"]).startswith("skipped"):
            err = " ".join(str(e["error"]).split())
            problems.append(f"- incremental checkpoints, {what}: {err[:300]}")
        for mode, ok in (_get(e, "restored_equal") or {}).items():
            if ok is not True:
                problems.append(
                    f"- incremental checkpoints, {what}, {mode}: restored state differs: "
                    f"{str(ok)[:200]}"
                )
    for name, ok in (_get(out, "s3", "restored_equal") or {}).items():
        if ok is False:
            problems.append(f"- object storage {name}: restored bytes differ from saved!")
    for name in METHOD_ORDER:
        e = _get(out, "methods", name)
        if isinstance(e, dict):
            for k in ("error", "restore_error"):
                if k in e:
                    problems.append(f"- {e.get('label', name)}: {k}: {str(e[k])[:300]}")
            if e.get("restored_equal") is False:
                problems.append(f"- {e.get('label', name)}: restored tensors differ from saved!")
    if problems:
        lines += ["", "## What could not run", "", *problems]
    lines.append("")
    return "\n".join(lines)


S3_ROWS = [
    ("save", "plain_multipart", "plain: `upload_fileobj`, multipart (same client)", True),
    ("save", "plain_put", "plain: one `put_object` of the whole buffer", True),
    ("save", "resumable_sync", 'resumable `save()` to s3://, `persist="sync"`', True),
    ("save", "tiered_blocking", "tiered `save()` blocking (local dir + s3:// mirror)", False),
    ("save", "tiered_total", "tiered `save()` + `wait()`: local commit, then mirror", True),
    ("save", "tiered_mirror_upload", "tiered: the mirror upload alone (library's timing)", True),
    ("restore", "plain_download", "plain: `download_fileobj`, ranged GETs (same client)", True),
    ("restore", "resumable_mirror", "resumable `restore()`: empty local dir, s3:// mirror", True),
    ("restore", "resumable_direct", "resumable `restore()` directly from s3://", True),
]


def s3_section(out: Result) -> list[str]:
    """The object storage table: each row's MiB/s over the plain transfer's."""
    s3 = out.get("s3")
    lines = ["", "## Object storage (SeaweedFS on loopback)", ""]
    if not isinstance(s3, dict) or "save" not in s3:
        err = " ".join(str(_get(out, "s3", "error") or "").split())
        return [*lines, f"Not measured{': ' + err[:300] if err else ''}."]
    client = s3.get("client", {})
    nbytes = s3.get("bytes") or 0
    cores = _get(out, "machine", "cpu_count") or "?"
    lines += [
        f"{_f(nbytes / 2**20, '{:.1f}')} MiB of state (built like the one above), "
        f"{s3.get('reps')} reps after a first one, interleaved; both sides use the library's "
        f"boto3 client configuration with parts of {client.get('part_size', 0) // 2**20} MiB, "
        f"{client.get('max_concurrency')} in flight, and a CRC32 on every PUT and part. "
        f"The server ({_get(s3, 'server', 'software') or 'SeaweedFS'}) runs on the same "
        f"{cores}-core machine as the client and is reached over http, so botocore signs "
        "every body with SHA-256, which costs client CPU, and the server competes for the "
        "same cores: the absolute MiB/s say little about a real object store; the ratio "
        "to the plain transfer of the same bytes in the same run is the figure that "
        "matters. Restores end with the bytes in live tensors (checksums verified); "
        "each uses a newly created client, as a fresh process would.",
        "",
    ]
    rows = []
    for kind, name, label, comparable in S3_ROWS:
        e = _get(s3, kind, name)
        if not isinstance(e, dict):
            continue
        plain = "plain_multipart" if kind == "save" else "plain_download"
        med = _median(e)
        ratio = _ratio(_median(_get(s3, kind, plain)), med) if comparable else None
        rows.append(
            [
                label,
                _s(med),
                _f(nbytes / 2**20 / med if med else None, "{:.0f}"),
                _f(ratio, "{:.2f}"),
                _s(e.get("min")),
                _s(e.get("first")),
                str(len(e.get("samples", []))),
            ]
        )
    lines += _table(
        ["operation", "median s", "MiB/s", "÷ plain's MiB/s", "min s", "first s", "samples"],
        rows,
    )
    return lines


DIST_ORDER = ["resumable", "resumable_process", "dcp_save", "dcp_async", "copy_floor"]


def _mib_list(values: Any) -> str:
    if not isinstance(values, list) or not values:
        return "—"
    return " / ".join(f"{v / 2**20:.1f}" for v in values)


def small_section(out: Result) -> list[str]:
    """Snapshots of many small tensors: the block `small_report.render` makes of the run's
    ``"small"`` phase, or of the standalone run `write_report` put there (``small_file``)."""
    small = out.get("small")
    source = f"benchmarks/results/{out.get('small_file') or out.get('file', '?')}"
    block = small_report.render(small if isinstance(small, dict) else {}, source)
    return ["", *block.splitlines()]


def ds_section(out: Result) -> list[str]:
    """DeepSpeed: the block `ds_bench.render` makes of the run's ``"ds"`` phase, or of the
    standalone run `write_report` put there (``ds_file``)."""
    ds = out.get("ds")
    source = f"benchmarks/results/{out.get('ds_file') or out.get('file', '?')}"
    block = ds_bench.render(ds if isinstance(ds, dict) else {}, source)
    return ["", *block.splitlines()]


def mcore_section(out: Result) -> list[str]:
    """Megatron-Core: the block `mcore_bench.render` makes of the run's ``"mcore"`` phase,
    or of the standalone run `write_report` put there (``mcore_file``)."""
    mc = out.get("mcore")
    source = f"benchmarks/results/{out.get('mcore_file') or out.get('file', '?')}"
    block = mcore_bench.render(mc if isinstance(mc, dict) else {}, source)
    return ["", *block.splitlines()]


def hf_short_section(out: Result) -> list[str]:
    """Short Hugging Face Trainer runs (`hf_short_run.py`): the train time of each
    variant, its ratio to the plain Trainer's, and `ResumableTrainer`'s saves by index."""
    hf = out.get("hf_short")
    lines = ["", "## Short runs: Hugging Face Trainer (`hf_short_run.py`)", ""]
    if not isinstance(hf, dict) or "median_train_s" not in hf:
        err = " ".join(str(_get(out, "hf_short", "error") or "").split())
        return [*lines, f"Not measured{': ' + err[:300] if err else ''}."]
    st = hf.get("settings") or {}
    med = hf["median_train_s"]
    launches = hf.get("launches") or {}
    lines += [
        f"A GPT-2 built from a config ({st.get('layers')} layers, 128 wide, 4 heads, "
        f"vocabulary 2,048, sequences of 64: {st.get('parameters', 0):,} parameters; nothing "
        f"downloaded) trained on the CPU for {st.get('steps')} steps in batches of 8, "
        f'`save_strategy="steps"` every {st.get("save_steps")} steps, the same '
        "`TrainingArguments` for the plain `Trainer` and `ResumableTrainer`. Each launch is "
        "a fresh process (imports, the persist worker's start: what a user's launch pays); "
        f"{st.get('rounds')} rounds, the variants taking turns, the order reversed every "
        "other round (load average "
        f"{hf.get('loadavg_start', '?')} → {hf.get('loadavg_end', '?')}, "
        f"{hf.get('wall_s', '?')} s for the phase). *Train time*: `trainer.train()` from its "
        "call to its return, every save and the flush at the end included; medians. "
        "*Persist worker CPU*: the CPU seconds of the launch's child processes ended by "
        "then (the persist worker, which `ResumableTrainer` stops at the end of `train()`: "
        "its start and its persists, taken from the cores the trainer's threads use); "
        "medians.",
        "",
    ]
    cpu = hf.get("median_worker_cpu_s") or {}
    rows = []
    for name in med:
        ratio = 1.0 if name == "plain" else _ratio(med[name], med.get("plain"))
        rows.append(
            [
                f"`{name}`",
                _f(med[name], "{:.2f}"),
                _f(ratio, "{:.3f}"),
                "—" if name == "plain" else _f(cpu.get(name), "{:.3f}"),
                str(len(launches.get(name) or [])),
            ]
        )
    lines += _table(
        ["variant", "median train s", "÷ the plain Trainer's", "persist worker CPU s", "launches"],
        rows,
    )
    saves = _get(hf, "saves", "resumable")
    if not isinstance(saves, dict) or not saves.get("by_index"):
        return lines
    lines += [
        "",
        "Every `save()` of the `ResumableTrainer` launches, by its place in the launch: "
        "*blocking*, the wall time of the `Checkpointer.save` call the Trainer makes (what "
        "training waits for); *snapshot*, the seconds the library reports for that save's "
        "snapshot (`Checkpointer.last_snapshot_s`); *beyond the snapshot*, blocking minus "
        "snapshot (the save's checks and the hand-off of its persist, or a wait for the "
        "worker); medians over the launches, and the worst launch's blocking ÷ snapshot. "
        "The first save of a launch starts the persist worker and allocates the shared "
        "memory; the goal judges the saves after it, whose blocking should be their "
        "snapshot and the persist's hand-off, nothing more.",
        "",
    ]

    def ms(x: Any) -> str:
        return _f(None if x is None else x * 1000, "{:.1f}")

    rows = [
        [
            str(i.get("index")),
            ", ".join(str(x) for x in i.get("steps") or []),
            ms(i.get("median_blocking_s")),
            ms(i.get("median_snapshot_s")),
            ms(i.get("median_excess_s")),
            _f(i.get("median_ratio"), "{:.2f}"),
            _f(i.get("worst_ratio"), "{:.2f}"),
            str(i.get("launches")),
        ]
        for i in saves["by_index"]
        if isinstance(i, dict)
    ]
    lines += _table(
        [
            "save",
            "step",
            "median blocking ms",
            "median snapshot ms",
            "median beyond the snapshot ms",
            "median blocking ÷ snapshot",
            "worst blocking ÷ snapshot",
            "launches",
        ],
        rows,
    )
    lines += [
        "",
        "Longest `save()` ÷ its own snapshot, the worst launch: after the first save "
        f"{_x(saves.get('worst_ratio_after_first'))}; the first save "
        f"{_x(saves.get('worst_ratio_first'))}. Longest beyond its snapshot after the "
        f"first save: {ms(_get(saves, 'after_first', 'worst_excess_s'))} ms.",
    ]
    return lines


def incr_section(out: Result) -> list[str]:
    """Incremental checkpoints: the block `incr_bench.render` makes of the run's ``"incr"``
    phase, or of the standalone run `write_report` put there (``incr_file``)."""
    inc = out.get("incr")
    source = f"benchmarks/results/{out.get('incr_file') or out.get('file', '?')}"
    block = incr_report.render(inc if isinstance(inc, dict) else {}, source)
    return ["", *block.splitlines()]


def data_section(out: Result) -> list[str]:
    """The data position: resuming far into an epoch against re-iterating to it."""
    d = out.get("data")
    lines = ["", "## Data position (`resumable.data`)", ""]
    if not isinstance(d, dict) or "median_s" not in d:
        err = " ".join(str(_get(out, "data", "error") or "").split())
        return [*lines, f"Not measured{': ' + err[:300] if err else ''}."]
    med = d["median_s"]
    lines += [
        f"Until the first batch after sample {d['position']:,} of a {d['samples']:,}-sample "
        f"epoch (batch size {d['batch_size']}, shuffled, no workers, one torch thread; "
        f"medians of {d['reps']} reps, interleaved; the first batch is the same for all "
        f"three: {'yes' if d.get('same_first_batch') else 'NO'}). `benchmarks/data_bench.py` "
        "says what each does.",
        "",
    ]
    lines += _table(
        ["method", "median s", "÷ resume"],
        [
            ["`load_state_dict` + `next(iter(loader))`", _f(med["resume"], "{:.3f}"), "1"],
            [
                "skip the order's indices (a user's sampler)",
                _f(med["skip_indices"], "{:.3f}"),
                _f(d.get("skip_indices_over_resume"), "{}"),
            ],
            [
                "re-iterate: load and collate every batch before it",
                _f(med["reiterate"], "{:.3f}"),
                _f(d.get("reiterate_over_resume"), "{}"),
            ],
        ],
    )
    return lines


def _rank_files(m: dict[str, Any]) -> tuple[list[Any] | None, dict[str, int]]:
    """A method's data file sizes per rank, and its other files. Runs before 2026-11-28
    listed the background persist's files of ranks above 0 under *other* (the worker
    named rank 0's file only): they are moved back to their ranks here."""
    per_rank = _get(m, "bytes", "per_rank")
    other = dict(_get(m, "bytes", "other") or {})
    ranks = {
        int(k[5:10]): other.pop(k)
        for k in list(other)
        if k.startswith("rank-") and k.endswith(".safetensors") and k[5:10].isdigit()
    }
    if ranks and isinstance(per_rank, list):
        per_rank = list(per_rank) + [0] * (max(ranks) + 1 - len(per_rank))
        for r, size in ranks.items():
            per_rank[r] = size
    return per_rank, other


def dist_section(out: Result) -> list[str]:
    """Several ranks: per world size, each method's blocking and total time (slowest
    rank), total ÷ dcp.save's, and the bytes each rank wrote."""
    d = out.get("dist")
    lines = ["", "## Several ranks (FSDP2 on CPU, gloo)", ""]
    worlds = _get(out, "dist", "worlds")
    if not isinstance(d, dict) or not isinstance(worlds, dict) or not worlds:
        err = " ".join(str(_get(out, "dist", "error") or "").split())
        return [*lines, f"Not measured{': ' + err[:300] if err else ''}."]
    model = next((w["model"] for w in worlds.values() if isinstance(w, dict) and "model" in w), {})
    lines += [
        f"{model.get('what', 'An MLP')}: {_f(model.get('state_bytes', 0) / 2**20, '{:.1f}')} "
        "MiB of parameters and optimizer state in total, sharded with FSDP2 `fully_shard` "
        "(each Linear and the root) over a CPU device mesh of all ranks (a one-rank mesh "
        "at 1), one training step taken. Each world size is one `torchrun --standalone` "
        f"launch (gloo) with {d.get('reps')} timed rounds after {d.get('warmup', 1)} "
        "untimed ones (the first reported apart as *first*), the methods "
        "interleaved and the first of them rotating each round"
        + (
            f", then {d['pair_reps']} more rounds of resumable's background save and the "
            "copy floor alone, alternating which goes first (their medians are over all "
            "their rounds: the goal of several ranks reads their ratio)"
            if d.get("pair_reps")
            else ""
        )
        + "; all ranks meet at a barrier "
        "before each save, and each sample is the slowest rank's time. DCP's times "
        "include `get_state_dict`, as resumable's `save()` includes its own capture. "
        '*Blocking*: until the call returns; resumable with `persist="sync"` and '
        "`dcp.save` return after the durable commit, so blocking = total; resumable's "
        "default background persist returns after each rank's snapshot copy, and its "
        "workers commit together. *Total*: until the checkpoint is complete "
        "(`.result()`, `save()` + `wait()`). The copy floor copies each rank's state "
        "into buffers allocated once. *MiB per rank*: each rank's data file "
        "(`rank-RRRRR.safetensors`, `__R_0.distcp`); *other*: the manifest or `.metadata`, "
        f"written by rank 0. The ranks share the machine's {d.get('cpu_count', '?')} "
        "cores (`OMP_NUM_THREADS` = cores ÷ ranks).",
        "",
    ]
    rows = []
    for w, e in sorted(worlds.items(), key=lambda kv: int(kv[0])):
        if not isinstance(e, dict) or "methods" not in e:
            err = " ".join(str(_get(e, "error") or "?").split())
            rows.append([w, f"not measured: {err[:120]}"] + ["—"] * 8)
            continue
        base = _median(_get(e, "methods", "dcp_save", "total"))
        for name in DIST_ORDER:
            m = _get(e, "methods", name)
            if not isinstance(m, dict):
                continue
            b, t = _median(m.get("blocking")), _median(m.get("total"))
            per_rank, other = _rank_files(m)
            rows.append(
                [
                    w,
                    str(m.get("label", name)),
                    _s(b),
                    _s(t),
                    _x(_ratio(t, base)),
                    _s(_median(m.get("total"), "min")),
                    _s(_get(m, "total", "first")),
                    _mib_list(per_rank),
                    _f(sum(other.values()) / 2**10 if other else None, "{:.0f}"),
                    str(len(_get(m, "total", "samples") or [])),
                ]
            )
    lines += _table(
        [
            "ranks",
            "method",
            "blocking s",
            "total s",
            "total ÷ dcp.save's",
            "min total s",
            "first total s",
            "MiB per rank",
            "other KiB",
            "samples",
        ],
        rows,
    )
    lines += [
        "",
        "The background persist against its targets (medians; blocking and "
        "total are the slowest rank's). *Snapshot*: the capture and copy inside the "
        "background `save()` (`Checkpointer.last_snapshot_s`, the slowest rank's; the rest "
        "of *blocking* is agreeing whether the persist starts, one key in the coordination "
        "store since 2026-11-28T19 and the busy-flag all-reduce before, and handing the job "
        "to the worker; — for runs before 2026-11-28T14). *Loop*: segments of 50 training "
        "steps without "
        "checkpointing and with a memory snapshot every step and a persist at the "
        "segment's first step (`maybe_save`; the segment ends once that persist is "
        "committed), interleaved in pairs whose first alternates; each segment is the "
        "slowest rank's; *plain s* and *checkpointed s* sum them; throughput kept = "
        "median plain segment ÷ median checkpointed segment. Both are warmed up first: "
        "the plain loop by a run of its own, the checkpointer by its first save "
        "(`maybe_save(0)` + `wait()`: it starts the persist workers and allocates the "
        "shared memory), timed apart as *first save s*. *Overlap*: the same checkpointed "
        "segments with `overlap=True` (the parameters' and moments' copy runs behind the "
        "next forward and backward; `optimizer.step()` waits for it), a third kind of "
        "segment in the rotation (— for runs before 2026-11-28T14). (Runs before "
        "2026-11-28 timed one plain run, then one checkpointed run that included the "
        "first save.)",
        "",
    ]
    rows = []
    for w, e in sorted(worlds.items(), key=lambda kv: int(kv[0])):
        if not isinstance(e, dict) or "ratios" not in e:
            continue
        r = e["ratios"]
        loop = e.get("loop") or {}
        bgm = _get(e, "methods", "resumable_process") or {}
        rows.append(
            [
                w,
                _s(_median(bgm.get("blocking"))),
                _s(_median(bgm.get("snapshot"))),
                _s(_median(_get(e, "methods", "copy_floor", "blocking"))),
                _x(r.get("background_over_dcp_async_blocking")),
                _x(r.get("background_over_copy_floor_blocking")),
                _x(r.get("background_over_dcp_save_total")),
                f"{loop.get('steps', '—')}",
                _s(loop.get("first_save_s")),
                _s(loop.get("plain_s")),
                _s(loop.get("checkpointed_s")),
                _f(
                    100 * loop["throughput_ratio"] if loop.get("throughput_ratio") else None,
                    "{:.1f} %",
                ),
                _f(
                    100 * ov["throughput_ratio"]
                    if (ov := loop.get("overlap") or {}).get("throughput_ratio")
                    else None,
                    "{:.1f} %",
                ),
            ]
        )
    lines += _table(
        [
            "ranks",
            "blocking s",
            "snapshot s",
            "copy floor s",
            "blocking ÷ dcp.async_save's (≤ 1)",
            "blocking ÷ copy floor (≤ 1.5)",
            "total ÷ dcp.save's (≤ 1.1)",
            "loop steps",
            "first save s",
            "plain s",
            "checkpointed s",
            "throughput kept (≥ 95 %)",
            "same, overlap=True",
        ],
        rows,
    )
    return lines + _dist_layers(worlds)


def _dist_layers(worlds: Mapping[str, Any]) -> list[str]:
    """Where the background save's blocking goes (`dist_bench.layers`), per world size:
    the slowest rank's means over the rounds with its layers timed."""
    rows = []
    for w, e in sorted(worlds.items(), key=lambda kv: int(kv[0])):
        lay = _get(e, "methods", "resumable_process", "layers")
        if not isinstance(lay, dict) or not isinstance(lay.get("per_rank_ms"), list):
            continue
        m = lay["per_rank_ms"][lay["slowest"]]
        floor, blocking, copy = m["floor"], m["blocking"], m["copy"]
        rows.append(
            [
                w,
                str(len(lay.get("rounds") or ())),
                str(lay["slowest"]),
                _f(floor, "{:.2f}"),
                _f(blocking, "{:.2f}"),
                _x(_ratio(blocking, floor)),
                _f(copy, "{:.2f}"),
                _x(_ratio(copy, floor)),
                _f(blocking - copy, "{:.2f}"),
                _f(m.get("capture"), "{:.2f}"),
                _f(m.get("slot"), "{:.2f}"),
                _f(m.get("ask", 0.0) + m.get("answer", 0.0), "{:.2f}"),
                _f(m.get("hand_off"), "{:.2f}"),
                _f(m.get("rest"), "{:.2f}"),
            ]
        )
    if not rows:  # runs before 2026-12-07
        return []
    return [
        "",
        "Where the background `save()`'s blocking goes: after the timed rounds, more rounds "
        "of the copy floor then the background save (+ `wait()`) with the layers of the "
        "save timed where they run (`benchmarks/timed_parts.py`; the timers stay out of the "
        "timed rounds). Means over those rounds of the rank whose mean `save()` is the "
        "longest, in milliseconds (means, so that the layers add up to the blocking, as "
        "in each round). *Copy*: into the shared-memory slot; *capture*: the walk of the "
        "state and the random streams; *slot*: the rest of the snapshot (the copy plan's "
        "check, choosing and marking the slot, its metadata); *decision*: asking the "
        "other ranks whether the persist starts (through the coordination store, on a "
        "thread, before the copy) and waiting for the answer after it; *hand-off*: the "
        "job to the persist worker (rank 0 also appends its `save_start` entry to the "
        "audit log); *rest*: the bookkeeping of `save()` (the blocking less the snapshot, "
        "the decision and the hand-off).",
        "",
        *_table(
            [
                "ranks",
                "rounds",
                "rank",
                "copy floor ms",
                "`save()` ms",
                "÷ floor",
                "copy ms",
                "copy ÷ floor",
                "beside the copy ms",
                "capture ms",
                "slot ms",
                "decision ms",
                "hand-off ms",
                "rest ms",
            ],
            rows,
        ),
    ]


def write_report(results: Path, docs: Path) -> None:
    """Render ``docs`` from the run in ``results``. A run without the small-tensor phase
    (``--no-small``, or from before it) shows the newest standalone one beside it
    (``small_bench.py --docs`` writes ``small-<date>.json``), named as such; the same for
    the DeepSpeed phase (``ds_bench.py --docs``, ``ds-<date>.json``) and the Megatron-Core
    phase (``mcore_bench.py --docs``, ``mcore-<date>.json``) and the incremental
    checkpoints phase (``incr_bench.py --docs``, ``incr-<date>.json``); so does a run
    older than the newest standalone file of that phase (a phase measured again)."""
    out = json.loads(results.read_text())
    out.setdefault("file", results.name)
    phases: list[tuple[str, Callable[[Any], bool], Callable[[Path], Path | None]]] = [
        ("small", small_report.measured, newest_small),
        ("ds", ds_bench.measured, ds_bench.newest),
        ("mcore", mcore_bench.measured, mcore_bench.newest),
        ("incr", incr_report.measured, incr_report.newest),
    ]
    for key, measured, newest_of in phases:
        found = newest_of(results.parent)
        if found is None:
            continue
        if not measured(out.get(key)) or _stamp(found) > _stamp(results):
            out[key] = json.loads(found.read_text())
            out[f"{key}_file"] = found.name
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(render(out))


def _stamp(path: Path) -> str:
    """The UTC time stamp in a results file's name (``<prefix>-YYYYMMDDTHHMMSSZ.json``)."""
    return path.stem.rsplit("-", 1)[-1]


def newest(results_dir: Path) -> Path:
    """The newest whole run (``make bench``) in ``results_dir``; the files one phase
    writes alone (``data-``, ``cloud-``, ``small-``, ``ds-``, ``mcore-``, ``incr-``,
    ``piece-check-``) are not runs."""
    runs = []
    for p in sorted(results_dir.glob("*.json")):
        try:
            out = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(out, dict) and "methods" in out:
            runs.append((str(out.get("date", "")), p.stat().st_mtime, p))
    if not runs:
        raise FileNotFoundError(f"no results JSON in {results_dir}: run `make bench` first")
    return max(runs)[2]


def newest_small(results_dir: Path) -> Path | None:
    """The newest standalone small-tensor result (``small-<date>.json``: the date sorts;
    other ``small-`` files, an experiment's, are not one)."""
    files = sorted(p for p in results_dir.glob("small-*.json") if _DATED.fullmatch(p.stem))
    return files[-1] if files else None


_DATED = re.compile(r"[a-z-]+-\d{8}T\d{6}Z")


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else newest(HERE / "results")
    docs = REPO / "docs" / "performance.md"
    write_report(path, docs)
    print(f"regenerated {docs} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
