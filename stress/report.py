"""Render ``docs/reliability.md``'s generated blocks from the raw results.

Each campaign has a block between ``<!-- stress:NAME:begin -->`` and
``<!-- stress:NAME:end -->``, and the summary table one between
``<!-- stress:summary:begin -->`` and ``<!-- stress:summary:end -->``; everything else
in the page is prose, kept as it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from stress import CAMPAIGNS, DONE

COMMAND = "python -m stress --size {size} --only {name}"


def _block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- stress:{name}:begin -->", f"<!-- stress:{name}:end -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"docs/reliability.md has no {begin} ... {end} block")
    return pattern.sub(lambda _: f"{begin}\n{body.rstrip()}\n{end}", text)


def summary(results: dict[str, Any]) -> str:
    rows = [
        "| Campaign | Size | Trials | Failures | Seconds | Broken paths caught | Reproduce |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for name, title in CAMPAIGNS.items():
        r = results.get(name)
        if r is None:
            status = "not run" if name in DONE else "not done yet"
            rows.append(f"| {title} | {status} | | | | | |")
            continue
        caught = r.get("able_to_fail", {})
        shown = ", ".join(f"{k}: {'yes' if v['failures'] else 'NO'}" for k, v in caught.items())
        rows.append(
            f"| {title} | {r['size']} | {r['trials']:,} | {r['failures']:,} | "
            f"{r['seconds']:,} | {shown} | `{r['command']}` |"
        )
    return "\n".join(rows)


def detail(name: str, r: dict[str, Any] | None) -> str:
    if r is None:
        return "_No results yet: run `make stress`._"
    lines = [
        f"Run `{r['command']}` ({r['size']} size) on {r['when']}, commit {r['commit']}: "
        f"**{r['trials']:,} trials, {r['failures']:,} failures**, {r['seconds']:,} s.",
        "",
    ]
    caught = r.get("able_to_fail")
    if caught:
        lines.append("Broken save paths (the same checks must fail):")
        lines.append("")
        for k, v in caught.items():
            lines.append(f"- {k}: {v['failures']:,} failures in {v['trials']:,} trials")
        lines.append("")
    lines.append("<details><summary>Raw details</summary>")
    lines.append("")
    lines.append("```json")
    lines.append(json.dumps(r["details"], indent=1, default=str))
    lines.append("```")
    lines.append("")
    lines.append("</details>")
    return "\n".join(lines)


def render(text: str, results: dict[str, Any]) -> str:
    text = _block(text, "summary", summary(results))
    for name in DONE:
        text = _block(text, name, detail(name, results.get(name)))
    return text
