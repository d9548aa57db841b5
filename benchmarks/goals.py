"""Every path against its goal, and the floor measured beside it in the same run.

`goals` reads one results JSON of `make bench` (the core phases, the small-tensor,
several-ranks, DeepSpeed, Megatron-Core and short HF Trainer runs phases) and gives, per
path, the ratio that decides it, the goal, and what bounds it from below in that run:
the copy floor of the same rounds, the copy + checksum floor a verified restore cannot
go under, the share of an iteration that copying the state alone takes, the same path
at one rank. Where that bound alone is past the goal, the goal cannot be met on this
machine in that mode, and the row says so (*bound by the floor*); a miss with room left
above the floor says *not met*. `goals_section` renders them for ``docs/performance.md``.

Nothing here is typed by hand: each figure is a median (or the ratio of two medians) of
the run it reads, and a path the run did not measure is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from small_report import loop_sentence

Result = dict[str, Any]


def _get(out: Any, *path: str) -> Any:
    cur = out
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _med(entry: Any, key: str = "median") -> float | None:
    if isinstance(entry, dict):
        return _num(entry.get(key))
    return _num(entry)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _goal(
    path: str,
    measured: float | None,
    unit: str,
    op: str,
    limit: float,
    bound: float | None,
    why: str,
    note: str = "",
) -> dict[str, Any] | None:
    """One row; ``bound``: the best ``measured`` the floor named in ``why`` allows."""
    if measured is None:
        return None

    def meets(v: float) -> bool:
        return v <= limit if op == "<=" else v >= limit

    if meets(measured):
        result = "met"
    elif bound is not None and not meets(bound):
        result = "bound by the floor"
    else:
        result = "not met"
    return {
        "path": path,
        "measured": measured,
        "unit": unit,
        "op": op,
        "limit": limit,
        "bound": bound,
        "result": result,
        "why": why,
        "note": note,
    }


def _core(out: Result) -> list[dict[str, Any] | None]:
    res = _get(out, "methods", "resumable") or {}
    floors = _get(out, "floors") or {}
    rows: list[dict[str, Any] | None] = []
    save = _med(res.get("save_blocking"))
    snap_here = _med(res.get("snapshot_save_phase"))
    copy_save = _med(floors.get("copy_save_phase"))
    copy_mem = _med(floors.get("copy_memory_phase"))
    rows.append(
        _goal(
            "`save()` blocking, a persist starting (1 GiB, process mode) ÷ a snapshot "
            "alone in the same rounds",
            _div(save, snap_here),
            "x",
            "<=",
            1.1,
            None,
            f"its own snapshot took {_f(_med(res.get('save_snapshot_part')), 's')} of the "
            f"{_f(save, 's')}; the copy floor of the save rounds {_f(copy_save, 's')}, of "
            f"the memory phase {_f(copy_mem, 's')}",
        )
    )
    restore = _med(res.get("restore_memory"))
    copy_r = _med(floors.get("copy_restore_memory"))
    hash_r = _med(floors.get("hash_restore_memory"))
    # the fastest copy that checks what it copies (both cores, no restore around it)
    # against the fastest plain copy: the best such a restore can do here
    checked = _med(floors.get("checked_copy_restore_memory"), "min")
    checked_bound = _div(checked, _med(floors.get("copy_restore_memory"), "min"))
    between = copy_r is not None
    if not between:  # runs before the floor was sampled between the restores
        copy_r = _med(floors.get("copy"))
    rows.append(
        _goal(
            "restore from shared memory ÷ the copy floor"
            + (" sampled between those restores" if between else " of the run")
            + ", every checksum verified",
            _div(restore, copy_r),
            "x",
            "<=",
            1.1,
            checked_bound,
            (
                f"the fastest copy that computes the XXH3-64 of what it copies, block by "
                f"block on the copy threads, alone: {_f(checked, 's')}, "
                f"{_f(checked_bound, 'x')} the fastest plain copy; "
                if checked_bound is not None
                else ""
            )
            + (
                f"÷ (copy + XXH3-64 of the same bytes, one thread each, "
                f"{_f(_sum(copy_r, hash_r), 's')}): "
                f"{_f(_div(restore, _sum(copy_r, hash_r)), 'x')}: "
                if hash_r is not None
                else ""
            )
            + f"the restore {_f(restore, 's')}, the copy {_f(copy_r, 's')}; a restore that "
            "trusts no byte before its checksum hashes every byte as well as copying it, "
            "on the machine's two cores",
        )
    )
    cold = _med(res.get("restore_cold"))
    peers: dict[str, float] = {}
    for name in out.get("methods") or {}:
        v = _med(_get(out, "methods", name, "restore_cold"))
        if name != "resumable" and v is not None:
            peers[name] = v
    ab = out.get("restore_cold_ab")
    if peers:
        fastest = min(peers, key=lambda k: peers[k])
        label = _get(out, "methods", fastest, "label") or fastest
        read = _med(floors.get("read_cold"))
        round_robin = (
            f"resumable {_f(cold, 's')}, {label} {_f(peers[fastest], 's')}; the cold "
            f"read floor {_f(read, 's')}"
        )
        measured, why = _div(cold, peers[fastest]), round_robin
        bound = None
        if isinstance(ab, dict) and _num(ab.get("ratio_of_medians")) is not None:
            # the fastest of several peers' medians, compared with that same median, is
            # the luckiest of them: decided on samples of their own (run.cold_ab)
            ab_label = _get(out, "methods", ab.get("peer"), "label") or ab.get("peer")
            measured = _num(ab["ratio_of_medians"])
            ab_read = _med(ab.get("read_floor"))
            # no restore reads its bytes faster than a plain read of as many: the best
            # ratio the disk allows is that read's time over the peer's restore
            bound = _div(ab_read, _med(ab.get("peer_restore")))
            start = (
                "each after an unrelated file read through and a page-cache drop, "
                "the first of a round rotating"
                if ab.get("cold_start", "").startswith("flush")
                else "page cache dropped before each restore, the first of a pair alternating"
            )
            why = (
                f"timed again in {ab.get('pairs')} rounds after the round-robin named the "
                f"fastest peer ({start}): resumable {_f(_med(ab.get('resumable')), 's')}, "
                f"{ab_label} {_f(_med(ab.get('peer_restore')), 's')}"
                + (f", the cold read floor {_f(ab_read, 's')}" if ab_read is not None else "")
                + f"; median of the rounds' ratios {_f(_num(ab.get('median_pair_ratio')), 'x')}"
                f"; in the round-robin {_f(_div(cold, peers[fastest]), 'x')}: " + round_robin
            )
        rows.append(
            _goal(
                "cold restore from local disk (1 GiB) ÷ the fastest peer's in the same run",
                measured,
                "x",
                "<=",
                1.0,
                bound,
                why,
            )
        )
    e2e: dict[str, Any] = out["e2e"] if isinstance(out.get("e2e"), dict) else {}
    step = _num(e2e.get("step_ms_baseline"))
    nbytes = _num(e2e.get("state_bytes"))
    run_bytes = _num(_get(out, "state", "bytes"))
    # A floor is the fastest sample: other jobs on this shared machine only add time.
    copy = _med(floors.get("copy"), "min")
    copy_ms = None
    if nbytes and run_bytes and copy:
        copy_ms = copy * nbytes / run_bytes * 1000
    bound = None if step is None or copy_ms is None else step / (step + copy_ms)
    why = (
        f"copying its {_f(nbytes and nbytes / 2**20, 'MiB')} at the copy floor's "
        "bandwidth (its fastest sample) "
        f"takes {_f(copy_ms, 'ms')} of a {_f(step, 'ms')} step: a snapshot that blocks "
        f"keeps at best {_f(bound, '')}"
    )
    # The bound, where the run timed it: the same copy in the loop, after each step of a
    # segment of its own (`training._timed_kind`), its fastest sample: where a snapshot runs,
    # right after a step, rather than the 1 GiB copy floor's bandwidth scaled.
    in_loop = _num(_get(e2e, "floor_copy_s", "min"))
    if step is not None and in_loop is not None:
        loop_ms = in_loop * 1000
        bound = step / (step + loop_ms)
        why = (
            f"the same tensors copied into memory allocated once (`_foreach_copy_`), timed "
            f"in the loop after each step of a segment of its own: fastest "
            f"{_f(loop_ms, 'ms')} (median "
            f"{_f(_ms(_num(_get(e2e, 'floor_copy_s', 'median'))), 'ms')}) of a "
            f"{_f(step, 'ms')} step: a snapshot that blocks keeps at best {_f(bound, '')}; "
            f"at the 1 GiB copy floor's bandwidth the copy would take {_f(copy_ms, 'ms')}"
        )
    # The least snapshot that keeps the guarantees, where the run timed it in the loop
    # (`training._timed_kind`): its fastest call bounds the snapshot where it is past the copy.
    guarded = _num(_get(e2e, "guarded_call_s", "min"))
    if step is not None and guarded is not None:
        floor_ms = max(guarded * 1000, (in_loop or 0) * 1000)
        bound = step / (step + floor_ms)
        why += (
            "; the least snapshot that keeps the guarantees (`small_bench.guarded_snapshot`: "
            "the structure and tensor checks, two slots taken in turn, the optimizer groups "
            "and random streams in a record with its digest), timed in the loop the same way: "
            f"fastest {_f(guarded * 1000, 'ms')} (median "
            f"{_f(_ms(_num(_get(e2e, 'guarded_call_s', 'median'))), 'ms')}, `maybe_save` "
            f"{_f(_ms(_med(e2e.get('maybe_save_s'))), 'ms')}): a snapshot with those "
            f"guarantees keeps at best {_f(bound, '')}"
        )
    if e2e.get("interleaved") == "step" and _num(e2e.get("total_ratio")) is not None:
        overlap = "overlap mode: " + _f(_num(_get(out, "e2e_overlap", "throughput_ratio")), "")
        rows.append(_loop_interleaved(e2e, overlap))
        return rows
    # Two estimates of the same ratio: the segments' medians, and the median of the
    # adjacent pairs' ratios (ABBA order, which cancels the machine's drift); the row
    # takes the smaller, as the nanoGPT rows take the larger of their two overheads, so
    # that no single estimate's lucky draw decides it.
    medians, pairs = _num(e2e.get("throughput_ratio")), _num(e2e.get("median_pair_ratio"))
    measured = medians if pairs is None or medians is None else min(medians, pairs)
    estimates = (
        ""
        if pairs is None
        else f"the smaller of the ratio of the segments' medians ({_f(medians, '')}) and the "
        f"median of the adjacent pairs' ratios ({_f(pairs, '')}); "
    )
    rows.append(
        _loop_row(
            measured,
            bound,
            estimates + why + "; the snapshot blocked "
            f"{_f(_ms(_med(e2e.get('snapshot_blocking_s'))), 'ms')} in the loop"
            + _fused_e2e(e2e)
            + _cold_warm(e2e),
            "overlap mode: " + _f(_num(_get(out, "e2e_overlap", "throughput_ratio")), ""),
        )
    )
    return rows


def _loop_interleaved(e2e: Mapping[str, Any], note: str) -> dict[str, Any] | None:
    """The MLP loop's row for a run whose kinds took turns step by step (from
    `vm-20261207T212801Z` on; `training._interleave`). Its throughput kept is the smaller of two
    estimates: the ratio of the baseline's and the checkpointed kind's total times,
    and the median of the rounds' ratios. Its floor is a throughput too, measured the
    same way: the least snapshot that keeps the guarantees (`guarded_snapshot`) in
    place of ``maybe_save`` in the same loop, the larger of its two estimates (the
    copy alone's, where the run has no guarded kind), so that the row is bound by it
    only where even that estimate misses the goal."""

    def kept(kind: str) -> tuple[float | None, float | None]:
        if kind == "checkpointed":
            return _num(e2e.get("total_ratio")), _num(e2e.get("median_pair_ratio"))
        return _num(e2e.get(f"{kind}_total_ratio")), _num(e2e.get(f"{kind}_pair_ratio"))

    total, pairs = kept("checkpointed")
    measured = total if pairs is None or total is None else min(total, pairs)
    bound = None
    floor_text = ""
    for kind, what in (
        (
            "guarded",
            "the least snapshot that keeps the guarantees (`small_bench.guarded_snapshot`"
            ": the structure and tensor checks, two slots taken in turn, the optimizer groups "
            "and random streams in a record with its digest)",
        ),
        (
            "floor",
            "the copy alone (the same tensors copied into memory allocated once, "
            "`small_bench.loop_floor`)",
        ),
    ):
        t, q = kept(kind)
        if t is None:
            continue
        best = t if q is None else max(t, q)
        if bound is None:
            bound = best
            floor_text = (
                f"; in place of `maybe_save` in the same loop, {what} kept {_f(t, '')} "
                f"(totals) and {_f(q, '')} (rounds' ratios): a snapshot with those "
                f"guarantees keeps at best {_f(best, '')}"
            )
        else:
            floor_text += f"; the copy alone kept {_f(t, '')} and {_f(q, '')}"
    calls = []
    for key, name in (
        ("maybe_save_s", "`maybe_save`"),
        ("fused_call_s", "the same snapshot with the library's layers fused into one call"),
        ("guarded_call_s", "the guarded snapshot"),
        ("floor_copy_s", "the copy alone"),
    ):
        got = e2e.get(key)
        if isinstance(got, dict) and _num(got.get("median")) is not None:
            calls.append(
                f"{name} {_f(_ms(_num(got.get('mean'))), 'ms')} (median "
                f"{_f(_ms(_num(got.get('median'))), 'ms')}"
                + (
                    f", fastest {_f(_ms(_num(got.get('min'))), 'ms')}"
                    if _num(got.get("min")) is not None
                    else ""
                )
                + ")"
            )
    step_s = _num(_get(e2e, "baseline_step_s", "median"))
    fused = kept("fused")[0]
    spill = _ms(_num(_get(e2e, "persist_spill", "per_checkpointed_step_s")))
    guarded_min = _num(_get(e2e, "guarded_call_s", "min"))
    fastest = (
        ""
        if step_s is None or guarded_min is None
        else f"; at its fastest call every step, the guarded snapshot would keep "
        f"{_f(step_s / (step_s + guarded_min), '')}"
    )
    why = (
        "the kinds took turns step by step (ABBA), "
        f"{e2e.get('rounds')} rounds of "
        f"{e2e.get('steps_per_segment')} steps each; throughput kept: the smaller of the "
        f"ratio of the baseline's and the checkpointed steps' total times ({_f(total, '')}) "
        f"and the median of the rounds' ratios ({_f(pairs, '')}; ratio of the rounds' "
        f"medians {_f(_num(e2e.get('throughput_ratio')), '')})"
        + floor_text
        + (f"; the fused snapshot kept {_f(fused, '')}" if fused is not None else "")
        + (
            f"; the steps' median {_f(_ms(step_s), 'ms')} without checkpoints, "
            f"{_f(_ms(_num(_get(e2e, 'checkpointed_step_s', 'median'))), 'ms')} after a "
            "`maybe_save`"
            if step_s is not None
            else ""
        )
        + ("; each call's mean: " + ", ".join(calls) if calls else "")
        + fastest
        + (
            f"; a persist's background work slowed the steps beside it by "
            f"{_f(spill, 'ms')} per checkpointed step (charged to them)"
            if spill is not None
            else ""
        )
        + _cold_warm(e2e)
    )
    return _loop_row(measured, bound, why, note)


def _loop_row(
    measured: float | None, bound: float | None, why: str, note: str
) -> dict[str, Any] | None:
    return _goal(
        "training loop, a snapshot every step, no overlap (MLP): throughput kept",
        measured,
        "",
        ">=",
        0.97,
        bound,
        why,
        note,
    )


def _fused_e2e(e2e: Mapping[str, Any]) -> str:
    """``maybe_save`` in the MLP loop against the library's own snapshot with its layers
    fused into one call (`small_bench.fused_snapshot`), where the run timed both."""
    fused = _num(_get(e2e, "fused_call_s", "median"))
    calls = _num(_get(e2e, "maybe_save_s", "median"))
    if fused is None or calls is None:
        return ""
    return (
        f"; `maybe_save` took {_f(_ms(calls), 'ms')} (median), the same snapshot with the "
        f"library's layers fused into one call {_f(_ms(fused), 'ms')} (segments of it kept "
        f"{_f(_num(e2e.get('fused_throughput_ratio')), '')})"
    )


def _cold_warm(e2e: Mapping[str, Any]) -> str:
    """What the snapshot does beside its copy, right after a step and right after
    another snapshot (`training.cold_and_warm`), where the run timed both."""
    cold, copy_cold, warm, copy_warm = (
        _num(_get(e2e, "cold_warm", k, "median")) for k in _COLD_WARM
    )
    if cold is None or copy_cold is None or warm is None or copy_warm is None:
        return ""
    return (
        f"; right after a step `maybe_save` took {_f(_ms(cold), 'ms')} and the copy "
        f"alone {_f(_ms(copy_cold), 'ms')}, straight after another call "
        f"{_f(_ms(warm), 'ms')} and {_f(_ms(copy_warm), 'ms')}: the snapshot's work "
        f"beside the copy costs {_f(_ms(cold - copy_cold), 'ms')} after a step and "
        f"{_f(_ms(warm - copy_warm), 'ms')} after another snapshot"
    )


_COLD_WARM = ("maybe_save_cold_s", "floor_cold_s", "maybe_save_warm_s", "floor_warm_s")


def _small(out: Result) -> list[dict[str, Any] | None]:
    rows: list[dict[str, Any] | None] = []
    for name, limit in (("tiny", 3.0), ("6-layer", 1.0)):
        m = _get(out, "small", "models", name)
        if not isinstance(m, dict):
            continue
        off_ms = _num(m.get("median_off_ms"))
        copies = [
            _med(_get(m, "methods", k), "median_us")
            for k in ("loop_copy", "foreach_copy", "flat_copy")
        ]
        floor_us = min((c for c in copies if c is not None), default=None)
        share = None if off_ms is None or floor_us is None else floor_us / (off_ms * 1000) * 100
        # The bound: the same copy timed where the snapshot runs, after each iteration of
        # a block of its own (`small_bench.loop_floor`: on the copy threads from 8 MiB,
        # 32 MiB in runs before 2026-12-07, as a snapshot copies). A run without it (all
        # from before that day): the copies timed in a row, on one
        # thread, which bound nothing from 32 MiB (the snapshot copies on the threads).
        # Its fastest sample, as every floor here (other jobs only ever add time); a run
        # without the samples: the median it recorded.
        median_pct = _num(m.get("loop_floor_pct"))
        samples = [x for x in m.get("loop_floor_us") or [] if _num(x) is not None]
        fastest_us = min(samples) if samples else None
        loop = median_pct
        if fastest_us is not None and off_ms:
            loop = fastest_us / (off_ms * 1000) * 100
        threads = m.get("loop_floor_threads")
        threaded = (_num(m.get("bytes")) or 0) >= 32 << 20
        # the median of the rounds' ratios (runs from 2026-12-07 on), else the ratio of medians
        overhead = _num(m.get("paired_overhead_pct", m.get("overhead_pct")))
        alone = _num(m.get("maybe_save_pct"))
        measured = None if overhead is None else max(overhead, alone or overhead)
        if loop is not None:
            bound = loop
            how = (
                "the same tensors copied into memory allocated once (`_foreach_copy_`"
                + (f", cut in 16 MiB pieces over {threads} copy threads" if threads != 1 else "")
                + "), timed in the loop after each iteration of a block of its own: "
                + (f"fastest {_f(fastest_us, 'µs')}, " if fastest_us is not None else "")
                + f"{_f(loop, '%')} of the {_f(off_ms, 'ms')} iteration (median "
                f"{_f(_num(m.get('median_loop_floor_us')), 'µs')}, {_f(median_pct, '%')}); "
                f"timed in a row of copies (one thread) {_f(share, '%')}"
            )
        else:
            bound = None if threaded else share
            how = (
                "the fastest copy of the same tensors into memory allocated once (a "
                "`copy_` loop, `_foreach_copy_`, one flat copy; one thread), alone: "
                f"{_f(share, '%')} of the {_f(off_ms, 'ms')} iteration"
                + ("; not a bound: the snapshot copies on the copy threads" if threaded else "")
            )
        how += _least(m, off_ms)
        guarded = _guarded(m, off_ms)
        if guarded is not None:  # runs from 2026-12-07 on: the floor of a whole snapshot
            bound = guarded[0] if bound is None else max(bound, guarded[0])
            how += guarded[1]
        rows.append(
            _goal(
                f"nanoGPT {name} ({m.get('tensors')} tensors), a snapshot every step, no "
                "overlap: % per iteration",
                measured,
                "%",
                "<=",
                limit,
                bound,
                how
                + f"; `maybe_save` alone {_f(alone, '%')}"
                + (
                    f" ({alone / median_pct:.1f}x the copy's median in the loop)"
                    if alone is not None and median_pct
                    else ""
                )
                + _profile(m, limit, off_ms)
                + _in_loop(m),
                "overlap mode: " + _f(_num(_overlap_pct(m)), "%"),
            )
        )
    return rows


def _overlap_pct(m: Mapping[str, Any]) -> Any:
    """The overlap mode's overhead: the median of the rounds' ratios (runs from
    2026-12-07 on), else the ratio of medians."""
    return m.get("paired_overlap_overhead_pct", m.get("overlap_overhead_pct"))


def _least(m: Mapping[str, Any], off_ms: float | None) -> str:
    """The least any snapshot of the model does, timed in the loop (`small_bench.
    least_snapshot`: its dicts' version tags compared, one `_foreach_copy_` into shared
    memory, the random streams read, a record written): what a snapshot path fused
    into one call would cost there. Not the bound: it skips checks a snapshot needs."""
    samples = [x for x in m.get("least_us") or [] if _num(x) is not None]
    median = _num(m.get("median_least_us"))
    if not samples or median is None or not off_ms:
        return ""
    fastest = min(samples)
    return (
        "; the least any snapshot does, fused into one call (its "
        f"{m.get('least_dicts')} dicts' version tags compared, the same copy into shared "
        "memory, the random streams read, a record of the step written), timed in the loop "
        f"after each iteration of a block of its own: fastest {_f(fastest, 'µs')}, "
        f"{_f(fastest / (off_ms * 1000) * 100, '%')} (median {_f(median, 'µs')}, "
        f"{_f(_num(m.get('least_pct')), '%')})" + _fused(m)
    )


def _guarded(m: Mapping[str, Any], off_ms: float | None) -> tuple[float, str] | None:
    """The least a snapshot that keeps the library's guarantees does, timed in the loop
    (`small_bench.guarded_snapshot`), where a run has it: its fastest sample as a % of
    the median iteration (the row's bound: no snapshot that is neither wrong nor torn
    goes below it), and the clause that says so."""
    samples = [x for x in m.get("guarded_us") or [] if _num(x) is not None]
    median = _num(m.get("median_guarded_us"))
    if not samples or median is None or not off_ms:
        return None
    fastest = min(samples) / (off_ms * 1000) * 100
    return fastest, (
        "; the least a snapshot that keeps the library's guarantees does (that call, plus "
        "each module's class, non-persistent buffers and state-dict methods compared, every "
        "tensor's dtype, shape, strides and device checked, two slots taken in turn with a "
        "sequence odd while one is written, every group's values recorded and the record's "
        f"digest), the bound: fastest {_f(min(samples), 'µs')}, {_f(fastest, '%')} (median "
        f"{_f(median, 'µs')}, {_f(_num(m.get('guarded_pct')), '%')})"
    )


def _fused(m: Mapping[str, Any]) -> str:
    """The library's own snapshot with its layers fused into one call, timed in the loop
    (`small_bench.fused_snapshot`): what fusing them would give, where a run has it."""
    median = _num(m.get("median_fused_us"))
    if median is None:
        return ""
    return (
        "; the library's own snapshot with its layers fused into one call (the same checks, "
        "streams, metadata and slot; no facade, schedule, poll or fallback): median "
        f"{_f(median, 'µs')}, {_f(_num(m.get('fused_pct')), '%')}"
    )


def _profile(m: Mapping[str, Any], limit: float, off_ms: float | None) -> str:
    """Where a small model's snapshot goes (`small_bench.parts`: its pieces timed apart,
    out of the loop) against what the goal leaves beside the copy: the miss's profile."""
    p = m.get("parts_us")
    total = _num(p.get("total")) if isinstance(p, dict) else None
    if not isinstance(p, dict) or total is None or not off_ms:
        return ""
    names = (
        ("copy", "the copy"),
        ("capture_walk", "the capture walk"),
        ("rng", "the random streams (Python's, NumPy's and torch's, each advanced before)"),
        ("plan_check", "the structure check"),
        ("metadata", "the metadata"),
        ("other", "the rest (slot, publish, schedule)"),
    )
    shown = [f"{label} {_f(_num(p.get(k)), 'µs')}" for k, label in names if _num(p.get(k))]
    copy = _num(p.get("copy")) or 0.0
    beside = total - copy
    room = limit / 100 * off_ms * 1000 - (_num(m.get("median_loop_floor_us")) or copy)
    if room <= 0:  # the copy alone is past the goal: the floor says it all
        return ""
    return (
        f"; a snapshot timed apart, {_f(total, 'µs')}: "
        + ", ".join(shown)
        + f"; the Python work beside the copy, {_f(beside, 'µs')}, against the "
        f"{_f(room, 'µs')} the goal leaves beside the copy's median in the loop"
    )


def _in_loop(m: Mapping[str, Any]) -> str:
    """`small_bench.loop_parts`' words, as a clause: the copy inside `maybe_save` against
    the copy floor in the loop, and the work beside it against its time in a row."""
    words = loop_sentence(dict(m)).strip().rstrip(".")
    return f"; {words[:1].lower()}{words[1:]}" if words else ""


def _dist(out: Result) -> list[dict[str, Any] | None]:
    worlds = _get(out, "dist", "worlds") or {}
    rows: list[dict[str, Any] | None] = []
    one = worlds.get("1") if isinstance(worlds.get("1"), dict) else {}

    def ratio(w: Any, key: str) -> float | None:
        return _div(
            _med(_get(w, "methods", "resumable_process", key)),
            _med(_get(w, "methods", "copy_floor", "blocking")),
        )

    cores = _num(_get(out, "dist", "cpu_count")) or _num(_get(out, "machine", "cpu_count"))
    for size, w in sorted(worlds.items(), key=lambda kv: int(kv[0])):
        if size == "1" or not isinstance(w, dict):
            continue
        cpu_floor = _med(_get(w, "methods", "copy_floor", "cpu_per_rank"))
        cpu_save = _med(_get(w, "methods", "resumable_process", "cpu_per_rank"))
        turns = ""
        if cpu_floor is not None and cpu_save is not None:
            turns = (
                f"; CPU time per rank (median): the copy {_f(cpu_floor * 1e3, 'ms')}, "
                f"`save()` {_f(cpu_save * 1e3, 'ms')} ({_f(_div(cpu_save, cpu_floor), 'x')})"
            )
            if cores and int(size) > cores:
                turns += (
                    f"; {size} ranks on {cores:g} cores take turns: the slowest rank waits "
                    f"for about {size} ranks' CPU time over {cores:g} cores (the copy "
                    f"{_f(cpu_floor * int(size) / cores * 1e3, 'ms')}, `save()` "
                    f"{_f(cpu_save * int(size) / cores * 1e3, 'ms')}); one core per rank "
                    "(the 2-rank row) leaves each its own"
                )
        span = _div(
            _med(_get(w, "methods", "resumable_process", "span_blocking")),
            _med(_get(w, "methods", "copy_floor", "span_blocking")),
        )
        if span is not None:  # runs from 2026-12-05T11 on
            path = (
                f"{size} ranks (FSDP2): `save()` blocking ÷ the copy floor, each from the "
                "first rank's start to the last rank's return"
            )
            n = len(_get(w, "methods", "resumable_process", "span_blocking", "samples") or ())
            spans = (
                f"medians of {n} rounds each; "
                f"the slowest rank's own time ÷ the floor's {_f(ratio(w, 'blocking'), 'x')} "
                f"(the floor's median {_f(_method_ms(w, 'copy_floor', 'blocking'), 'ms')}, its "
                f"span {_f(_method_ms(w, 'copy_floor', 'span_blocking'), 'ms')}; `save()` "
                f"{_f(_method_ms(w, 'resumable_process', 'blocking'), 'ms')} and "
                f"{_f(_method_ms(w, 'resumable_process', 'span_blocking'), 'ms')}); "
            )
        else:
            path, spans = f"{size} ranks (FSDP2): `save()` blocking ÷ the copy floor", ""
        rows.append(
            _goal(
                path,
                ratio(w, "blocking") if span is None else span,
                "x",
                "<=",
                1.3,
                None,
                spans + f"of which the snapshot {_f(ratio(w, 'snapshot'), 'x')}; at one rank "
                f"{_f(ratio(one, 'blocking'), 'x')} (snapshot {_f(ratio(one, 'snapshot'), 'x')})"
                f"; {size} ranks share the machine's {out.get('machine', {}).get('cpu_count', '?')}"
                " cores, each rank's fixed work taking turns with the others'"
                + turns
                + _layers(_get(w, "methods", "resumable_process", "layers")),
            )
        )
    return rows


def _layers(layers: Any) -> str:
    """`dist_bench.layers` in words, as a clause: the slowest rank's background save in
    the rounds with its layers timed, against its copy floor in the same rounds."""
    if not isinstance(layers, dict):  # runs before 2026-12-07
        return ""
    per_rank, slowest = layers.get("per_rank_ms"), layers.get("slowest")
    if not isinstance(per_rank, list) or not isinstance(slowest, int):
        return ""
    m = per_rank[slowest]
    floor, blocking, copy = (_num(m.get(k)) for k in ("floor", "blocking", "copy"))
    if floor is None or blocking is None or copy is None:
        return ""
    agree = (_num(m.get("ask")) or 0.0) + (_num(m.get("answer")) or 0.0)
    n = len(layers.get("rounds") or ())
    return (
        f"; in {n} more rounds with the save's layers timed, the slowest rank (rank "
        f"{slowest}, means): `save()` {_f(blocking, 'ms')} against its copy floor "
        f"{_f(floor, 'ms')} ({_f(_div(blocking, floor), 'x')}); the copy inside it "
        f"{_f(copy, 'ms')} ({_f(_div(copy, floor), 'x')} the floor); the work beside the "
        f"copy {_f(blocking - copy, 'ms')}: the capture {_f(_num(m.get('capture')), 'ms')}, "
        f"the slot and its metadata {_f(_num(m.get('slot')), 'ms')}, the other ranks' "
        f"decision whether the persist starts {_f(agree, 'ms')}, the hand-off to the "
        f"persist worker {_f(_num(m.get('hand_off')), 'ms')}, the rest of `save()`'s "
        f"bookkeeping {_f(_num(m.get('rest')), 'ms')}"
    )


def _method_ms(w: Any, method: str, key: str) -> float | None:
    """The median ``key`` of ``method`` in the world ``w``, in milliseconds."""
    return _ms(_med(_get(w, "methods", method, key)))


def _frameworks(out: Result) -> list[dict[str, Any] | None]:
    rows: list[dict[str, Any] | None] = []
    for stage, st in sorted((_get(out, "ds", "stages") or {}).items()):
        r = _get(st, "ratios") or {}
        rmin = _get(st, "ratios_of_min") or {}
        z = f"DeepSpeed ZeRO {stage}"
        rows.append(
            _goal(
                f"{z}: `save()` + `wait()` ÷ `save_checkpoint` + fsync",
                _num(r.get("auto_total_over_ds_durable")),
                "x",
                "<=",
                1.0,
                None,
                f"fastest samples {_f(_num(rmin.get('auto_total_over_ds_durable')), 'x')}",
            )
        )
        files = _get(st, "save", "resumable_auto", "files") or {}
        theirs = _num(_get(st, "save", "deepspeed", "bytes"))
        data = sum(v for k, v in files.items() if k.endswith(".safetensors"))
        meta = sum(v for k, v in files.items() if k.endswith((".json", ".json.gz")))
        why = (
            f"the data files alone {_f(_div(float(data), theirs), 'x4')} of DeepSpeed's "
            f"bytes; the rest, {meta:,} bytes, is the manifest and its parts (names, "
            "shapes, a checksum per tensor, the tree: what a restore checks before it "
            "trusts a byte)"
        )
        dir_ratio = _num(r.get("dir_bytes_over_ds"))
        if dir_ratio is None:  # runs before 2026-12-05: the checkpoints alone
            rows.append(
                _goal(
                    f"{z}: bytes written ÷ DeepSpeed's",
                    _num(r.get("bytes_over_ds")),
                    "x4",
                    "<=",
                    1.0,
                    None,
                    why,
                )
            )
        else:
            ours_beside = _get(st, "save", "resumable_sync", "beside") or {}
            ds_beside = _get(st, "save", "deepspeed", "beside") or {}
            rows.append(
                _goal(
                    f"{z}: bytes on disk ÷ DeepSpeed's (a directory of one checkpoint)",
                    dir_ratio,
                    "x4",
                    "<=",
                    1.0,
                    None,
                    f"the checkpoints alone (step and tag directories) "
                    f"{_f(_num(r.get('bytes_over_ds')), 'x4')}: {why}; beside them "
                    f"DeepSpeed's `latest` and recovery scripts "
                    f"({sum(ds_beside.values()):,} bytes, copied by every save), "
                    f"resumable's audit log and lease ({sum(ours_beside.values()):,} bytes)",
                )
            )
        rows.append(
            _goal(
                f"{z}: `restore()` ÷ `load_checkpoint`",
                _num(r.get("restore_over_ds")),
                "x",
                "<=",
                1.0,
                None,
                f"fastest samples {_f(_num(rmin.get('restore_over_ds')), 'x')}; resumable "
                "verifies every checksum first",
            )
        )
    for name, c in (_get(out, "mcore", "configs") or {}).items():
        r = _get(c, "ratios") or {}
        rmin = _get(c, "ratios_of_min") or {}
        rows.append(
            _goal(
                f"Megatron-Core {name}: `restore()` ÷ `dist_checkpointing.load`",
                _num(r.get("restore_over_mc")),
                "x",
                "<=",
                1.0,
                None,
                f"fastest samples {_f(_num(rmin.get('restore_over_mc')), 'x')}",
            )
        )
    return rows


SAVE_AFTER_FIRST_LIMIT = 1.0
"""Short HF runs: the longest time a `save()` after a launch's first blocked beyond its
own snapshot, ÷ the median snapshot of those saves: the goal is that no save blocks
longer than a snapshot (`hf_short_run`'s docstring says why it is judged so: a wait for
the worker's start is seconds, many snapshots; a save's fixed cost is about a
millisecond, a large share of this small state's smallest snapshots)."""


def _hf_short(out: Result) -> list[dict[str, Any] | None]:
    """Short runs of the HF Trainer (`hf_short_run.py`): the train time against the plain
    Trainer's, and the longest save after the first of a launch against its own snapshot
    (the first save starts the persist worker and allocates the shared memory: reported
    beside the row, not judged; `hf_short_run` says why)."""
    hf = _get(out, "hf_short")
    if not isinstance(hf, dict) or "error" in hf:
        return []
    settings = hf.get("settings") or {}
    med = hf.get("median_train_s") or {}
    saves = _get(hf, "saves", "resumable") or {}
    by_index = [i for i in saves.get("by_index") or [] if isinstance(i, dict)]

    def save_fig(i: dict[str, Any]) -> str:
        return (
            f"{_f(_ms(_num(i.get('median_blocking_s'))), 'ms')} against "
            f"{_f(_ms(_num(i.get('median_snapshot_s'))), 'ms')}"
        )

    first = by_index[0] if by_index else {}
    first_fig = (
        f"the first save (not judged: it starts the persist worker and allocates the shared "
        f"memory) blocked {save_fig(first)} of snapshot (medians), worst "
        f"{_f(_num(saves.get('worst_ratio_first')), 'x')}"
        if first
        else ""
    )
    rounds = settings.get("rounds", "?")
    rows: list[dict[str, Any] | None] = [
        _goal(
            f"short runs (HF Trainer, {settings.get('steps', '?')} steps, a save every "
            f"{settings.get('save_steps', '?')}): train time ÷ the plain Trainer's",
            _num(hf.get("ratio")),
            "x3",
            "<=",
            1.05,
            None,
            f"medians of {rounds} launches each, a fresh process per launch: "
            f"`ResumableTrainer` {_f(_num(med.get('resumable')), 's')}, the plain Trainer "
            f"{_f(_num(med.get('plain')), 's')}"
            + (
                f"; the persist worker used {_f(cpu, 's')} of CPU per launch (median)"
                if (cpu := _num(_get(hf, "median_worker_cpu_s", "resumable"))) is not None
                else ""
            )
            + (f"; {first_fig}" if first_fig else ""),
        )
    ]
    after = saves.get("after_first") or {}
    later = "; ".join(
        f"save {i.get('index')} {save_fig(i)} (worst {_f(_num(i.get('worst_ratio')), 'x')})"
        for i in by_index[1:]
    )
    rows.append(
        _goal(
            "short runs: the longest a `save()` after the first blocked beyond its own "
            f"snapshot ÷ the median snapshot (every save of {rounds} launches)",
            _num(after.get("worst_excess_over_median_snapshot")),
            "x",
            "<=",
            SAVE_AFTER_FIRST_LIMIT,
            None,
            f"medians per save, blocking against snapshot: {later}; the longest save after "
            f"the first ÷ its own snapshot {_f(_num(saves.get('worst_ratio_after_first')), 'x')}"
            "; beyond the snapshot, "
            f"after the first save: median {_f(_ms(_num(after.get('median_excess_s'))), 'ms')}"
            f", longest {_f(_ms(_num(after.get('worst_excess_s'))), 'ms')} (the fixed cost "
            "of a save: checks and the persist's hand-off; a wait for the worker's start "
            "would be that start)" + (f"; {first_fig}" if first_fig else ""),
        )
    )
    return rows


def goals(out: Result) -> list[dict[str, Any]]:
    """The rows the run measured, core paths first."""
    parts: list[Callable[[Result], list[dict[str, Any] | None]]] = [
        _core,
        _small,
        _dist,
        _frameworks,
        _hf_short,
    ]
    return [row for part in parts for row in part(out) if row is not None]


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000


def _f(x: float | None, unit: str) -> str:
    if x is None:
        return "—"
    if unit == "x":
        return f"{x:.2f}x"
    if unit == "x3":
        return f"{x:.3f}x"
    if unit == "x4":
        return f"{x:.4f}x"
    if unit == "%":
        return f"{x:.2f} %"
    if unit == "":
        return f"{x:.3f}"
    if unit == "s":
        return f"{x:.3f} s"
    if unit == "µs":
        return f"{x:,.0f} µs"
    return f"{x:.2f} {unit}"


def goals_section(out: Result) -> list[str]:
    rows = goals(out)
    if not rows:
        return []
    lines = [
        "",
        "## Every path against its goal and its floor",
        "",
        "Each path's deciding ratio (medians of this run), its goal, and what bounds it "
        "from below in this run. *Bound by the floor*: the floor alone is past the goal, "
        "so no code can meet it on this machine in that mode (the bound is the best the "
        "floor allows); *not met*: a miss with room above the floor. Made by "
        "`benchmarks/goals.py`.",
        "",
        "| path | measured | goal | result | best the floor allows | measured beside it |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        result = {"met": "**met**"}.get(r["result"], r["result"])
        extra = f" ({r['note']})" if r["note"] else ""
        lines.append(
            f"| {r['path']} | {_f(r['measured'], r['unit'])} | {r['op']} "
            f"{_f(r['limit'], r['unit'])} | {result} | {_f(r['bound'], r['unit'])} | "
            f"{r['why']}{extra} |"
        )
    return lines
