"""The one pass rule of every exactness check (convert's verification, slice's rotation check).

It answers two questions separately, because one float32 comparison cannot answer both:

1. Is the conversion *mathematically* exact? The candidate's weights computed in float64 run in
   float64 against the source in float64 on the probe: a correct fold reads ~1e-14 (float64
   rounding), a wrong fold of any one tensor is off by many orders of magnitude more.
   ``EXACT_FLOAT64`` bounds it, or EXACT_FLOOR_SHARE x the source's float32 floor (capped) for
   modeling code that computes parts in float32 whatever the dtype (below).
2. How far does the float32 deployment drift? The candidate in float32 against the source in
   float64 (the value both float32 runs round), held to ``--tolerance`` or to 4x the source's own
   float32-vs-float64 floor where that is larger — the floor's share capped at ``FLOOR_CAP``, so
   a checkpoint cannot inflate the rule (security.md S7.3). A source whose own floor exceeds the cap
   is not numerically stable in float32: refused as such unless the user widens ``--tolerance``.
"""

from __future__ import annotations

import torch

# Question 1's bound. Most compat rows read 3e-15 to 1e-13 in float64 (results/exact-bound-rows-20261207T0322Z);
# float64 rounding is 2^29 times finer than float32's, so a source whose float32 floor is F nats reads
# about F·2e-9 when converted correctly (the inflated-floor model of tests/test_pass_rule_capped.py:
# floor 5.6, float64 1.2e-8). 1e-7 leaves such a model 8x room, is 100x below the float32 tolerance,
# and 200x below a planted error of 2e-5 in one logit bias. But a float64 run is only as float64 as
# the modeling code: OLMo and Cohere compute their LayerNorm in float32 in any dtype, so their
# "float64" figure is part float32 rounding (olmo 3.8e-7 = 0.58x its float32 floor, cohere 3.0e-8 =
# 0.35x): the bound grows to EXACT_FLOOR_SHARE x the source's float32 floor, capped like question 2's.
EXACT_FLOAT64 = 1e-7
EXACT_FLOOR_SHARE = 2
# Question 2: the largest source float32 noise floor that may widen the bound. The compat rows'
# floors are ≤ 1.5e-5 (ctrl, √d-scaled embeddings; the rest ≤ 6.5e-6, results/exact-bound-rows-20261207T0322Z):
# 1e-4 leaves them 6x room, and caps what any checkpoint can make the float32 threshold at 4e-4.
FLOOR_CAP = 1e-4
FLOOR_FACTOR = 4


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def judge(
    *,
    exact_float64: float | None,
    drift_float32: float,
    noise_floor: float | None,
    tolerance: float,
    rounding_floor: float | None = None,
) -> dict:
    """The verdict from the measured figures: {threshold, exact_threshold, floor_used, passed, reason}.

    ``exact_float64``: max |Δ| candidate (float64 weights, float64 run) vs source (float64), None
    where the model cannot run in float64 (then question 2 alone decides, against the float32 source).
    ``drift_float32``: max |Δ| candidate in float32 vs the source in float64 (or float32, see above).
    ``noise_floor``: max |Δ| source float32 vs float64. ``rounding_floor``: for 16-bit outputs, what
    rounding the candidate's weights alone moves (the output dtype's own loss, asked for by the user).
    """
    floor = noise_floor or 0.0
    used = min(floor, FLOOR_CAP)
    threshold = max(tolerance, FLOOR_FACTOR * used, FLOOR_FACTOR * (rounding_floor or 0.0))
    exact_threshold = max(EXACT_FLOAT64, EXACT_FLOOR_SHARE * used)
    out = {
        "threshold": threshold,
        "exact_threshold": exact_threshold,
        "floor_used": used,
        "floor_cap": FLOOR_CAP,
    }
    if exact_float64 is not None and not exact_float64 <= exact_threshold:
        out["passed"] = False
        out["reason"] = f"not exact: float64 max |Δ| = {exact_float64:.3g} > {exact_threshold:.2g}"
    elif drift_float32 <= threshold:
        out["passed"] = True
    elif floor > FLOOR_CAP and drift_float32 <= max(tolerance, FLOOR_FACTOR * floor):
        out["passed"] = False
        out["unstable"] = True
        out["reason"] = (
            f"the source is not numerically stable in float32: its own float32 rounding moves the outputs by "
            f"{floor:.3g} (> the cap {FLOOR_CAP:.0e}), so float32 drift of {drift_float32:.3g} cannot be told from "
            "an error"
            + ("" if exact_float64 is None else f"; the conversion is exact in float64 (max |Δ| {exact_float64:.3g})")
            + f"; pass --tolerance {drift_float32:.2g} to accept that float32 drift"
        )
    else:
        out["passed"] = False
        out["reason"] = f"float32 drift {drift_float32:.3g} > {threshold:.3g}"
    return out
