"""What a compiled step is called with: its tensors positional or by keyword (Hugging Face style),
their compiled dtypes and ranks, and the non-tensor keyword options compiled in."""
from __future__ import annotations

from typing import Any, Sequence


class Signature:
    """The call signature of a step compiled on ``example`` (positional tensors, inputs then
    targets); ``names``: their keywords when compiled with keyword inputs, else None; ``options``:
    the non-tensor keyword inputs compiled in."""

    def __init__(self, example: Sequence, names: Sequence[str] | None, options: dict[str, Any]):
        self.example = tuple(example)
        self.names = None if names is None else list(names)
        self.options = options
        self.types = [(tuple(t.shape), t.dtype) for t in example]
        devices = {t.device for t in example if hasattr(t, "device")}
        self.device = devices.pop() if len(devices) == 1 else None  # where the inputs must be (placement)

    def keywords(self, inputs: tuple) -> tuple | dict[str, Any]:
        """The step's tensors as compiled: positional, or keyword (with the compiled keyword options)."""
        return inputs if self.names is None else {**dict(zip(self.names, inputs)), **self.options}

    def positional(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple:
        """The step's tensors in compiled order: positional as compiled, or by the compiled keywords."""
        names = self.names
        if names is None:
            if kwargs:
                raise TypeError(f"the step was compiled with positional inputs; got keywords {sorted(kwargs)}: "
                                "compile with a dict of keyword inputs to call it with keywords")
            return inputs
        for k, v in self.options.items():  # options: as compiled, or left out
            if k in kwargs:
                got = kwargs.pop(k)
                if type(got) is not type(v) or got != v:
                    raise TypeError(f"the step was compiled with {k}={v!r}; got {k}={got!r}: options are compiled in "
                                    f"(compile another step for {k}={got!r})")
        if inputs or set(kwargs) != set(names):
            missing, extra = [n for n in names if n not in kwargs], sorted(set(kwargs) - set(names))
            raise TypeError(f"the step was compiled with keyword inputs {', '.join(names)}; call it with exactly "
                            f"those keywords" + (f" (missing: {', '.join(missing)})" if missing else "")
                            + (f" (unexpected: {', '.join(extra)})" if extra else "")
                            + (f" and no positional inputs (got {len(inputs)})" if inputs else ""))
        return tuple(kwargs[n] for n in names)

    def arg_name(self, k: int) -> str:
        return f"argument {k}" if self.names is None else f"input {self.names[k]}="

    def check(self, inputs: Sequence) -> None:
        """TypeError unless ``inputs`` have the compiled count, dtypes and ranks."""
        if len(inputs) != len(self.types):
            raise TypeError(f"the step takes {len(self.types)} tensor(s) (inputs then targets), got {len(inputs)}")
        for k, (t, (shape, dtype)) in enumerate(zip(inputs, self.types)):
            if not hasattr(t, "shape") or len(t.shape) != len(shape) or getattr(t, "dtype", None) != dtype:
                got = f"{getattr(t, 'dtype', type(t).__name__)}{list(getattr(t, 'shape', []))}"
                raise TypeError(f"{self.arg_name(k)} of the training step: expected {dtype}{list(shape)} (as "
                                f"compiled; other sizes of the same dtype and rank get a plan of their own), got {got}")
            if self.device is not None and getattr(t, "device", self.device) != self.device:
                raise TypeError(f"{self.arg_name(k)} of the training step is on {t.device}, but the step runs on "
                                f"{self.device}, where its model is: move the batch there first (x.to({str(self.device)!r}))")
            if getattr(t, "requires_grad", False):
                raise TypeError(f"{self.arg_name(k)} of the training step requires grad, but the step computes the "
                                "gradients of the model's parameters only (an input gets none): pass it detached "
                                "(x.detach()), or make it a parameter of the model")

    def other_shapes(self, inputs: Sequence) -> bool:
        """Whether ``inputs`` are the compiled tensors with other shapes (a new batch size or
        sequence length): same count, dtypes and ranks."""
        return (len(inputs) == len(self.types)
                and all(hasattr(t, "shape") and getattr(t, "dtype", None) == dtype and len(t.shape) == len(shape)
                        for t, (shape, dtype) in zip(inputs, self.types))
                and any(tuple(t.shape) != shape for t, (shape, _) in zip(inputs, self.types)))

    def differences(self, inputs: Sequence) -> str:
        """The inputs whose shapes differ from the compiled ones, for an error message."""
        return "; ".join(f"{self.arg_name(k)}: expected {dtype}{list(shape)} (as compiled), got {t.dtype}{list(t.shape)}"
                         for k, (t, (shape, dtype)) in enumerate(zip(inputs, self.types)) if tuple(t.shape) != shape)
