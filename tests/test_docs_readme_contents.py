"""The README's table of contents: right after the two set-up commands, one link per
``##`` section, in the sections' order, each to an anchor that exists (GitHub's
heading slugs), so a renamed or added section cannot leave it stale."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
LINK = re.compile(r"\[([^\]]+)\]\(#([^)]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> list[str]:
    """The ``##`` headings outside code blocks (a ``# comment`` in a block is none)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            out.append(line[3:])
    return out


def contents(text: str) -> str:
    paragraphs = text.split("\n\n")
    found = [p for p in paragraphs if p.startswith("**Contents:**")]
    assert len(found) == 1, "README.md has no (or more than one) **Contents:** paragraph"
    return found[0]


def test_the_contents_follow_the_set_up_commands() -> None:
    text = README.read_text()
    toc = text.index("**Contents:**")
    assert text.index("make demo") < text.index("make test") < toc
    assert toc < text.index("\n## ")  # before the first section


def test_the_contents_link_every_section_in_order() -> None:
    text = README.read_text()
    targets = [anchor for _, anchor in LINK.findall(contents(text))]
    assert targets == [slug(h) for h in sections(text)]
