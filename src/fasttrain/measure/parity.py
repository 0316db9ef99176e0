"""The parity gate: a rung's per-step losses against the fp32 baseline's on the same batches."""
from __future__ import annotations

import math

# Max relative loss deviation allowed over a short run, by the rung's precision. fp32-equivalent
# changes (fused optimizer, compile, data loading) stay within rounding; TF32 rounds matmul inputs
# to 10 mantissa bits; 16-bit autocast to 7-8 bits.
TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "fp16-mixed": 2e-2, "bf16-mixed": 2e-2,
             "bf16-true": 5e-2}


def finite(x: float | None) -> bool:
    """A loss that is a finite number (rows written to files hold None for NaN/inf)."""
    return x is not None and math.isfinite(x)


def unrecovered(losses: list[float], skipped: list[int] | None = None) -> int | None:
    """The first step (1-based, warm-up included) whose non-finite loss counts as a failure,
    else None.

    Under fp16-mixed the GradScaler skips the optimizer step of a step whose gradients overflowed
    (NaN/inf) and lowers its scale; the weights are left as they were, so the run can go on. A
    non-finite loss at such a ``skipped`` step is excused when the run recovered (its last loss
    is finite). A non-finite loss at any other step fails, and so does every non-finite loss of
    a run that ends non-finite (it never recovered)."""
    bad = [i + 1 for i, x in enumerate(losses) if not finite(x)]
    if not bad:
        return None
    if finite(losses[-1]):
        excused = set(skipped or ())
        bad = [i for i in bad if i not in excused]
    return bad[0] if bad else None


def compare(losses: list[float], reference: list[float], precision: str,
            skipped: list[int] | None = None) -> dict:
    """``{max_rel_dev, tolerance, passed}``; a length mismatch always fails.

    ``skipped``: the steps (1-based, warm-up included) whose optimizer step the fp16 GradScaler
    skipped. A non-finite loss fails unless :func:`unrecovered` excuses it (a skipped step of a
    run that recovered); the deviation is then taken over the steps where both losses are finite,
    and ``excused`` counts the steps left out."""
    tol = TOLERANCE[precision]
    if not losses or len(losses) != len(reference):
        return {"max_rel_dev": None, "tolerance": tol, "passed": False,
                "reason": f"{len(losses)} losses against {len(reference)} reference losses"}
    bad = unrecovered(losses, skipped if precision == "fp16-mixed" else None)
    if bad is not None:
        return {"max_rel_dev": None, "tolerance": tol, "passed": False,
                "reason": f"NaN/inf loss at step {bad}"}
    pairs = [(a, b) for a, b in zip(losses, reference) if finite(a)]
    if not all(finite(b) for _, b in pairs):
        return {"max_rel_dev": None, "tolerance": tol, "passed": False,
                "reason": "NaN/inf reference loss"}
    dev = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    out = {"max_rel_dev": dev, "tolerance": tol, "passed": dev <= tol}
    if len(pairs) < len(losses):
        out["excused"] = len(losses) - len(pairs)
    return out


def compare_rows(row: dict, reference: dict, precision: str) -> dict:
    """:func:`compare` of two rows' losses, with the steps ``row``'s GradScaler skipped."""
    return compare(row["losses"], reference["losses"], precision, row.get("scaler_skips"))
