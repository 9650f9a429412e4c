"""Generated fused kernels (numba dialect) against the torch dialect op by op, and compile time.

Per size and body: median seconds over alternating runs of (a) the unfused instructions on the VM
with the torch dialect and (b) one fused instruction with the numba dialect, and the ratio; then
kernel preparation seconds of this process (cold if $REMAT_CACHE_DIR is empty; run again for warm).

    REMAT_CACHE_DIR=/tmp/rc PYTHONPATH=src python bench/fused_kernels.py   # twice: cold, then warm
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "backends"))
from test_fused_kernels import programs  # noqa: E402  (builds the fused and the unfused program)

from remat.backends import numba_kernels as nk  # noqa: E402
from remat.ir import DType, TensorType  # noqa: E402
from remat.runtime.vm import VM  # noqa: E402

BODIES = {
    "bias+relu": ("%2 = add(%0, %1) %3 = relu(%2) -> %3", lambda s: [s, s[-1:]]),
    "residual+scale": ("%3 = add(%0, %1) %4 = mul(%3, %2) -> %4", lambda s: [s, s, s[:-1] + (1,)]),
    "relu-grad": ("%2 = constant() {value=0.0} %3 = gt(%0, %2) %4 = select(%3, %1, %2) -> %4", lambda s: [s, s]),
    "grad-accum3": ("%3 = add(%0, %1) %4 = add(%3, %2) -> %4", lambda s: [s, s, s]),
}
SIZES = [(64, 128), (2048, 8000), (8, 256, 2048)]


def main(rounds: int = 7) -> None:
    t0 = time.perf_counter()
    import remat.backends as B

    B._load()
    print(json.dumps({"import_s": round(time.perf_counter() - t0, 3)}))
    prep = 0.0
    for name, (body, shapes) in BODIES.items():
        for size in SIZES:
            types = [TensorType(DType.f32, s) for s in shapes(size)]
            fused, ref = programs(body, types)
            before = nk.compile_count()
            prep_one = nk.prepare(fused)
            prep += prep_one
            rng = np.random.default_rng(0)
            args = [rng.standard_normal(t.shape).astype(np.float32) for t in types]
            vf, vr = VM(fused), VM(ref, dialects=("torch", "numpy"))
            tf, tr = [], []
            for r in range(rounds + 1):
                a, sa = vr.run("f", *args)
                b, sb = vf.run("f", *args)
                assert all(np.array_equal(x, y) for x, y in zip(a, b))
                if r:
                    tr.append(sa.total_seconds)
                    tf.append(sb.total_seconds)
            print(json.dumps({"body": name, "shape": list(size), "torch_op_by_op_ms": round(statistics.median(tr) * 1e3, 3),
                              "fused_numba_ms": round(statistics.median(tf) * 1e3, 3),
                              "ratio": round(statistics.median(tf) / statistics.median(tr), 3),
                              "prepare_s": round(prep_one, 3), "compiled": nk.compile_count() - before}), flush=True)
    print(json.dumps({"prepare_total_s": round(prep, 3), "kernels_compiled": nk.compile_count()}))


if __name__ == "__main__":
    main()
