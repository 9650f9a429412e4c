"""Errors users see, shared by every part of remat."""
from __future__ import annotations


class BudgetTooSmall(ValueError):
    """The memory budget is below the minimum any plan needs. ``minimum`` is that minimum, in bytes:
    the smallest budget the raising planner can meet (or, where it says so in ``detail``, a proven
    lower bound). The one such error of remat: every planner raises it.

    ``what``: what was planned ("this training step"); ``detail``: how the minimum was found;
    ``unconstrained_peak``: the step's peak without recomputation, in bytes, when the raiser knows it
    (``remat.compile`` does: relative budgets are fractions of it), else None."""

    def __init__(self, budget: float, minimum: float, what: str = "", *, detail: str = "",
                 unconstrained_peak: int | None = None):
        self.budget = budget
        self.minimum = int(minimum)
        self.detail = detail
        self.unconstrained_peak = unconstrained_peak
        where = f" for {what}" if what else ""
        super().__init__(f"memory budget of {format_bytes(budget)} ({int(budget)} bytes) is below the minimum feasible budget{where} of "
                         f"{format_bytes(minimum)} ({int(minimum)} bytes); give a budget >= {int(minimum)} bytes"
                         + (f" ({detail})" if detail else ""))

    def __reduce__(self):
        """Pickled with its message and attributes (a rank's refusal travels to the others)."""
        return _restore, (type(self), str(self), self.__dict__)


class NonFiniteStep(FloatingPointError):
    """A training step compiled with ``on_nonfinite="raise"`` met a NaN or infinite loss or gradient.
    Nothing was updated: parameters, optimizer state and step counts are as before the step.
    ``step``: the optimizer step it would have taken (1-based); ``call``: the step's call number
    (1-based); ``loss``: the step's loss."""

    def __init__(self, step: int, call: int, loss: float):
        self.step, self.call, self.loss = step, call, loss
        what = f"the loss is {loss}" if loss != loss or loss in (float("inf"), float("-inf")) else \
            f"the loss is finite ({loss:.6g}) but a gradient has a NaN or infinite element"
        super().__init__(f"training step {call} (optimizer step {step}): {what}; nothing was updated (parameters, "
                         "optimizer state and step counts are as before the step). Compile with "
                         "on_nonfinite='skip' to skip such steps and count them in report().skipped_steps")

    def __reduce__(self):
        return _restore, (type(self), str(self), self.__dict__)


class StepFailed(RuntimeError):
    """A kernel failed during a training step (out of memory, a backend error). ``updated``: the
    parameters (by name) whose in-place update had already run, with their optimizer state (empty
    with ``atomic=True``: ``restored`` names those rolled back from the step's backups); every
    other parameter and its state, the optimizer's step counts, buffers, ``.grad`` and torch's random
    state are as before the step. ``instruction``: the step program's instruction that failed; the
    original error is the ``__cause__``."""

    def __init__(self, call: int, instruction: int, what: str, updated: list[str], total: int,
                 restored: list[str] = ()):
        self.call, self.instruction, self.updated, self.restored = call, instruction, list(updated), list(restored)
        if restored:
            state = (f"{len(restored)} parameter(s) had been updated and were rolled back from the step's backups "
                     "(atomic=True): parameters, optimizer state and step counts, buffers, .grad and torch's random "
                     "state are as before the step")
        elif updated:
            shown = ", ".join(updated[:8]) + (f" and {len(updated) - 8} more" if len(updated) > 8 else "")
            state = (f"{len(updated)} of {total} parameter(s) were already updated, with their optimizer state: "
                     f"{shown}; the others, the optimizer's step counts, buffers, .grad and torch's random state "
                     "are as before the step (restore the updated ones from a checkpoint, or retry from one)")
        else:
            state = ("nothing was updated: parameters, optimizer state and step counts, buffers, .grad and torch's "
                     "random state are as before the step")
        super().__init__(f"training step {call} failed at instruction {instruction}: {what}\n{state}")

    def __reduce__(self):
        return _restore, (type(self), str(self), self.__dict__)


def _restore(cls: type, message: str, state: dict) -> Exception:
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    e.__dict__.update(state)
    return e


def format_bytes(n: float) -> str:
    """Human-readable bytes (binary units), e.g. 1536 -> '1.50 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError
