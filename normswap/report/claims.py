"""'Claims vs measured': the figures usually quoted for LayerNorm -> RMSNorm beside this run's.

Each row: the claim, a verdict (reproduced / not reproduced / not measurable here), the lines
measured for each compared model against the baseline, and what they mean — so a user sees what
the swap buys on *their* model and hardware (often: little end to end, because norms are a small
share of the work). Timed verdicts come from the ratios' intervals (normswap/stats/verdicts.py):
a claim is reproduced only when its whole interval meets it, and refuted only when none of it does, and
neither when the run's null control says the machine was too noisy to tell (the same rule that
decides a report's colours).
"""

from __future__ import annotations

from normswap.evaluate.speed_intervals import fmt_interval, intervals_of, throughput_method
from normswap.report.claim_words import NOT_MEASURABLE, NOT_REPRODUCED, REPRODUCED
from normswap.stats.verdicts import TOO_NOISY, claim_verdict, measurable, undecided

# The quoted figures: at least 10 % more tokens/s; at least 7 % less time inside the norms.
THROUGHPUT_CLAIM = 1.10
NORM_TIME_CLAIM = 1 - 0.07


def _pct(x):
    return f"{x * 100:,.1f}%"


def overall(verdicts: list[str]) -> str:
    """One verdict for a claim from the per-model ones: unanimous, else 'mixed'."""
    measured = [v for v in verdicts if v != NOT_MEASURABLE]
    if not measured:
        return NOT_MEASURABLE
    if all(v == measured[0] for v in measured):
        return measured[0]
    return "mixed (see per model)"


def _flops_claim(base, others):
    lines, verdicts = [], []
    for m in ([base] if base else []) + others:
        f = m.get("flops_per_token") or {}
        if not f.get("model_estimate"):
            continue
        share = f["norms"] / f["model_estimate"]
        lines.append(
            f"{m['name']}: {m.get('norm_layers', '?')} norm layers, {f['norms']:,} FLOPs/token "
            f"= {share * 100:.3f}% of ~{f['model_estimate']:,} (2 × parameters)"
        )
    b_flops = ((base or {}).get("flops_per_token") or {}).get("norms")
    for m in others:
        m_flops = (m.get("flops_per_token") or {}).get("norms")
        if b_flops and m_flops is not None and m.get("norm_classes") != (base or {}).get("norm_classes"):
            verdicts.append(REPRODUCED if m_flops <= 0.5 * b_flops + 1e-9 else NOT_REPRODUCED)
    return {
        "claim": "Norm FLOPs ~8d per token (LayerNorm) vs ~4d (RMSNorm): half the arithmetic",
        "verdict": overall(verdicts),
        "measured": lines,
        "meaning": "Counted from the layers, not timed. Halving a share this small cannot move end-to-end speed "
        "by itself; "
        "norms are bound by memory traffic, not arithmetic.",
    }


def _norm_time_claim(results, base, others):
    lines, verdicts = [], []
    if base is not None and (base.get("norm_time") or {}).get("norm_ms_per_forward"):
        b_ms = base["norm_time"]["norm_ms_per_forward"]
        lines.append(
            f"{base['name']}: {b_ms:.2f} ms per forward in norm layers ({_pct(base['norm_time_share'])} of the forward)"
        )
        for m in others:
            nt = m.get("norm_time") or {}
            if nt.get("norm_ms_per_forward") is None:
                continue
            iv = (intervals_of(m, results) or {}).get("norm_ms_per_forward")
            verdict = claim_verdict(iv, at_most=NORM_TIME_CLAIM)
            verdicts.append(verdict)
            # the instrument's ratio is the median of per-pair ratios, the one its interval brackets (the
            # ratio of the two models' median ms can fall outside it); hooked repeats: the ms ratio
            ratio = iv["median"] if iv and "pairs" in iv else nt["norm_ms_per_forward"] / b_ms
            change = 1 - ratio
            word = "less" if change >= 0 else "more"
            noisy = f" ({TOO_NOISY})" if iv and iv["verdict"] == TOO_NOISY else ""
            lines.append(
                f"{m['name']}: {nt['norm_ms_per_forward']:.2f} ms ({_pct(abs(change))} {word} time, ratio "
                f"×{ratio:.2f} {fmt_interval(iv) or '(no interval)'}; "
                f"{_pct(m['norm_time_share'])} of its forward): {verdict}{noisy}"
            )
    else:
        for m in [base] * (base is not None) + others:
            if m.get("norm_time_share") is not None:
                lines.append(f"{m['name']}: {_pct(m['norm_time_share'])} of the forward in norm layers")
    return {
        "claim": "RMSNorm takes 7-64% less time than LayerNorm",
        "verdict": overall(verdicts),
        "measured": lines or ["not measured in this run"],
        "meaning": "Kernel-level gains, measured here on the whole model's norm layers (each replaying the inputs "
        "it had in one inference forward; results from before that: hooked forwards). Reproduced when the whole "
        "interval of the time ratio shows at least 7% less time, not reproduced when none of it does.",
    }


def _amdahl_note(name, ratio, iv, bound) -> str | None:
    """Why a forward ratio above the Amdahl bound is not a speed-up the norms could have bought."""
    if ratio is None or ratio <= bound:
        return None
    head = f"{name}: forward ×{ratio:.2f} is above the Amdahl bound ×{bound:.2f}"
    if iv and iv["verdict"] == TOO_NOISY:
        return f"{head}, but the machine was {TOO_NOISY} (null control): not a gain this run can show"
    if not iv or iv["low"] <= bound:
        return (
            f"{head}, but its interval {fmt_interval(iv) or '(none)'} reaches below the bound: the excess is "
            "repeat-to-repeat noise of this machine, not a gain"
        )
    return (
        f"{head} over its whole bracket {fmt_interval(iv)}: making the norms free could not explain it, so the "
        "difference comes from outside the norm layers (the conversion also changes the linears' biases and the "
        "code path; on a model this small, per-call overheads dominate)"
    )


def _throughput_claim(results, base, others):
    lines, verdicts = [], []
    bound = None
    if base is not None and base.get("norm_time_share") is not None and base["norm_time_share"] < 1:
        bound = 1 / (1 - base["norm_time_share"])
    for m in others:
        r = (m.get("ratios") or {}).get("tokens_per_second") or {}
        ivs = (intervals_of(m, results) or {}).get("tokens_per_second") or {}
        parts = []
        for k in ("forward", "train_step", "prefill", "decode"):
            if r.get(k) is None:
                continue
            iv = ivs.get(k)
            note = f", {undecided(iv)}" if not measurable(iv) else ""
            parts.append(f"{k.replace('_', ' ')} ×{r[k]:.2f} {fmt_interval(iv) or '(no interval)'}{note}")
        if parts:
            verdict = claim_verdict(ivs.get("forward"), at_least=THROUGHPUT_CLAIM)
            verdicts.append(verdict)
            lines.append(f"{m['name']}: " + "; ".join(parts) + f" (forward: {verdict})")
    if bound is not None:
        lines.append(f"upper bound (Amdahl): norm time -> 0 would give at most ×{bound:.2f} on the forward")
        for m in others:
            note = _amdahl_note(
                m["name"],
                ((m.get("ratios") or {}).get("tokens_per_second") or {}).get("forward"),
                ((intervals_of(m, results) or {}).get("tokens_per_second") or {}).get("forward"),
                bound,
            )
            if note:
                lines.append(note)
    return {
        "claim": "10-30% higher throughput after the swap",
        "verdict": overall(verdicts),
        "measured": lines or ["needs --baseline and speed measurements"],
        "meaning": f"End-to-end tokens/s against the baseline: {throughput_method(results)}. "
        "Reproduced when the whole bracket is at least ×1.10, not reproduced when all of it is below.",
    }


def claims(results) -> list[dict]:
    models = results["models"]
    base = next((m for m in models if m["name"] == results.get("baseline")), None)
    others = [m for m in models if base is None or m["name"] != base["name"]]
    return [
        _flops_claim(base, others),
        _norm_time_claim(results, base, others),
        _throughput_claim(results, base, others),
    ]
