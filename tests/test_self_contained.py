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
