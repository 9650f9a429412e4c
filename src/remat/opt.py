"""``python -m remat.opt FILE [--passes a,b,c] [--print-after-all] [--no-verify] [--timing]``

The IR driver, in the spirit of ``mlir-opt``: parse a module (``-`` reads stdin), verify it, run the
named passes in order and print the resulting canonical IR on stdout. Errors go to stderr as
``error: ...`` (never a traceback), so stdout only ever holds IR: bad input (an unreadable file,
text that does not parse or verify, an unknown pass) exits with code 2, a failing pass with code 1.
Diagnostics (``--print-after-all``, ``--timing``) go to stderr too, as ``//`` comments.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence, TextIO

from .ir import Module, ParseError, VerificationError, parse, verify


BAD_INPUT, PASS_FAILED = 2, 1  # exit codes


def _count(m: Module) -> int:
    """Instructions in the module (all functions, all blocks)."""
    return sum(len(b.instrs) for f in m for b in f.blocks)


def _pass_names(spec: str) -> list[str]:
    return [p.strip() for p in spec.split(",") if p.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m remat.opt",
                                 description="Parse, verify and transform remat IR; print the result on stdout.")
    ap.add_argument("file", help="IR text file, or '-' for stdin")
    ap.add_argument("--passes", default="", metavar="A,B,C",
                    help="comma-separated pass names, run in order (see remat.passes)")
    ap.add_argument("--print-after-all", action="store_true",
                    help="print the IR after every pass to stderr, headed '// ----- after <pass> (N instructions, x ms)'")
    ap.add_argument("--no-verify", action="store_true", help="do not verify the input nor the IR after each pass")
    ap.add_argument("--timing", action="store_true", help="report each pass's time and instruction count on stderr")
    return ap


def run(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None) -> int:
    """Run the driver with ``argv`` (without the program name); return the exit code: 0, 1 (a pass
    failed) or 2 (bad input)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    args = build_parser().parse_args(argv)

    def fail(msg: str, code: int = BAD_INPUT) -> int:
        stderr.write(f"error: {msg.rstrip()}\n")
        return code

    from .pipeline import get_pass, run_pipeline

    names = _pass_names(args.passes)
    for name in names:  # all names checked before any work: a typo fails fast
        try:
            get_pass(name)
        except KeyError as e:
            return fail(str(e.args[0]))

    where = "<stdin>" if args.file == "-" else args.file
    try:
        text = stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
    except OSError as e:
        return fail(f"cannot read {where}: {e.strerror or e}")
    except UnicodeDecodeError as e:
        return fail(f"cannot read {where}: not UTF-8 text (byte {e.start}: {e.reason})")
    try:
        module = parse(text)
        if not args.no_verify:
            verify(module)
    except ParseError as e:
        return fail(f"{where}: {e}")
    except VerificationError as e:
        return fail(f"{where}: the input does not verify\n{e}")
    except Exception as e:  # never a traceback for bad input; the fuzz tests keep this branch unreached
        return fail(f"{where}: internal error while reading the input (a bug in remat, please report it): "
                    f"{type(e).__name__}: {e}")

    records: list[tuple[str, int, int, float]] = []  # (pass, instructions before, after, seconds)
    for name in names:
        before = _count(module)
        t0 = time.perf_counter()
        try:
            module = run_pipeline(module, [name], verify_each=not args.no_verify).module
        except VerificationError as e:
            return fail(f"the IR after pass '{name}' does not verify (a bug in the pass)\n{e}", PASS_FAILED)
        except Exception as e:  # a crashing pass: say which one, keep the traceback's gist
            return fail(f"pass '{name}' failed: {type(e).__name__}: {e}", PASS_FAILED)
        seconds = time.perf_counter() - t0
        records.append((name, before, _count(module), seconds))
        if args.print_after_all:
            stderr.write(f"// ----- after {name} ({_count(module)} instructions, {seconds * 1e3:.1f} ms)\n{module}")
            if len(module.functions):
                stderr.write("\n")
    if args.timing:
        total = sum(r[3] for r in records)
        for name, before, after, seconds in records:
            stderr.write(f"// {name}: {before} -> {after} instructions ({seconds * 1e3:.1f} ms)\n")
        stderr.write(f"// total: {len(records)} passes ({total * 1e3:.1f} ms)\n")
    stdout.write(str(module))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: exits with :func:`run`'s code."""
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
