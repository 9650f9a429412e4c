"""Rebuild ``corpus.txt``, the demo's training text, from documentation that ships with CPython.

The corpus is plain English prose assembled offline (no downloads): the history section of
CPython's LICENSE.txt, the Zen of Python, and chapters of the language reference that ``pydoc``
carries in ``pydoc_data.topics``. All of it is CPython documentation under the PSF license.
The text is folded to printable ASCII (curly quotes become straight ones) so that the
character vocabulary stays small (about 90 symbols). Run: ``python -m remat.data.build_corpus``.
The checked-in file was built with CPython 3.11; other versions may differ slightly.
"""
from __future__ import annotations

import codecs
import os
import sys
import sysconfig
import unicodedata

# Language-reference topics in reading order; mostly prose, few grammar listings.
TOPICS = ("execmodel", "naming", "exceptions", "if", "while", "for", "try", "with", "function", "class",
          "truth", "booleans", "comparisons", "assignment", "import", "lambda")
TARGET_BYTES = 60_000  # stop after the topic that crosses this size

_FOLD = {"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "--",
         "\u2026": "...", "\u00a0": " ", "\u2192": "->", "\u00d7": "x"}


def _ascii(text: str) -> str:
    """Printable ASCII plus newlines: fold typographic characters, drop whatever else remains."""
    text = "".join(_FOLD.get(ch, ch) for ch in text)
    text = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in text if ch == "\n" or 32 <= ord(ch) < 127)


def _license_history() -> str:
    """Section A of CPython's LICENSE.txt (the history of the software), without the table."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    start = text.index("A. HISTORY OF THE SOFTWARE")
    end = text.index("Release         Derived")  # the release table that follows the prose
    return text[start:end].rstrip() + "\n"


def _zen() -> str:
    import this  # noqa: F401  (prints the Zen on import; captured below instead)

    return "The Zen of Python, by Tim Peters\n\n" + codecs.decode(this.s, "rot13").split("\n\n", 1)[1]


def build() -> str:
    """The corpus text."""
    import pydoc_data.topics as topics

    parts = [_license_history(), _zen()]
    size = sum(len(p) for p in parts)
    for name in TOPICS:
        if size >= TARGET_BYTES:
            break
        parts.append(topics.topics[name])
        size += len(parts[-1])
    return _ascii("\n\n".join(p.strip("\n") for p in parts) + "\n")


if __name__ == "__main__":
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # ``import this`` prints
        text = build()
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus.txt")
    with open(out, "w", encoding="ascii", newline="\n") as fh:
        fh.write(text)
    print(f"wrote {len(text):,} characters ({len(set(text))} distinct) to {out}")
