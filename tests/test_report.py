"""``resumable report``: the figures of a real run killed and resumed several times, the
page rendered by a real headless Chromium, and the empty, corrupted and s3:// roots."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from resumable import Checkpointer
from resumable.audit import read_audit
from resumable.cli import main
from resumable.storage import LocalStorage

STEPS = 45
KILLS = (14, 31)  # the killed launches stop right after printing these steps
REPO = Path(__file__).resolve().parents[1]


def demo_cmd(root: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "resumable.cli",
        "demo",
        "--dir",
        str(root),
        "--steps",
        str(STEPS),
        "--every",
        "5",
        "--memory-every",
        "0",
        "--workers",
        "0",
        "--log-every",
        "1",
    ]


@dataclass
class Campaign:
    root: Path
    resumed: list[int] = field(default_factory=list)  # what each launch printed
    last_printed: list[int] = field(default_factory=list)  # each killed launch's last step


def run_campaign(root: Path) -> Campaign:
    """The demo, SIGKILLed right after it printed each step of `KILLS`, then run to the
    end: three launches. Progress entries at every step, so the report knows exactly
    how far each killed launch got."""
    env = {**os.environ, "RESUMABLE_PROGRESS_EVERY_S": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    campaign = Campaign(root)
    for kill in (*KILLS, None):
        proc = subprocess.Popen(
            demo_cmd(root), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        assert proc.stdout is not None
        last = None
        for line in proc.stdout:
            if line.startswith(("resumed from step", "starting fresh")):
                words = line.split()
                campaign.resumed.append(int(words[3]) if words[0] == "resumed" else 0)
            if line.startswith("step "):
                last = int(line.split()[1])
                if kill is not None and last >= kill:
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.stdout.close()
        assert proc.wait(timeout=120) == (-signal.SIGKILL if kill is not None else 0)
        if kill is not None:
            assert last is not None
            campaign.last_printed.append(last)
    return campaign


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    return run_campaign(tmp_path_factory.mktemp("report") / "run")


def report_json(root: Path | str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["report", str(root), "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def expected_from_audit(root: Path) -> list[dict[str, Any]]:
    """Restarts recomputed from the raw audit log, independently of resumable.report."""
    entries = read_audit(LocalStorage(root))
    starts = [e["time"] for e in entries if e["event"] == "launch"]
    launches: list[dict[str, Any]] = [{"reached": 0, "restored": None} for _ in starts]
    for e in entries:
        i = max(k for k, t in enumerate(starts) if t <= e["time"])
        if e["event"] == "progress":
            launches[i]["reached"] = max(launches[i]["reached"], e["step"])
        if e["event"] == "restore" and launches[i]["restored"] is None:
            launches[i]["restored"] = e["step"]
    for prev, cur in itertools.pairwise(launches):
        cur["lost"] = max(0, prev["reached"] - cur["restored"])
    return launches


def test_report_of_a_killed_and_resumed_run_shows_every_restart(
    campaign: Campaign, capsys: pytest.CaptureFixture[str]
) -> None:
    data = report_json(campaign.root, capsys)
    launches = data["launches"]
    assert len(launches) == 3 and data["restarts"] == 2
    assert [ln["restored_step"] for ln in launches] == campaign.resumed
    assert launches[0]["fresh"] and not launches[1]["fresh"] and not launches[2]["fresh"]
    assert [ln["closed"] for ln in launches] == [False, False, True]
    assert launches[-1]["reached"] == STEPS
    for i, printed in enumerate(campaign.last_printed):
        killed, restart = launches[i], launches[i + 1]
        # Progress is recorded before the step is printed. How far past it the kill lands
        # depends on how far this reader lags behind the pipe (a loaded machine: several
        # steps); the exact figure is checked against the audit log below.
        assert printed <= killed["reached"] < STEPS
        assert restart["steps_lost"] == killed["reached"] - restart["restored_step"]
        assert restart["steps_lost"] >= printed - restart["restored_step"] > 0
        assert restart["tier"] in ("memory", "local")
        assert restart["restored_step"] % 5 == 0  # a persisted step (--every 5)
        assert restart["lost_s"] > 0 and restart["downtime_s"] > 0
    for got, want in zip(launches, expected_from_audit(campaign.root), strict=True):
        assert got["reached"] == want["reached"]
        assert got.get("steps_lost") == want.get("lost")

    g = data["goodput"]
    assert 0 < g["ratio"] < 1
    parts = ("checkpoint_stall_s", "restore_s", "startup_s", "downtime_s", "lost_work_s")
    assert abs(g["useful_s"] + sum(g[p] for p in parts) - g["wall_s"]) < 1e-6
    assert g["lost_work_s"] == pytest.approx(sum(ln["lost_s"] or 0 for ln in launches))
    assert g["checkpoint_stall_s"] > 0

    committed = [s for s in data["saves"] if s["outcome"] == "committed"]
    commits = [e for e in read_audit(LocalStorage(campaign.root)) if e["event"] == "commit"]
    assert [s["step"] for s in committed] == [e["step"] for e in commits]
    assert all(s["bytes"] > 0 and s["persist_s"] > 0 and s["throughput_bps"] > 0 for s in committed)
    assert [c["step"] for c in data["checkpoints"]][-1] == STEPS


# ------------------------------------------------------------------ browser


class _Cells(HTMLParser):
    """The ``data-field`` cells of each table row, and the body's data attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.tables: dict[str, list[dict[str, str]]] = {}
        self._table: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = {k[5:]: v for k, v in a.items() if k.startswith("data-")}
        elif tag == "table":
            self._table = a.get("id")
            self.tables.setdefault(self._table or "", [])
        elif tag == "tr" and self._table:
            self.tables[self._table].append({})
        elif tag == "td" and self._table and "data-field" in a and self.tables[self._table]:
            self.tables[self._table][-1][a["data-field"]] = a.get("data-value", "")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (make test installs it with apt-get as root)")
    return found


def browse(html: Path, out: Path) -> _Cells:
    """The DOM after Chromium ran the page's script (``--dump-dom``)."""
    cmd = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom"]
    cmd += [f"--user-data-dir={out}", html.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cells = _Cells()
    cells.feed(proc.stdout)
    return cells


def test_report_page_renders_in_chromium_with_the_audit_figures(
    campaign: Campaign, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "report.html"
    assert main(["report", str(campaign.root), "--out", str(page)]) == 0
    dom = browse(page, tmp_path / "chromium")
    assert dom.body.get("rendered") == "ok", dom.body
    assert "errors" not in dom.body, dom.body["errors"]
    assert dom.body["launches"] == "3"
    rows = [r for r in dom.tables["launches"] if r]
    want = expected_from_audit(campaign.root)
    assert [r["steps_lost"] for r in rows] == ["", str(want[1]["lost"]), str(want[2]["lost"])]
    assert [r["restored_step"] for r in rows] == [str(s) for s in campaign.resumed]
    commits = [e for e in read_audit(LocalStorage(campaign.root)) if e["event"] == "commit"]
    saves = [r for r in dom.tables["saves"] if r.get("outcome") == "committed"]
    assert [(int(r["step"]), int(r["bytes"])) for r in saves] == [
        (e["step"], e["bytes"]) for e in commits
    ]
    data = report_json(campaign.root, capsys)
    (ratio,) = [r["ratio"] for r in dom.tables["goodput"] if "ratio" in r]
    assert float(ratio) == pytest.approx(data["goodput"]["ratio"], abs=1e-6)


def test_screenshot_of_a_real_report(campaign: Campaign, tmp_path: Path) -> None:
    """docs/report.png is a real report of this campaign (regenerated when the test runs
    with RESUMABLE_UPDATE_DOCS=1; otherwise written to a temporary file)."""
    page = tmp_path / "report.html"
    assert main(["report", str(campaign.root), "--out", str(page)]) == 0
    target = REPO / "docs" / "report.png"
    shot = target if os.environ.get("RESUMABLE_UPDATE_DOCS") == "1" else tmp_path / "shot.png"
    cmd = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars"]
    cmd += [f"--user-data-dir={tmp_path / 'chromium'}", f"--screenshot={shot}"]
    cmd += ["--window-size=1150,2000", page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------ other roots


def test_report_of_an_empty_root_is_a_clear_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    data = report_json(root, capsys)
    assert data["entries"] == 0 and data["launches"] == [] and data["checkpoints"] == []
    page = tmp_path / "r.html"
    assert main(["report", str(root), "--out", str(page)]) == 0
    assert "nothing to report yet" in capsys.readouterr().out
    assert 'id="empty"' in page.read_text()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no checkpoint directory at" in capsys.readouterr().err


def test_corrupted_root_reports_what_it_skipped_and_escapes_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], small_training_state: Any
) -> None:
    root = tmp_path / "run"
    with Checkpointer(root, small_training_state().state, persist="sync") as ck:
        ck.restore()
        for step in (1, 2):
            ck.save(step)
    with (root / "audit.jsonl").open("a") as f:
        f.write("{torn line\n")
        hostile = {"time": 1e18, "event": "<script>alert(1)</script>", "step": float("nan")}
        f.write(json.dumps(hostile) + "\n")  # NaN: json.loads accepts it, JSON output may not
    (root / "step-000000000002" / "manifest.json").write_text("{not json")
    data = report_json(root, capsys)
    assert any("audit.jsonl line" in w and "{torn line" in w for w in data["warnings"])
    assert any("step-000000000002 is corrupt" in w for w in data["warnings"])
    assert [c["status"] for c in data["checkpoints"]] == ["committed", "corrupt"]
    page = tmp_path / "r.html"
    assert main(["report", str(root), "--out", str(page)]) == 0
    assert "warning: skipped an unreadable audit line" in capsys.readouterr().err
    text = page.read_text()
    assert "<script>alert(1)" not in text and 'id="warnings"' in text
    assert text.count("<script") == 2  # the data island and the page's own script


def test_report_of_an_s3_root(
    s3_env: Any, small_training_state: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"s3://{s3_env.new_bucket('report')}/run"
    state = small_training_state().state
    with Checkpointer(url, state, persist="sync") as ck:
        ck.restore()
        ck.save(3)
    with Checkpointer(url, state, persist="sync") as ck:
        assert ck.restore() == 3
        ck.save(4)
    data = report_json(url, capsys)
    assert data["url"] == url and data["restarts"] == 1
    assert data["launches"][1]["restored_step"] == 3 and data["launches"][1]["tier"] == "local"
    assert [c["step"] for c in data["checkpoints"]] == [3, 4]
    page = tmp_path / "s3.html"
    assert main(["report", url, "--out", str(page)]) == 0
    assert html_escaped(url) in page.read_text()
    assert main(["report", f"s3://{s3_env.new_bucket('none')}-missing/run"]) == 2
    assert "could not list" in capsys.readouterr().err


def html_escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True)


# ------------------------------------------------------------------ grafana


def test_grafana_dashboard_uses_the_exported_metrics_and_alerts() -> None:
    """examples/grafana: every metric an expression names is one Monitor exports, and
    the alert rules are the monitor's alerts."""
    import re

    prometheus_client = pytest.importorskip("prometheus_client")
    from resumable import monitor

    registry = prometheus_client.CollectorRegistry()
    m = monitor.Monitor(prometheus_registry=registry)
    m.snapshot(0.01)
    m.committed(3, 0.5)
    m.skipped(4, "busy")
    m.failed(5, "boom")
    exported = {s.name for fam in registry.collect() for s in fam.samples}
    folder = REPO / "examples" / "grafana"
    dashboard = json.loads((folder / "resumable-dashboard.json").read_text())
    rules = json.loads((folder / "resumable-alert-rules.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [
        d["model"]["expr"]
        for g in rules["groups"]
        for r in g["rules"]
        for d in r["data"]
        if "expr" in d["model"]
    ]
    named = {n for x in exprs for n in re.findall(r"resumable_[a-z_]+", x)}
    assert named and named <= exported, named - exported
    titles = {r["title"] for g in rules["groups"] for r in g["rules"]}
    assert titles == {monitor.ALERT_SAVE_FAILED, monitor.ALERT_STALE, monitor.ALERT_SKIPS}
