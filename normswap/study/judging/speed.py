"""The throughput claim, decided by what could have come out the other way — or not decided.

* **Samples.** Only timed steps count (measure.StepPlan). Within a seed, step t of an arm and step
  t of the baseline ran back to back (Williams order), so ``base_seconds / arm_seconds`` at step
  t is one paired quotient (> 1: the arm is faster).
* **Interval** (:func:`bootstrap_ratio`): a two-stage bootstrap blocked by seed — resample the
  seeds, then the timed steps within each drawn seed — of the median of the pooled quotients;
  the 2.5 and 97.5 percentiles. Seeds are the independent units (own initialisation, data
  order, and time on the machine), steps within a seed are not, so steps never stand in for seeds.
* **Amdahl bound** (:func:`amdahl_bound`): the most the swap could speed a step up, from the
  baseline's measured norm share ``s`` (profiled steps, study/measuring/measure.py) and the kernel speed-up
  ``k`` of the arm's norm over the baseline's (timed side by side, study/training/norm_impl.py):
  ``1 / ((1 − s) + s / k)``. Below the claim's threshold the claim cannot be reproduced by the
  swap on this model and machine, whatever the timings say: "not measurable here".
* **Gates** (:func:`throughput_verdict`), before any verdict: the machine's recorded load
  (1-minute load average, sampled at every profiled step) above its CPU count, or the null
  control (layernorm-control against layernorm: identical arms) outside normswap's null band
  (normswap/stats/verdicts.py ``null_is_tight``: the same rule and words as ``normswap eval``'s
  speed verdicts) — "too noisy to tell", and no verdict.
* Then: reproduced when the interval's low end reaches the threshold, not reproduced when its
  high end stays below it, else not measurable here.
"""

from __future__ import annotations

import math

from normswap.host import load_average
from normswap.report.claims import THROUGHPUT_CLAIM
from normswap.stats.bootstrap import seed_blocked_median_interval
from normswap.stats.levels import LEVEL
from normswap.stats.verdicts import NULL_BAND, TOO_NOISY, null_is_tight, null_within_band

LEGACY_UNTIMED = 2  # results written before study/measuring/measure.py's plan: steps 1 and 2 untimed
BOOTSTRAP_DRAWS = 2000
REPRODUCED, NOT_REPRODUCED, NOT_MEASURABLE = "reproduced", "not reproduced", "not measurable here"
METHOD = (
    "median of the per-step paired quotients (baseline seconds / arm seconds, timed steps only); "
    f"{LEVEL:.0%} interval: bootstrap blocked by seed (seeds resampled, then steps within each), "
    f"{BOOTSTRAP_DRAWS} draws"
)


def _timed(unit: dict) -> dict[int, float]:
    """{step: seconds} of the unit's timed steps."""
    secs = unit["step_seconds"]
    if "timed_steps" in unit:
        return {t: secs[t - 1] for t in unit["timed_steps"] if t - 1 < len(secs)}
    return {t: s for t, s in enumerate(secs, start=1) if t > LEGACY_UNTIMED or len(secs) <= LEGACY_UNTIMED}


def timed_seconds(unit: dict) -> list[float]:
    return list(_timed(unit).values())


def step_quotients(unit: dict, base: dict) -> list[float]:
    """base seconds / unit seconds at every timed step both have (> 1: the unit's arm is faster)."""
    a, b = _timed(unit), _timed(base)
    return [b[t] / a[t] for t in sorted(set(a) & set(b)) if a[t] > 0]


def bootstrap_ratio(per_seed: dict, *, draws: int = BOOTSTRAP_DRAWS, rng_seed: int = 0) -> dict | None:
    """``{median, low, high, repeats, seeds, method}`` from ``{seed: [paired quotients]}``; None
    without any quotient. ``repeats``: the number of quotients (the key ``null_is_tight`` reads)."""
    iv = seed_blocked_median_interval(per_seed, draws=draws, seed=rng_seed)
    if iv is None:
        return None
    return {k: iv[k] for k in ("median", "low", "high")} | {
        "repeats": iv["samples"],
        "seeds": iv["seeds"],
        "method": METHOD,
    }


def pooled_norm_share(units: list[dict]) -> dict | None:
    """The norms' share of a step over every profiled step of ``units`` (sum of norm seconds over
    sum of step seconds), with the per-step shares' range."""
    norm = step = 0.0
    per_step = []
    for u in units:
        ns = u.get("norm_share") or {}
        n, s = ns.get("norm_seconds"), ns.get("step_seconds")
        if isinstance(n, list) and isinstance(s, list):
            norm += sum(n)
            step += sum(s)
            per_step += [a / b for a, b in zip(n, s) if b > 0]
    if step <= 0:
        return None
    return {"share": norm / step, "steps": len(per_step), "min": min(per_step), "max": max(per_step)}


def amdahl_bound(share: float | None, speedup: float | None) -> float | None:
    """1 / ((1 − s) + s / k): the step's speed-up if only the norms (share s) ran k× faster."""
    if share is None or speedup is None or not (0 <= share < 1) or speedup <= 0:
        return None
    return 1.0 / ((1.0 - share) + share / speedup)


def busy(loads: list, cpus: int | None) -> float | None:
    """The highest recorded 1-minute load average when it exceeds the CPU count, else None."""
    vals = [v for v in loads if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals or not cpus:
        return None
    worst = max(vals)
    return worst if worst > cpus else None


def _null_within(control_iv: dict | None) -> bool:
    """The null rule of the instrument that measured ``control_iv``: the band alone for the timing
    phase's interval, ``null_is_tight`` (enough samples, then the band) for the interleaved steps of
    one process; both normswap/stats/verdicts.py."""
    if control_iv and control_iv.get("instrument") == "normswap.timing.compare":
        return null_within_band(control_iv["low"], control_iv["high"])
    return null_is_tight(control_iv)


def control_gate(control_iv: dict | None) -> dict:
    """Whether the null control says this machine could tell (the measuring instrument's null rule)."""
    return {"band": NULL_BAND, "interval": control_iv, "within": _null_within(control_iv)}


def use_speed_phase(comparisons: dict, phase: dict) -> dict:
    """The timing phase's intervals as each comparison's throughput (speed_phase.py): the timed arms'
    ratios; arms with layernorm's own step (the control, a planted arm) get none. Returns the null's
    interval: the throughput verdicts' control."""
    from normswap.study.measuring import speed_phase

    null = speed_phase.interval(phase["null"])
    for arm, cmp in comparisons.items():
        ratio = phase["candidates"].get(arm)
        # an arm with layernorm's own step (the control, a planted arm) is not timed again: no ratio of its own
        cmp["throughput_ratio_bootstrap"] = speed_phase.interval(ratio) if ratio else None
        cmp["throughput_same_step_as_baseline"] = ratio is None
        cmp["throughput_ratio"] = None  # the units' own step times (unpaired in workers) are not used
    return null


def _fmt(iv: dict | None) -> str:
    if not iv:
        return "n/a"
    return f"{iv['median']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def gates(
    control_iv: dict | None, bound: float | None, loads: list, cpus: int | None, threshold: float = THROUGHPUT_CLAIM
) -> dict:
    """Each reason a throughput verdict cannot be given, checked separately (results record them all)."""
    return {
        "amdahl_below_claim": bound is not None and bound < threshold,
        "busy_load": busy(loads, cpus),
        "cpus": cpus,
        "control_within": None if control_iv is None else _null_within(control_iv),
    }


def throughput_verdict(
    ratio_iv: dict | None,
    control_iv: dict | None,
    bound: float | None,
    loads: list,
    cpus: int | None,
    threshold: float = THROUGHPUT_CLAIM,
) -> tuple[str, str]:
    """(verdict, what decided it) for "≥ threshold× the training throughput" (see the module doc).
    Every gate that failed is named, the Amdahl bound first (a certainty), then the noise."""
    text = f"training tokens/s ratio {_fmt(ratio_iv)} (claim ≥ {threshold:.2f})"
    if control_iv is not None:
        text += f"; null control {_fmt(control_iv)}"
    if bound is not None:
        text += f"; Amdahl bound ×{bound:.3f}"
    g = gates(control_iv, bound, loads, cpus, threshold)
    noise = []
    if g["busy_load"] is not None:
        noise.append(f"load average {g['busy_load']:.2f} on {cpus} CPUs")
    if g["control_within"] is False:
        noise.append(f"the null control is not within ±{NULL_BAND:.0%} of 1")
    reasons = []
    if g["amdahl_below_claim"]:
        reasons.append(f"even the measured norm share at the measured kernel speed-up cannot give ×{threshold:.2f}")
    if noise:
        reasons.append(f"{TOO_NOISY}: " + " and ".join(noise))
    if g["amdahl_below_claim"]:
        return NOT_MEASURABLE, f"{text}: " + "; ".join(reasons)
    if noise:
        return NOT_MEASURABLE, f"{reasons[0]}; {text}"
    if control_iv is None:
        return NOT_MEASURABLE, f"{text}: no null control (layernorm-control) to tell noise from a difference"
    if ratio_iv is None or (ratio_iv.get("pairs") is None and ratio_iv.get("seeds", 0) < 2):
        return NOT_MEASURABLE, f"{text}: needs ≥ 2 seeds"
    if ratio_iv["low"] >= threshold:
        return REPRODUCED, text
    if ratio_iv["high"] < threshold:
        return NOT_REPRODUCED, text
    return NOT_MEASURABLE, text


def add_amdahl(comparisons: dict, baseline_units: list[dict], kernel_setup: dict) -> dict | None:
    """``comparisons[arm]["amdahl_bound"]`` (and its inputs) for every arm; the baseline's share."""
    share = pooled_norm_share(baseline_units)
    for arm, cmp in comparisons.items():
        k = ((kernel_setup.get("speedup") or {}).get(arm) or {}).get("speedup")
        cmp["amdahl_bound"] = amdahl_bound((share or {}).get("share"), k)
        cmp["amdahl_inputs"] = {"baseline_norm_share": share, "kernel_speedup": k}
    return share


def recorded_loads(load_start, units: dict) -> list[float]:
    """The 1-minute load averages recorded so far (at the start, now, and by each unit): speed.py's gate."""
    loads = [load_start, load_average()] + [v for u in units.values() for v in (u.get("load") or [])]
    return [v[0] if isinstance(v, list) else v for v in loads if v is not None]
