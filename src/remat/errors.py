"""Errors users see, shared by every part of remat."""
from __future__ import annotations


class BudgetTooSmall(ValueError):
    """The memory budget is below the minimum any plan needs. ``minimum`` is that minimum, in bytes."""

    def __init__(self, budget: float, minimum: float, what: str = ""):
        self.budget = budget
        self.minimum = minimum
        where = f" for {what}" if what else ""
        super().__init__(f"memory budget of {format_bytes(budget)} is below the minimum feasible budget{where} of "
                         f"{format_bytes(minimum)} ({int(minimum)} bytes); give a budget >= {int(minimum)} bytes")


def format_bytes(n: float) -> str:
    """Human-readable bytes (binary units), e.g. 1536 -> '1.50 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError
