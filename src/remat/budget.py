"""Memory budgets: bytes, human sizes ('1.5GiB', '800MB') or fractions of a reference peak."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_budget(budget, reference: int | None = None) -> int:
    """Bytes from an int, a size string ('1.5GiB', '800 MB', '12345'), a percentage string
    ('40%') or a float fraction in (0, 1] of ``reference`` (e.g. the unconstrained peak).

    Raises ValueError saying what was wrong and what is valid.
    """
    valid = ("a number of bytes (int), a size such as '1.5GiB' or '800MB', a percentage such as '40%', "
             "or a fraction in (0, 1] of the unconstrained peak")
    if isinstance(budget, bool):
        raise ValueError(f"memory budget {budget!r} is not valid; give {valid}")
    if isinstance(budget, int) or (hasattr(budget, "__index__") and not isinstance(budget, float)):
        b = int(budget)
        if b <= 0:
            raise ValueError(f"memory budget {b} bytes must be positive")
        return b
    if isinstance(budget, float):
        if 0 < budget <= 1:
            return _fraction(budget, reference, valid)
        if budget > 1 and budget.is_integer():
            return int(budget)
        raise ValueError(f"memory budget {budget!r} is not valid; give {valid}")
    if isinstance(budget, str):
        s = budget.strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", s)
        if m:
            return _fraction(float(m.group(1)) / 100, reference, valid)
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)", s)
        if m and m.group(2).lower() in _UNITS:
            b = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if b <= 0:
                raise ValueError(f"memory budget {budget!r} must be positive")
            return b
    raise ValueError(f"memory budget {budget!r} is not valid; give {valid}")


def _fraction(frac: float, reference: int | None, valid: str) -> int:
    if not 0 < frac <= 1:
        raise ValueError(f"a fractional memory budget must be in (0, 1], got {frac}")
    if reference is None:
        raise ValueError("a fractional budget needs a reference peak (the unconstrained one); here give " + valid.split(", a percentage")[0])
    return int(frac * reference)
