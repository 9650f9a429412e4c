"""Golden IR tests: each ``NAME.ir`` here (any depth) is run through ``remat.opt`` and its output compared
with ``NAME.expected``, exactly. See README.md in this folder.

``REMAT_UPDATE_GOLDEN=1 pytest tests/golden`` rewrites the expected files from the current output.
"""
from __future__ import annotations

import difflib
import io
import os
import shlex
from pathlib import Path

import pytest

from remat.ir import parse, verify
from remat.opt import run

HERE = Path(__file__).parent
UPDATE = os.environ.get("REMAT_UPDATE_GOLDEN", "") not in ("", "0")
RUN_PREFIX = "// RUN:"


def golden_files() -> list[Path]:
    return sorted(HERE.rglob("*.ir"))


def run_args(path: Path, text: str) -> list[str]:
    """The driver arguments from the file's first line, ``// RUN: --passes a,b`` (possibly empty)."""
    first = text.splitlines()[0] if text else ""
    if not first.startswith(RUN_PREFIX):
        raise AssertionError(f"{path.relative_to(HERE)}: the first line must be '{RUN_PREFIX} [remat.opt options]', "
                             f"e.g. '{RUN_PREFIX} --passes dce,cse' or just '{RUN_PREFIX}'; got {first!r}")
    args = shlex.split(first[len(RUN_PREFIX):])
    if any(not a.startswith("-") and not prev.startswith("--passes") for prev, a in zip([""] + args, args)):
        raise AssertionError(f"{path.relative_to(HERE)}: the RUN line holds options only (the input is the file itself): {args}")
    return args


def run_golden(path: Path) -> tuple[str, list[str], int]:
    """The text to compare with NAME.expected: stdout on success; on failure ``// exit N`` then stderr.
    The input goes through stdin so that messages name ``<stdin>``, not a machine-dependent path."""
    text = path.read_text(encoding="utf-8")
    args = run_args(path, text)
    out, err = io.StringIO(), io.StringIO()
    code = run(args + ["-"], stdin=io.StringIO(text), stdout=out, stderr=err)
    if code == 0:
        return out.getvalue(), args, code
    return f"// exit {code}\n{err.getvalue()}", args, code


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: str(p.relative_to(HERE)))
def test_golden(path: Path) -> None:
    actual, args, code = run_golden(path)
    expected_path = path.with_suffix(".expected")
    if UPDATE:
        expected_path.write_text(actual, encoding="utf-8")
    if not expected_path.exists():
        pytest.fail(f"{expected_path.relative_to(HERE)} is missing; create it with "
                    f"REMAT_UPDATE_GOLDEN=1 pytest tests/golden -k {path.stem} (and review it)")
    expected = expected_path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            str(expected_path.relative_to(HERE)), "actual output"))
        pytest.fail(f"golden mismatch for {path.relative_to(HERE)} (RUN: {' '.join(args)})\n{diff}\n"
                    f"If the new output is right: REMAT_UPDATE_GOLDEN=1 pytest tests/golden -k {path.stem}")
    if code == 0:
        # Every golden output is canonical IR: it parses, verifies and prints back unchanged.
        m = parse(actual)
        if "--no-verify" not in args:
            verify(m)
        assert str(m) == actual, f"{expected_path.name} is not a fixpoint of print(parse(...))"


def test_goldens_exist() -> None:
    assert golden_files(), "no golden files found"


def test_no_orphan_expected_files() -> None:
    """An expected file without its input is left over from a rename or deletion."""
    orphans = [p.relative_to(HERE) for p in HERE.rglob("*.expected") if not p.with_suffix(".ir").exists()]
    assert not orphans, f"expected files without a NAME.ir input: {orphans}"
