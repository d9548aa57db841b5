"""``resumable report``'s page: one self-contained HTML file drawn from a `Report`.

Plots are inline SVG written here (no JavaScript library, nothing fetched: a
Content-Security-Policy forbids every network request), so the page opens from a
mail attachment or an air-gapped machine. Every string that comes from the audit log
or a manifest goes through `html.escape`; the report's data is also embedded as JSON
(``<script type="application/json">``, with ``<`` escaped) for scripts. The small
inline script only formats times in the viewer's time zone and records in
``document.body.dataset`` that it ran (``rendered="ok"``) and any script error
(``errors``), which the browser test reads.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from resumable.format import human_bytes
from resumable.report import LANES, Report

_COLORS = {
    "launch": "#555",
    "restore": "#2a7ab9",
    "snapshot": "#8fb8de",
    "persist": "#9467bd",
    "commit": "#2ca02c",
    "mirror": "#17becf",
    "skip": "#ff9f1c",
    "failure": "#d62728",
    "preempt": "#e377c2",
    "delete": "#7f7f7f",
    "other": "#bbb",
}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:2px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.sub{color:#666}.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:110px}
.card b{display:block;font-size:20px}.card span{color:#666;font-size:12px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:right}
th{background:#f6f6f6}td.l,th.l{text-align:left}
.warn{background:#fff4e5;border:1px solid #ffb74d;padding:8px 12px;border-radius:6px}
.empty{background:#eef5fb;border:1px solid #8fb8de;padding:12px;border-radius:6px}
svg{display:block;margin:6px 0}svg text{font:11px system-ui,sans-serif;fill:#333}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
"""

_SCRIPT = """
window.onerror=function(m){var b=document.body;b.dataset.errors=(b.dataset.errors||'')+m+';';};
document.addEventListener('DOMContentLoaded',function(){
document.querySelectorAll('time[datetime]').forEach(function(t){
var d=new Date(t.getAttribute('datetime'));if(!isNaN(d))t.title=d.toString();});
var data=JSON.parse(document.getElementById('report-data').textContent);
document.body.dataset.launches=String(data.launches.length);
document.body.dataset.rendered='ok';});
"""


def e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _iso(t: float | None) -> str:
    if t is None:
        return ""
    try:
        return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return ""


def _time(t: float | None) -> str:
    iso = _iso(t)
    return f'<time datetime="{e(iso)}">{e(iso.replace("+00:00", "Z"))}</time>' if iso else ""


def _plain(value: Any) -> str:
    """A value for a tooltip: a whole float (``307.0``, from a log written by hand or by
    another tool) as the integer it is."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
        return str(int(value))
    return str(value)


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    return f"{s:.2f} s" if s < 120 else f"{s / 60:.1f} min"


def _bytes(n: float | None) -> str:
    return "-" if n is None else human_bytes(n)


def _rate(bps: float | None) -> str:
    return "-" if bps is None else _bytes(bps) + "/s"


def _td(value: str, field: str = "", raw: Any = None, left: bool = False) -> str:
    attrs = f' data-field="{e(field)}"' if field else ""
    if raw is not None:
        attrs += f' data-value="{e(raw)}"'
    return f"<td{' class=l' if left else ''}{attrs}>{value}</td>"


# ---------------------------------------------------------------------- plots


def _timeline_svg(r: Report) -> str:
    if r.first_time is None or r.last_time is None:
        return ""
    lanes = [*LANES, "other"] if any(t["lane"] == "other" for t in r.timeline) else [*LANES]
    left, width, row = 80, 980, 20
    height = row * len(lanes) + 30
    t0, span = r.first_time, max(r.last_time - r.first_time, 1e-6)

    def x(t: float) -> float:
        return left + (t - t0) / span * (width - left - 10)

    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="timeline">']
    for launch in r.launches:
        x0, x1 = x(launch.start), x(launch.end)
        fill = "#f3f8ec" if launch.index % 2 == 0 else "#eef3fa"
        parts.append(
            f'<rect x="{x0:.1f}" y="0" width="{max(x1 - x0, 1):.1f}" height="{height - 25}" '
            f'fill="{fill}"><title>launch {launch.index}</title></rect>'
        )
    for i, lane in enumerate(lanes):
        y = row * i + 14
        parts.append(f'<text x="4" y="{y + 4}">{e(lane)}</text>')
        parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{y}" y2="{y}" stroke="#e4e4e4"/>')
    index = {lane: i for i, lane in enumerate(lanes)}
    for item in r.timeline:
        t = item.get("time")
        if t is None:
            continue
        y = row * index.get(item["lane"], len(lanes) - 1) + 14
        tip = " ".join(f"{k}={_plain(v)}" for k, v in item.items() if k not in ("time", "lane"))
        color = _COLORS.get(item["lane"], "#bbb")
        parts.append(
            f'<circle cx="{x(t):.1f}" cy="{y}" r="3.5" fill="{color}" '
            f'data-event="{e(item["event"])}"><title>{e(_iso(t))} {e(tip)}</title></circle>'
        )
    parts.append(
        f'<text x="{left}" y="{height - 8}">{e(_iso(r.first_time))}</text>'
        f'<text x="{width - 10}" y="{height - 8}" text-anchor="end">'
        f"{e(_iso(r.last_time))} (+{span:.1f} s)</text></svg>"
    )
    return "".join(parts)


def _bars_svg(
    values: list[tuple[str, list[float | None]]],
    series: list[tuple[str, str]],
    unit: Callable[[float], str],
) -> str:
    """Grouped bars: one group per label, one bar per series, a shared linear axis."""
    if not values:
        return ""
    peak = max((v for _, vs in values for v in vs if v is not None), default=0.0) or 1.0
    left, height, plot_h = 60, 190, 150
    group = max(6, min(40, 900 // max(len(values), 1)))
    width = left + group * len(values) + 20
    bar = max(2, (group - 2) // max(len(series), 1))
    parts = [f'<svg width="{width}" height="{height}" role="img">']
    for frac in (0, 0.5, 1):
        y = 10 + plot_h * (1 - frac)
        parts.append(
            f'<line x1="{left}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{e(unit(peak * frac))}</text>'
        )
    for gi, (label, vs) in enumerate(values):
        for si, v in enumerate(vs):
            if v is None:
                continue
            h = plot_h * v / peak
            xb = left + gi * group + si * bar
            parts.append(
                f'<rect x="{xb}" y="{10 + plot_h - h:.1f}" width="{bar - 1}" height="{h:.1f}" '
                f'fill="{series[si][1]}"><title>{e(label)} {e(series[si][0])}: '
                f"{e(unit(v))}</title></rect>"
            )
        if len(values) <= 40 or gi % max(1, len(values) // 20) == 0:
            xl = left + gi * group + group / 2
            parts.append(
                f'<text x="{xl:.1f}" y="{height - 12}" text-anchor="middle">{e(label)}</text>'
            )
    parts.append("</svg>")
    legend = "".join(f'<span><i style="background:{c}"></i>{e(n)}</span>' for n, c in series)
    return f'<div class="legend">{legend}</div>' + "".join(parts)


def _scatter_svg(points: list[tuple[float, float, str]], t0: float, t1: float) -> str:
    """Bytes per checkpoint against time."""
    if not points:
        return ""
    left, width, height, plot_h = 70, 980, 170, 130
    peak = max(p[1] for p in points) or 1.0
    span = max(t1 - t0, 1e-6)
    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="bytes">']
    for frac in (0, 0.5, 1):
        y = 10 + plot_h * (1 - frac)
        parts.append(
            f'<line x1="{left}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">'
            f"{e(_bytes(peak * frac))}</text>"
        )
    prev = None
    for t, v, label in points:
        px = left + (t - t0) / span * (width - left - 10)
        py = 10 + plot_h * (1 - v / peak)
        if prev is not None:
            parts.append(
                f'<line x1="{prev[0]:.1f}" y1="{prev[1]:.1f}" x2="{px:.1f}" y2="{py:.1f}" '
                'stroke="#2ca02c" stroke-opacity=".4"/>'
            )
        parts.append(
            f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="#2ca02c">'
            f"<title>{e(label)}: {e(_bytes(v))}</title></circle>"
        )
        prev = (px, py)
    parts.append(
        f'<text x="{left}" y="{height - 8}">{e(_iso(t0))}</text>'
        f'<text x="{width - 10}" y="{height - 8}" text-anchor="end">{e(_iso(t1))}</text></svg>'
    )
    return "".join(parts)


def _goodput_svg(r: Report) -> str:
    g = r.goodput
    if g.wall_s <= 0:
        return ""
    pieces = [
        ("useful training", g.useful_s, "#2ca02c"),
        ("checkpoint stall", g.checkpoint_stall_s, "#9467bd"),
        ("start-up", g.startup_s, "#bcbd22"),
        ("restore", g.restore_s, "#2a7ab9"),
        ("downtime between launches", g.downtime_s, "#d62728"),
        ("lost work (recomputed steps)", g.lost_work_s, "#ff7f0e"),
    ]
    width, x = 980, 0.0
    parts = [f'<svg width="{width}" height="34" role="img" aria-label="goodput">']
    total = sum(max(0.0, v) for _, v, _ in pieces) or 1.0
    for name, v, color in pieces:
        w = width * max(0.0, v) / total
        if w <= 0:
            continue
        parts.append(
            f'<rect x="{x:.1f}" y="4" width="{w:.1f}" height="26" fill="{color}">'
            f"<title>{e(name)}: {e(_secs(v))} ({100 * v / total:.1f} %)</title></rect>"
        )
        x += w
    parts.append("</svg>")
    legend = "".join(f'<span><i style="background:{c}"></i>{e(n)}</span>' for n, _, c in pieces)
    return f'<div class="legend">{legend}</div>' + "".join(parts)


# ---------------------------------------------------------------------- page


def render_html(r: Report) -> str:
    g = r.goodput
    out: list[str] = []
    add = out.append
    data = json.dumps(r.to_json(), allow_nan=False, default=str).replace("<", "\\u003c")
    add(
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>resumable report: {e(r.url)}</title><style>{_CSS}</style></head><body>"
    )
    add(f"<h1>Checkpoint report</h1><div class=sub>{e(r.url)} · generated {_time(r.generated)}")
    add(f" · {r.entries} audit entries</div>")
    if r.warnings:
        items = "".join(f"<li>{e(w)}</li>" for w in r.warnings)
        add(f'<div class="warn" id="warnings"><b>Warnings</b><ul>{items}</ul></div>')
    if r.empty:
        add(
            '<div class="empty" id="empty"><b>Nothing to report yet.</b> This root has no '
            "audit log entries and no committed checkpoints: no training job has written "
            "here. Point a <code>resumable.Checkpointer</code> at it, train, and run the "
            "report again.</div>"
        )
    final = max((c.step for c in r.checkpoints if c.status == "committed"), default=None)
    cards = [
        ("launches", str(len(r.launches)), "launches"),
        ("restarts", str(len(r.restarts)), "restarts"),
        ("commits", str(sum(1 for s in r.saves if s.outcome == "committed")), "commits"),
        ("skips", str(r.counts.get("skip", 0)), "skips"),
        ("failures", str(r.counts.get("failure", 0)), "failures"),
        ("newest checkpoint", "-" if final is None else f"step {final}", "newest"),
        ("goodput", "-" if g.ratio is None else f"{100 * g.ratio:.1f} %", "goodput"),
        ("ranks", ", ".join(map(str, r.ranks)) or "-", "ranks"),
    ]
    add('<div class="cards">')
    for label, value, key in cards:
        add(f'<div class="card" data-card="{key}"><b>{e(value)}</b><span>{e(label)}</span></div>')
    add("</div>")
    if r.entries:
        _goodput_section(r, add)
        add("<h2>Timeline</h2>")
        legend = "".join(
            f'<span><i style="background:{c}"></i>{e(n)}</span>' for n, c in _COLORS.items()
        )
        add(f'<div class="legend">{legend}</div>{_timeline_svg(r)}')
        _launch_section(r, add)
        _save_section(r, add)
        _mirror_section(r, add)
    _checkpoint_section(r, add)
    add(f'<script type="application/json" id="report-data">{data}</script>')
    add(f"<script>{_SCRIPT}</script></body></html>")
    return "".join(out)


def _goodput_section(r: Report, add: Any) -> None:
    g = r.goodput
    add("<h2>Goodput</h2>")
    add(
        "<p>Useful training time / wall time, from the first to the last entry the "
        "training job wrote (an operator's later pin or prune is not training time). "
        "Everything that is not useful training is one of the parts below "
        "(docs/report.md defines each).</p>"
    )
    add(_goodput_svg(r))
    rows = [
        ("wall time", g.wall_s, "wall_s"),
        ("useful training", g.useful_s, "useful_s"),
        (
            "checkpointing cost (snapshot stall on the training thread)",
            g.checkpointing_s,
            "checkpointing_s",
        ),
        (
            "failures cost (downtime, restarts' start-up and restore, lost work)",
            g.failures_s,
            "failures_s",
        ),
        ("  of which downtime between launches", g.downtime_s, "downtime_s"),
        ("  of which recomputed (lost) steps", g.lost_work_s, "lost_work_s"),
        ("start-up of all launches (launch to first step, less restore)", g.startup_s, "startup_s"),
        ("restores", g.restore_s, "restore_s"),
    ]
    add('<table id="goodput"><tr><th class=l>part</th><th>time</th><th>share</th></tr>')
    for name, v, key in rows:
        share = f"{100 * v / g.wall_s:.1f} %" if g.wall_s > 0 else "-"
        add(f"<tr><td class=l>{e(name)}</td>{_td(_secs(v), key, round(v, 6))}<td>{share}</td></tr>")
    ratio = "-" if g.ratio is None else f"{100 * g.ratio:.1f} %"
    raw = "" if g.ratio is None else round(g.ratio, 6)
    add(f"<tr><th class=l>goodput</th>{_td(ratio, 'ratio', raw)}<td></td></tr></table>")


def _launch_section(r: Report, add: Any) -> None:
    add("<h2>Launches and restarts</h2>")
    add(
        "<p>Each start of the job. <i>Resumed from</i> is the step its restore loaded and "
        "the tier it came from; <i>steps lost</i> is how far the launch before it is known "
        "to have got (the newest step its entries name) minus that step.</p>"
    )
    head = (
        "launch",
        "started",
        "host / pid",
        "ranks",
        "persist",
        "resumed from",
        "tier",
        "steps lost",
        "time lost",
        "downtime before",
        "restore",
        "reached",
        "s/step",
        "commits",
        "skips",
        "failures",
        "ended",
    )
    add('<table id="launches"><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>")
    for ln in r.launches:
        resumed = (
            "fresh start"
            if ln.fresh
            else ("-" if ln.restored_step is None else str(ln.restored_step))
        )
        add(
            f'<tr data-launch="{ln.index}">'
            + _td(str(ln.index), "index", ln.index)
            + _td(_time(ln.start), left=True)
            + _td(f"{e(ln.host)} / {e(ln.pid)}", left=True)
            + _td(str(ln.world_size), "world_size", ln.world_size)
            + _td(e(ln.persist_mode or "-"))
            + _td(e(resumed), "restored_step", "" if ln.restored_step is None else ln.restored_step)
            + _td(e(ln.tier or "-"), "tier", ln.tier or "")
            + _td(
                "-" if ln.steps_lost is None else str(ln.steps_lost),
                "steps_lost",
                "" if ln.steps_lost is None else ln.steps_lost,
            )
            + _td(_secs(ln.lost_s))
            + _td(_secs(ln.downtime_s))
            + _td(_secs(ln.restore_s))
            + _td(
                "-" if ln.reached is None else str(ln.reached),
                "reached",
                "" if ln.reached is None else ln.reached,
            )
            + _td("-" if ln.step_time_s is None else f"{ln.step_time_s * 1000:.1f} ms")
            + _td(str(ln.commits), "commits", ln.commits)
            + _td(str(ln.skips))
            + _td(str(ln.failures))
            + _td("closed" if ln.closed else "killed or still running", "ended", left=True)
            + "</tr>"
        )
    add("</table>")


def _save_section(r: Report, add: Any) -> None:
    if not r.saves:
        return
    add("<h2>Saves</h2>")
    add(
        "<p>Per persist: the training stall (the snapshot copy that blocked the training "
        "thread), the persist duration (writing and committing in the background) and "
        "its throughput.</p>"
    )
    bars = [(str(s.step), [s.stall_s, s.persist_s]) for s in r.saves if s.outcome == "committed"]
    add(_bars_svg(bars, [("stall", "#9467bd"), ("persist", "#2ca02c")], _secs))
    commits = [s for s in r.saves if s.outcome == "committed" and s.bytes is not None]
    if commits and r.first_time is not None and r.last_time is not None:
        add("<h2>Bytes per checkpoint over time</h2>")
        points = [(s.time, float(s.bytes or 0), f"step {s.step}") for s in commits]
        add(_scatter_svg(points, r.first_time, r.last_time))
    head = (
        "step",
        "launch",
        "started",
        "outcome",
        "stall",
        "persist",
        "bytes",
        "throughput",
        "ranks",
    )
    add(
        '<table id="saves"><tr>'
        + "".join(f"<th>{h}</th>" for h in head)
        + "<th class=l>error</th></tr>"
    )
    for s in r.saves:
        add(
            f'<tr data-step="{s.step}">'
            + _td(str(s.step), "step", s.step)
            + _td(str(s.launch), "launch", s.launch)
            + _td(_time(s.time), left=True)
            + _td(e(s.outcome), "outcome", s.outcome)
            + _td(_secs(s.stall_s), "stall_s", "" if s.stall_s is None else s.stall_s)
            + _td(_secs(s.persist_s), "persist_s", "" if s.persist_s is None else s.persist_s)
            + _td(_bytes(s.bytes), "bytes", "" if s.bytes is None else s.bytes)
            + _td(_rate(s.throughput_bps))
            + _td(str(s.ranks))
            + _td(e(s.error or ""), left=True)
            + "</tr>"
        )
    add("</table>")


def _mirror_section(r: Report, add: Any) -> None:
    if not r.mirror:
        return
    add("<h2>Mirror</h2>")
    add(
        '<table id="mirror"><tr><th>step</th><th>time</th><th>outcome</th><th>duration</th>'
        "<th>bytes</th><th>throughput</th><th class=l>where / error</th></tr>"
    )
    for m in r.mirror:
        add(
            "<tr>"
            + _td(e(m["step"]), "step", m["step"])
            + _td(_time(m["time"]), left=True)
            + _td(e(m["outcome"]), "outcome", m["outcome"])
            + _td(_secs(m["duration_s"]))
            + _td(_bytes(m["bytes"]))
            + _td(_rate(m["throughput_bps"]))
            + _td(e(m["error"] or m["url"] or ""), left=True)
            + "</tr>"
        )
    add("</table>")


def _checkpoint_section(r: Report, add: Any) -> None:
    add("<h2>Checkpoints in the root now</h2>")
    if not r.checkpoints:
        add("<p>No committed checkpoint.</p>")
        return
    add(
        '<table id="checkpoints"><tr><th>step</th><th>created</th><th>bytes</th>'
        "<th>status</th><th class=l>problem</th></tr>"
    )
    for c in r.checkpoints:
        add(
            f'<tr data-step="{c.step}">'
            + _td(str(c.step), "step", c.step)
            + _td(_time(c.created), left=True)
            + _td(_bytes(c.bytes), "bytes", "" if c.bytes is None else c.bytes)
            + _td(e(c.status), "status", c.status)
            + _td(e(c.error or ""), left=True)
            + "</tr>"
        )
    add("</table>")
