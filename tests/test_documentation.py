"""The README and docs/ stay true: their Python examples run, their results are the generator's,
every public name is documented, and no development history creeps back into the project's text."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

import remat

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# ```python blocks run; ```python no-run blocks are sketches over the reader's own model and data.
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in BLOCK.finditer(text):
        info = m.group(1).strip()
        assert info in ("", "no-run"), f"{page.name}: unknown code block tag {info!r}"
        if info != "no-run":
            out.append((text.count("\n", 0, m.start()) + 2, m.group(2)))
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_python_examples_run(page, monkeypatch):
    """Each page's blocks run in order in one namespace, as a reader would paste them."""
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    for line, code in _blocks(page):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)


def _gen_results():
    spec = importlib.util.spec_from_file_location("gen_results", ROOT / "docs" / "gen_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_pages_are_the_generated_ones():
    gen = _gen_results()
    assert gen.DOC.read_text(encoding="utf-8") == gen.render_doc(), \
        "docs/results.md is out of date: run `python docs/gen_results.py`"
    readme = gen.README.read_text(encoding="utf-8")
    assert gen.update_readme(readme) == readme, "README.md's results table is out of date: run `python docs/gen_results.py`"
    assert gen.main(["--check"]) == 0


def test_every_public_name_is_documented():
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    missing = [n for n in remat.__all__ if not re.search(rf"`(remat\.)?{re.escape(n)}[`(\[. ]", text)]
    assert not missing, f"public names of remat documented nowhere in README.md or docs/: {missing} (see docs/api.md)"


def test_api_page_has_one_entry_per_public_name():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    entries = [n for line in re.findall(r"^### .*$", text, flags=re.M) for n in re.findall(r"`remat\.([A-Za-z_0-9]+)", line)]
    assert sorted(entries) == sorted(remat.__all__), "docs/api.md and remat.__all__ list different names"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    """Every relative link of a page names a file of the repository, and its #anchor a heading there."""
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", dest.read_text(encoding="utf-8"), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_readme_is_short():
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024, "README.md is over 12 KiB: move reference material to docs/"


HISTORY = re.compile(r"\bstops? ?[0-9]+", re.I)
TEXT_DIRS = ("docs", "src", "tests", "bench", "examples")
SUFFIXES = {".py", ".md", ".txt", ".json", ".csv", ".toml", ".ir", ".expected", ".cfg", ".ini", ""}


def _text_files():
    yield ROOT / "README.md"
    for d in TEXT_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if (p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
                    and not any(part.endswith(".egg-info") for part in p.parts)):  # build output, not text
                yield p


def test_no_development_history_in_the_text():
    """A change's story belongs in its commit message: no "stop N" dating in the project's text."""
    found = []
    for p in _text_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for m in HISTORY.finditer(text):
            found.append(f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    assert not found, "development history in the project's text:\n" + "\n".join(found[:20])


def test_torch_requirement_is_a_range():
    """The package installs beside the user's torch; only the Makefile pins this machine's build."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    (torch_req,) = [d for d in deps if re.match(r"torch\b", d)]
    assert "==" not in torch_req and ">=" in torch_req, torch_req
    assert "torch==" in (ROOT / "Makefile").read_text(encoding="utf-8")


def _commands(prefix: str) -> list[str]:
    """Commands quoted in README.md and docs/ (inline code or lines of ```sh blocks) starting with ``prefix``."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        quoted = re.findall(r"`([^`\n]+)`", text)
        for block in re.findall(r"^```(?:sh|bash)\n(.*?)^```", text, flags=re.S | re.M):
            quoted += [line.split("  #")[0] for line in block.splitlines()]
        for q in quoted:
            q = re.sub(r"^(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?", "", q.strip())
            if q.startswith(prefix):
                found.append(q.replace("\\|", "|"))
    return sorted(set(found))


def test_quoted_cli_commands_parse():
    """Every `remat <command> ...` the docs quote is accepted by the CLI's parser (optional parts in
    brackets are tried with their first alternative)."""
    from remat.cli import build_parser

    commands = [c for c in _commands("remat ") if not c.startswith("remat opt") and c.split()[1] != "<command>"]
    assert any(c.startswith("remat train") for c in commands)
    for c in commands:
        c = re.sub(r"\[([^\]|]+?)(?:\|[^\]]*)?\]", r"\1", c)     # [--data-parallel ddp|zero1] -> its first form
        c = re.sub(r"(\S+)\|\S+", r"\1", c)                       # ddp|zero1|zero2 -> ddp
        args = c.split()[1:]
        if args[-1] == "--help":
            continue
        build_parser().parse_args(args)


def test_quoted_scripts_and_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for c in _commands("make "):
        assert re.search(rf"^{re.escape(c.split()[1])}:", makefile, flags=re.M), f"no Makefile target for `{c}`"
    scripts = [c.split()[1] for c in _commands("python ") if c.split()[1].endswith(".py")]
    assert "docs/gen_results.py" in scripts and "bench/speed.py" in scripts
    for s in scripts:
        assert (ROOT / s).is_file(), f"the docs run `python {s}`, which does not exist"
