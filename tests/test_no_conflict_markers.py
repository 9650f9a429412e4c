"""No merge-conflict markers left in the repository's text files (one once sat in docs/ir.md
for a whole session: nothing else reads that part of the file)."""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".json", ".toml", ".txt", ".cfg", ".csv", ".ir", ""}


def test_no_conflict_markers():
    found = []
    for top in ("src", "tests", "docs", "bench", ".ci"):
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "=======":
                        found.append(f"{path.relative_to(ROOT)}:{n}")
    for name in ("README.md", "Makefile", "pyproject.toml"):
        text = (ROOT / name).read_text().splitlines()
        found += [f"{name}:{n}" for n, line in enumerate(text, 1) if line.startswith(("<<<<<<< ", ">>>>>>> "))]
    assert not found, f"merge-conflict markers at {found}"
