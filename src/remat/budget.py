"""Memory budgets: bytes, human sizes ('1.5GiB', '800MB') or fractions of a reference peak."""
from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


@dataclass(frozen=True)
class Budget:
    """A parsed budget: bytes, or a fraction of a reference peak not known yet (the unconstrained
    one, known once the step is differentiated). Parsed once, when the options are checked."""

    nbytes: int | None = None       # absolute bytes
    fraction: float | None = None   # of the reference peak, in (0, 1]

    @staticmethod
    def of(budget) -> "Budget":
        """The budget ``budget`` (any form :func:`parse_budget` takes); ValueError when not valid."""
        frac = _fraction_of(budget)
        return Budget(fraction=frac) if frac is not None else Budget(nbytes=parse_budget(budget))

    def resolve(self, reference: int) -> int:
        """Bytes, a fraction taken of ``reference`` (bytes)."""
        return self.nbytes if self.nbytes is not None else int(self.fraction * reference)


def _fraction_of(budget) -> float | None:
    """The fraction a fractional budget ('40%', 0.4) names, else None (checked: in (0, 1])."""
    if isinstance(budget, float) and 0 < budget <= 1:
        return budget
    if isinstance(budget, str):
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", budget.strip())
        if m:
            frac = float(m.group(1)) / 100
            if not 0 < frac <= 1:
                raise ValueError(f"a fractional memory budget must be in (0, 1], got {frac}")
            return frac
        if _POINT_NUMBER.fullmatch(budget.strip()):  # a number spelled as a float: what that float means
            return _fraction_of(float(budget))
    return None


_EXPONENT = r"(?:[eE][+-]?[0-9]+)"
_POINT_NUMBER = re.compile(rf"(?:[0-9]*\.[0-9]+|[0-9]+\.){_EXPONENT}?|[0-9]+[eE]-[0-9]+")
"""A number spelled as a float (a point, or a negative exponent): '0.5', '1e-1' (a fraction), '2.'."""


def parse_budget(budget, reference: int | None = None) -> int:
    """Bytes from an int, a size string ('1.5GiB', '800 MB', '12345'), a percentage string
    ('40%') or a float fraction in (0, 1] of ``reference`` (e.g. the unconstrained peak). A string
    spelling a number means that number ('0.5' and '5e-1' are 0.5: half the reference; '1000' and '1e3'
    are 1000 bytes); a
    whole float above 1 is bytes (``100.0`` is 100 bytes, where ``1.0`` is the whole reference).

    Raises ValueError saying what was wrong and what is valid.
    """
    valid = ("a number of bytes (int), a size such as '1.5GiB' or '800MB', a percentage such as '40%', "
             "or a fraction in (0, 1] of the unconstrained peak")
    if isinstance(budget, bool):
        raise ValueError(f"memory budget {budget!r} is not valid; give {valid}")
    if isinstance(budget, str) and _POINT_NUMBER.fullmatch(budget.strip()):
        budget = float(budget)  # '0.5' means 0.5 (half the reference), '2.5' what 2.5 means (not valid)
    if isinstance(budget, int) or (hasattr(budget, "__index__") and not isinstance(budget, float)):
        b = int(budget)
        if b <= 0:
            raise ValueError(f"memory budget {b} bytes must be positive")
        return b
    frac = _fraction_of(budget)
    if frac is not None:
        return _fraction(frac, reference, valid)
    if isinstance(budget, float):
        if budget > 1 and budget.is_integer():
            return int(budget)
        raise ValueError(f"memory budget {budget!r} is not valid; give {valid}")
    if isinstance(budget, str):
        s = budget.strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)", s)
        if m and m.group(2).lower() in _UNITS:
            b = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if b <= 0:
                raise ValueError(f"memory budget {budget!r} must be positive")
            return b
    raise ValueError(f"memory budget {budget!r} is not valid; give {valid}")


def _fraction(frac: float, reference: int | None, valid: str) -> int:
    if reference is None:
        raise ValueError("a fractional budget needs a reference peak (the unconstrained one); here give " + valid.split(", a percentage")[0])
    return int(frac * reference)
