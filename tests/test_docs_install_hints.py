"""Install hints a user can paste: ``resumable-training`` is installed from a clone (the
README's ``pip install /path/to/this/clone``), not from a package index, so a hint of
the form ``pip install 'resumable-training[gcs]'`` is one pip cannot find. A hint names
the packages themselves (``pip install gcsfs``) or the clone's extra (``'.[gcs]'``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FROM_AN_INDEX = re.compile(r"pip3? install\s+(-\S+\s+)*['\"]?resumable-training(?![\w-])")


def _hint_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile"]
    for folder in ("src", "docs", "examples", "benchmarks"):
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    return files


def test_the_pattern_finds_the_hint_pip_cannot_find() -> None:
    assert FROM_AN_INDEX.search("(``pip install 'resumable-training[transformers]'``)")
    assert FROM_AN_INDEX.search("pip install -U resumable-training")
    assert not FROM_AN_INDEX.search("pip install /path/to/this/clone  # resumable-training")
    assert not FROM_AN_INDEX.search("pip install -e '.[gcs]'")


def test_no_hint_installs_resumable_training_from_an_index() -> None:
    wrong = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in _hint_files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if FROM_AN_INDEX.search(line)
    ]
    assert wrong == []
