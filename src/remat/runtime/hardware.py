"""What the processor a step runs on computes natively, where that decides whether a choice pays.

bf16 and fp16 halve activations' bytes on any processor, but they are faster than fp32 only where
the hardware computes in them: on a CPU, AVX-512 BF16 or AMX for bf16 and AMX-FP16 for fp16; a CPU
without them runs PyTorch's bf16 and fp16 matrix products and convolutions in scalar code, many
times slower than fp32 (``docs/guide.md``, Precision). :func:`precision_note` says so in words, for a
warning at compile time and for ``report()``.
"""
from __future__ import annotations

import functools
import platform
from typing import Any

_CPU_NATIVE = {"bf16": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
               "fp16": ("_is_amx_fp16_supported",)}
_CPU_INSTRUCTIONS = {"bf16": "AVX-512 BF16 or AMX", "fp16": "AMX-FP16"}


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """This machine's processor as the OS names it (``/proc/cpuinfo``'s model name on Linux), or
    ``platform.processor()``; "unknown" when neither says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def native_precision(precision: str, device: Any = None) -> bool:
    """Whether ``device`` (None or a CPU device: this machine's CPU) computes ``precision`` ("fp32",
    "bf16" or "fp16") natively. A CUDA device: fp16 always, bf16 where ``torch.cuda.is_bf16_supported``;
    other devices are assumed to."""
    import torch

    if precision == "fp32":
        return True
    kind = getattr(device, "type", device) or "cpu"
    if kind == "cpu":
        probes = [getattr(torch.cpu, name, None) for name in _CPU_NATIVE[precision]]
        return any(bool(p()) for p in probes if p is not None)
    if kind == "cuda" and precision == "bf16":
        return bool(torch.cuda.is_bf16_supported())
    return True


def precision_note(precision: str, device: Any = None) -> str | None:
    """A sentence for a step compiled at ``precision`` on ``device`` whose processor lacks the
    instructions for it (None where it has them, and for fp32)."""
    if native_precision(precision, device):
        return None
    kind = getattr(device, "type", device) or "cpu"
    if kind != "cpu":
        return f"this {kind} device does not compute {precision} natively: {precision} kernels may be slower than fp32"
    return (f"this CPU ({cpu_name()}) has no {_CPU_INSTRUCTIONS[precision]} instructions: PyTorch runs {precision} "
            f"matrix products and convolutions in scalar code there, many times slower than fp32; the step "
            f"still holds {precision} activations at half their fp32 bytes (precision='fp32' for speed)")


def warn_outside_remat(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` at the first caller outside the ``remat`` package (the user's line), however
    deep inside remat the warning is raised."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    level, frame = 2, sys._getframe(1)  # (stacklevel 1 is this function)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)


__all__ = ["cpu_name", "native_precision", "precision_note", "warn_outside_remat"]
