"""Device models: what a device can hold and how fast it computes, for planning without it.

A :class:`DeviceSpec` gives a device's memory (bytes), its peak arithmetic rates (FLOP/s) for
matrix products per dtype and for everything else, its memory bandwidth (bytes/s), a kernel's
launch overhead (seconds) and its allocator's rounding (bytes). The cost model prices each
instruction on the device as a roofline (:meth:`DeviceSpec.seconds`), so that the same step planned
for an H100 and for this CPU can recompute different values: where arithmetic is cheap relative to
memory traffic, recomputing a matmul costs less than recomputing a normalisation.

:data:`DEVICES` is a small table of common devices (dense peak rates from the vendors' data sheets,
without sparsity; memory as the driver reports it); ``cpu`` is the cost model's nominal CPU, the
one plans use when no device is named, so ``device="cpu"`` plans exactly as no device does.
Users pass their own spec (``DeviceSpec(...)``, or a dict of its fields).
"""
from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping

from ..budget import parse_budget

_GiB = 1024**3
_MiB = 1024**2


@dataclass(frozen=True)
class DeviceSpec:
    """One device. Bytes, FLOP/s, bytes/s, seconds.

    ``matmul_flops``: peak rate of matrix products (matmul, convolution, attention) by IR dtype name
    ("f32", "bf16", "f16"; a dtype not listed computes at ``vector_flops``); ``vector_flops``: the
    rate of every other op (element-wise, reductions: no tensor cores); ``bandwidth``: memory
    bandwidth; ``launch_seconds``: per-kernel overhead; ``granularity``: the allocator rounds every
    allocation up to a multiple of it (PyTorch's CUDA caching allocator: 512 bytes)."""

    name: str
    memory_bytes: int
    matmul_flops: Mapping[str, float]
    vector_flops: float
    bandwidth: float
    launch_seconds: float = 5e-6
    granularity: int = 512
    notes: str = ""

    def seconds(self, flops: float, traffic: int, dtype: str | None, matmul: bool) -> float:
        """Roofline seconds of one kernel: its arithmetic at the rate for ``dtype`` or its memory
        traffic (bytes read and written), whichever takes longer, plus the launch overhead."""
        rate = self.matmul_flops.get(dtype, self.vector_flops) if matmul else self.vector_flops
        return max(flops / rate, traffic / self.bandwidth) + self.launch_seconds

    def summary(self) -> str:
        rates = ", ".join(f"{k} {v / 1e12:g}" for k, v in self.matmul_flops.items())
        return (f"{self.name}: {self.memory_bytes / _GiB:.1f} GiB, matmul TFLOP/s {rates}, other ops "
                f"{self.vector_flops / 1e12:g} TFLOP/s, {self.bandwidth / 1e9:g} GB/s, allocations rounded to "
                f"{self.granularity} B")

    @staticmethod
    def of(spec: Mapping[str, Any]) -> "DeviceSpec":
        """A spec from a dict of its fields (``memory_bytes`` may be a size such as "24GiB"); a
        ValueError naming missing or unknown fields."""
        names = {f.name for f in fields(DeviceSpec)}
        required = {f.name for f in fields(DeviceSpec) if f.default is MISSING}
        unknown, missing = set(spec) - names, required - set(spec)
        if unknown or missing:
            raise ValueError(f"a device spec needs {', '.join(sorted(required))} (optional: "
                             f"{', '.join(sorted(names - required))}); "
                             + (f"unknown: {', '.join(sorted(unknown))}" if unknown else "")
                             + ("; " if unknown and missing else "")
                             + (f"missing: {', '.join(sorted(missing))}" if missing else ""))
        d = dict(spec)
        d["memory_bytes"] = parse_budget(d["memory_bytes"])
        return DeviceSpec(**d)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * _GiB


# The nominal CPU of the static cost model (remat.plan.costmodel): 20 GFLOP/s, 10 GB/s, 2 us a call.
CPU = DeviceSpec("cpu", _host_memory(), {}, 2e10, 1e10, launch_seconds=2e-6, granularity=64,
                 notes="the static cost model's nominal CPU; memory: this machine's")

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    CPU,
    DeviceSpec("h100-80gb", 81559 * _MiB, {"f32": 67e12, "bf16": 989e12, "f16": 989e12}, 67e12, 3.35e12,
               notes="H100 SXM5: fp32 matmuls without TF32 (PyTorch's default)"),
    DeviceSpec("a100-80gb", 81920 * _MiB, {"f32": 19.5e12, "bf16": 312e12, "f16": 312e12}, 19.5e12, 2.039e12,
               notes="A100 SXM4 80 GB"),
    DeviceSpec("a100-40gb", 40960 * _MiB, {"f32": 19.5e12, "bf16": 312e12, "f16": 312e12}, 19.5e12, 1.555e12,
               notes="A100 SXM4 40 GB"),
    DeviceSpec("rtx4090-24gb", 24564 * _MiB, {"f32": 82.6e12, "bf16": 165e12, "f16": 165e12}, 82.6e12, 1.008e12,
               notes="GeForce RTX 4090: bf16 with fp32 accumulation"),
    DeviceSpec("l4-24gb", 23034 * _MiB, {"f32": 30.3e12, "bf16": 121e12, "f16": 121e12}, 30.3e12, 300e9,
               notes="L4"),
)}
"""The built-in devices by name."""


def device_spec(device: "str | DeviceSpec | Mapping[str, Any] | None") -> DeviceSpec | None:
    """The spec ``device`` names (a name of :data:`DEVICES`, a spec, or a dict of a spec's fields);
    None for None. ValueError for an unknown name, listing the known ones."""
    if device is None or isinstance(device, DeviceSpec):
        return device
    if isinstance(device, Mapping):
        return DeviceSpec.of(device)
    if isinstance(device, str):
        spec = DEVICES.get(device.strip().lower())
        if spec is None:
            raise ValueError(f"unknown device {device!r}; built-in devices: {', '.join(DEVICES)} "
                             "(or pass remat.DeviceSpec(...) or a dict of its fields)")
        return spec
    raise TypeError(f"device must be a name ({', '.join(DEVICES)}), a remat.DeviceSpec or a dict of its fields, "
                    f"got {type(device).__name__}")


__all__ = ["CPU", "DEVICES", "DeviceSpec", "device_spec"]
