"""The user-facing pages speak for themselves: no "issue 15", "(issue 19)" or "issues 3
and 15" that only the project's own tracker explains. Other projects' issues are cited
by their full name (``huggingface/transformers#35782``). The generated sections of
docs/performance.md are checked through their generators too, so the next
``make bench`` does not bring the numbers back."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"\b(?:issues?|PR)\s+#?\d+", re.IGNORECASE)
GENERATORS = ("benchmarks/report.py", "benchmarks/small_report.py", "benchmarks/incr_report.py")


def mentions(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [
        f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for m in ISSUE.finditer(text)
    ]


def test_docs_and_readme_name_no_issue_numbers() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [hit for page in pages for hit in mentions(page)]
    assert found == [], "\n".join(found)


def test_the_generators_of_performance_md_write_no_issue_numbers() -> None:
    found = [hit for name in GENERATORS for hit in mentions(REPO / name)]
    assert found == [], "\n".join(found)
