"""The repository stands on its own: no test, doc or tool points to a path outside it (a zoo or notes folder of
the machine it was written on). Tests that need the Caffe model zoo find it through SUPERNEURONS_ZOO (tests/zoo.py)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile("/" + "work/|" + r"\.\./" + "shared")  # spelled in pieces so this file does not match


def test_no_file_points_outside_the_repository():
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml"]
    files += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "tests").rglob("*.py"))
    files += sorted((REPO / "tools").rglob("*.py")) + sorted((REPO / "tools").rglob("*.sh"))
    hits = [f"{f.relative_to(REPO)}:{n}: {line.strip()}" for f in files if f.is_file()
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def _text_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml", REPO / "CHANGELOG.md"]
    files += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "superneurons").rglob("*.py"))
    files += sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "tools").rglob("*.py"))
    files += sorted((REPO / "tools").rglob("*.sh")) + sorted((REPO / "proto").glob("*.proto"))
    return [f for f in files if f.is_file()]


def test_results_are_named_by_date_and_device_and_each_is_cited():
    """docs/results holds what the docs cite, in folders named <date>-<device>; every path cited there exists."""
    results = REPO / "docs" / "results"
    folders = sorted(p.name for p in results.iterdir())
    assert [f for f in folders if not re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+", f)] == []
    docs = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    cited = set(re.findall(r"(\d{4}-\d{2}-\d{2}-[a-z0-9]+(?:-[a-z0-9]+)*)/([\w./-]*)", docs))
    assert sorted(set(folders) - {folder for folder, _ in cited}) == []
    assert sorted(f"{folder}/{rest}" for folder, rest in cited if not (results / folder / rest).exists()) == []


def test_no_words_of_how_the_code_was_developed():
    """The repository speaks of the product: no work sessions, issue numbers or rounds of work."""
    words = re.compile(r"\b(session|sessions) \d|issue #?\d|\brounds? (one|two|three|\d)\b", re.IGNORECASE)
    hits = [f"{f.relative_to(REPO)}:{n}: {line.strip()}" for f in _text_files() if f != Path(__file__).resolve()
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if words.search(line)]
    assert not hits, "\n".join(hits)
