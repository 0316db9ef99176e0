"""The parity gate: a rung's per-step losses against the fp32 baseline's on the same batches."""
from __future__ import annotations

import math

# Max relative loss deviation allowed over a short run, by the rung's precision. fp32-equivalent
# changes (fused optimizer, compile, data loading) stay within rounding; TF32 rounds matmul inputs
# to 10 mantissa bits; 16-bit autocast to 7-8 bits.
TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "fp16-mixed": 2e-2, "bf16-mixed": 2e-2,
             "bf16-true": 5e-2}


def compare(losses: list[float], reference: list[float], precision: str) -> dict:
    """``{max_rel_dev, tolerance, passed}``; NaN/inf or a length mismatch always fails."""
    tol = TOLERANCE[precision]
    if not losses or len(losses) != len(reference):
        return {"max_rel_dev": None, "tolerance": tol, "passed": False,
                "reason": f"{len(losses)} losses against {len(reference)} reference losses"}
    if not all(math.isfinite(x) for x in losses):
        return {"max_rel_dev": None, "tolerance": tol, "passed": False, "reason": "NaN/inf loss"}
    dev = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))
    return {"max_rel_dev": dev, "tolerance": tol, "passed": dev <= tol}
