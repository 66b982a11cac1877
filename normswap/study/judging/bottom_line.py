"""What a study found, in words: the bottom line (quality, speed, memory, stability), and every
measured difference as a verdict.

Nothing here judges a claim: the verdicts come from results.json (``claims``, written by
claim_judges.py) and from each interval's own ``verdict`` (normswap/stats/t_intervals.py). This module only says them in
plain language, each with the numbers behind it and what would change it, and reads every key
it does not strictly need with ``.get`` so that an older results.json still renders.
"""

from __future__ import annotations

import math
import statistics

from normswap.report.claim_words import NOT_MEASURABLE, NOT_REPRODUCED, REPRODUCED
from normswap.report.claims import THROUGHPUT_CLAIM as THROUGHPUT_THRESHOLD  # "10–30 % faster": its lower end
from normswap.report.tables import grouped
from normswap.stats.t_intervals import fmt_t_interval
from normswap.stats.verdicts import NO_DIFFERENCE, TOO_NOISY


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def primary_arm(results) -> str | None:
    """The arm the bottom line is about: RMSNorm when the study has it, else the first compared arm."""
    cmp = [a for a in results.get("comparisons") or {} if a != results.get("control")]
    return "rmsnorm" if "rmsnorm" in cmp else (cmp[0] if cmp else None)


def claim_of(results, prefix: str, arm: str) -> dict | None:
    return next((c for c in results.get("claims") or [] if c["claim"].startswith(prefix) and c.get("arm") == arm), None)


def ref_units(results, arm):
    ref = results["setup"].get("reference_multiplier", 1.0)
    return [u for u in results.get("units") or [] if u["arm"] == arm and u.get("lr_multiplier", ref) == ref]


def _share(u) -> float | None:
    return _num(((u.get("timing") or {}).get("norm_share") or {}).get("share"))


def share_range(results, arm) -> tuple[float, float] | None:
    """Lowest and highest norm share of the step over the arm's seeds."""
    vals = [v for v in (_share(u) for u in ref_units(results, arm)) if v is not None]
    return (min(vals), max(vals)) if vals else None


def pct_range(r) -> str:
    if r is None:
        return "n/a"
    lo, hi = r[0] * 100, r[1] * 100
    return f"{lo:.1f}%" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}%"


def mean_final_loss(results, arm) -> float | None:
    vals = [_num(u.get("final_eval_loss")) for u in ref_units(results, arm)]
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def amdahl_bound(cmp: dict) -> float | None:
    """comparisons[arm].amdahl_bound: a number, or a dict holding it (``bound`` / ``value`` / ``mean``)."""
    b = cmp.get("amdahl_bound")
    if isinstance(b, dict):
        b = next((b[k] for k in ("bound", "value", "mean", "speedup") if _num(b.get(k)) is not None), None)
    return _num(b)


def kernel_words(results, arm) -> str | None:
    """``normswap rms_norm (fused), bfloat16`` from units[*].norm_kernel / norm_kernel_fused /
    norm_compute_dtype, when the study recorded them."""
    for u in ref_units(results, arm):
        name = u.get("norm_kernel")
        if name:
            fused = u.get("norm_kernel_fused")
            said = "fused" in name or "composite" in name  # a label that already says which
            words = name + ("" if fused is None or said else (" (fused)" if fused else " (composite)"))
            dtype = u.get("norm_compute_dtype")
            return words + (f", computing in {dtype}" if dtype else "")
    return None


def kernels_words(setup: dict) -> str:
    """setup.kernels: the option's name (older studies) or the kernel set-up (the option and the
    RMSNorm implementation it chose)."""
    k = setup.get("kernels", "?")
    if isinstance(k, dict):
        return f"{k.get('option', '?')} (RMSNorm implementation: {k.get('rms_impl', '?')})"
    return str(k)


def kernel_speedup(results, arm) -> float | None:
    """The arm's norm kernel speed-up over the baseline's, measured before training (setup.kernels)."""
    k = results["setup"].get("kernels")
    row = ((k.get("speedup") or {}).get(arm) if isinstance(k, dict) else None) or {}
    return _num(row.get("speedup") if isinstance(row, dict) else row)


def throughput_interval(cmp: dict) -> tuple[dict | None, str]:
    """The interval the throughput verdict rests on: the bootstrap over timed steps blocked by seed
    when the study has it (as ``{mean, low, high}``), else the t-interval over per-seed medians."""
    b = cmp.get("throughput_ratio_bootstrap")
    if isinstance(b, dict) and _num(b.get("median")) is not None:
        verdict = "higher" if b["low"] > 1 else "lower" if b["high"] < 1 else NO_DIFFERENCE
        n = b.get("seeds")
        iv = {"mean": b["median"], "low": b["low"], "high": b["high"], "n": n, "verdict": verdict}
        if b.get("pairs") is not None:  # the timing phase (speed_phase.py)
            return iv, f"timing phase: median of {b['pairs']} interleaved pairs of one training step, bootstrap"
        return iv, f"median of step-time quotients, bootstrap blocked by seed ({b.get('repeats', '?')} steps)"
    return cmp.get("throughput_ratio"), "mean of per-seed medians, t-interval"


def _iv(iv, spec, unit=""):
    return fmt_t_interval(iv, spec) + unit


def _seeds(iv) -> str:
    if not iv:
        return ""
    n = iv.get("n")
    return f" ({n} seed{'s' if n != 1 else ''}, paired)" if n else ""


def _verdict_word(iv, higher: str, lower: str) -> str:
    """The interval's own verdict in words."""
    if not iv:
        return "not measured"
    return {"higher": higher, "lower": lower}.get(iv.get("verdict"), iv.get("verdict") or NO_DIFFERENCE)


def lm_eval_rows(results) -> tuple[list[str], list[list[str]]] | None:
    """results.json ``lm_eval`` ({arm: {seed, scores: {task: {metric: value}}}}): one row per arm."""
    table = results.get("lm_eval")
    if not isinstance(table, dict) or not table:
        return None
    cols = []
    for row in table.values():
        for task, scores in (row.get("scores") or {}).items():
            for metric, v in (scores or {}).items():
                if isinstance(v, (int, float)) and not metric.endswith("_stderr") and (task, metric) not in cols:
                    cols.append((task, metric))
    header = ["arm", "seed"] + [f"{t} {m}" for t, m in cols]
    rows = []
    for arm, row in table.items():
        scores = row.get("scores") or {}
        cells = [scores.get(t, {}).get(m) for t, m in cols]
        rows.append([arm, str(row.get("seed", "?"))] + ["n/a" if v is None else f"{v:.4f}" for v in cells])
    return header, rows


# ------------------------------------------------------------------------------- bottom line
def _quality(results, arm) -> dict:
    cmp = results["comparisons"][arm]
    base, control = results.get("baseline", "layernorm"), results.get("control")
    claim = claim_of(results, "equal loss", arm)
    verdict = claim["verdict"] if claim else NOT_MEASURABLE
    d = cmp.get("final_eval_loss_difference")
    margin = _num(results["setup"].get("margin_nats"))
    margin_words = f"±{margin:g} nats" if margin is not None else "±1% of the loss"
    base_loss, arm_loss = mean_final_loss(results, base), mean_final_loss(results, arm)
    lines = [
        f"final held-out loss, {arm} − {base}: {_iv(d, '+.4f', ' nats')}{_seeds(d)}: "
        + _verdict_word(d, f"{arm} higher (worse)", f"{arm} lower (better)")
    ]
    if base_loss is not None and arm_loss is not None:
        lines.append(f"mean final held-out loss: {base} {base_loss:.3f}, {arm} {arm_loss:.3f} nats")
    bl = results.get("baselines") or {}
    uni, bi = _num(bl.get("unigram_loss")), _num(bl.get("bigram_loss"))
    if uni is not None or bi is not None:
        lines.append(
            "reference models on the same text: "
            + ", ".join(f"{n} {v:.3f} nats" for n, v in (("unigram", uni), ("bigram", bi)) if v is not None)
        )
    ctl = (results["comparisons"].get(control) or {}).get("final_eval_loss_difference") if control else None
    if ctl:
        lines.append(f"null control ({control} − {base}): {_iv(ctl, '+.4f', ' nats')}: the noise floor")
    lm = lm_eval_rows(results)
    if lm:
        header, rows = lm
        by = {r[0]: r for r in rows}
        if base in by and arm in by and len(header) > 2:
            lines.append(
                f"lm-eval (seed {rows[0][1]} shown; paired over seeds in results lm_eval): "
                + "; ".join(f"{h} {base} {by[base][i]}, {arm} {by[arm][i]}" for i, h in enumerate(header) if i >= 2)
            )
    if claim:
        lines.append(f"equivalence (margin {margin_words}): {claim['decided_by']}")
    lines += how_we_know(results, arm)
    learned = not (bi is not None and base_loss is not None and margin is not None and base_loss > bi - margin)
    if verdict == REPRODUCED:
        says = f"{arm} reaches the same held-out loss as {base}, within {margin_words}."
        if d and d.get("verdict") in ("higher", "lower"):  # equivalent by the margin, yet measurably apart
            says += (
                f" Inside that margin it is measurably {'worse' if d['verdict'] == 'higher' else 'better'}: "
                f"{_iv(d, '+.4f', ' nats')}."
            )
        change = "a difference smaller than the margin, or one that appears later in training or at another scale."
    elif verdict == NOT_REPRODUCED:
        says = f"{arm} ends at a different held-out loss than {base}: {_iv(d, '+.4f', ' nats')}."
        change = "more seeds could narrow the interval; another model, data set or length could differ."
    elif not learned:
        says = f"the models end no better than a bigram model ({bi:.3f} nats) by {margin_words}."
        change = "a longer run (more --steps) or more data, until every arm beats the bigram baseline by the margin."
    else:
        says = f"the interval of the difference is wider than the margin {margin_words}."
        change = (
            "more seeds (--max-seeds / --budget) or more held-out tokens, to narrow the interval inside the margin."
        )
    return {"topic": "quality", "verdict": verdict, "says": says, "evidence": lines, "change": change}


def how_we_know(results, arm) -> list[str]:
    """The equal-loss test checked in the same run: the null control must come out equivalent and
    the planted handicap different (claims.instrument_check); and what this run's seeds can detect."""
    lines = []
    check = results.get("instrument_check") or {}
    for name, r in (check.get("arms") or {}).items():
        d = (results["comparisons"].get(name) or {}).get("final_eval_loss_difference")
        lines.append(
            f"how we know: {r['role']} {name} − layernorm {_iv(d, '+.4f', ' nats')}: {r['finding']} "
            f"(expected {r['expected']}{'' if r['as_expected'] else ' — NOT as expected'})"
        )
    if check:
        lines.append(
            "how we know: the test went both ways in this run"
            if check.get("ok")
            else "how we know: the test did NOT show both outcomes in this run: read the verdict with that in mind"
        )
    row = ((results.get("power") or {}).get("arms") or {}).get(arm) or {}
    if row.get("sd") is not None:
        det = row["detects_with_80_power"]
        need = row.get("seeds_for_equivalence_at_zero")
        lines.append(
            f"power: {row['n']} seeds, paired sd {row['sd']:.4f} nats: 90 % half-width {row['half_width_90']:.4f}; "
            f"detects a difference of {det['difference_from_zero']:.4f} nats from 0 (α 0.05, 80 % power); "
            f"equivalence power at a true 0: {row['equivalence_power_at_zero']:.0%}"
            + (f"; {need} seeds would give it 80 %" if need else "")
        )
    return lines


def _speed(results, arm) -> dict:
    cmp = results["comparisons"][arm]
    base, control = results.get("baseline", "layernorm"), results.get("control")
    claim = claim_of(results, "10", arm) or claim_of(results, "throughput", arm)
    verdict = claim["verdict"] if claim else NOT_MEASURABLE
    tr, how = throughput_interval(cmp)
    lines = [
        f"training tokens/s, {arm} ÷ {base}: {_iv(tr, '.3f')} ({how}): "
        + _verdict_word(tr, f"{arm} faster", f"{arm} slower")
    ]
    shares = {a: share_range(results, a) for a in (base, arm)}
    if all(shares.values()):
        sd = cmp.get("norm_share_difference")
        lines.append(
            f"norm share of a step: {arm} {pct_range(shares[arm])}, {base} {pct_range(shares[base])}"
            + (f" (difference {_iv(sd, '+.3f')}: {_verdict_word(sd, 'higher', 'lower')})" if sd else "")
        )
    bound = amdahl_bound(cmp)
    k = kernel_speedup(results, arm)
    if bound is not None:
        lines.append(
            f"Amdahl bound: {arm}'s norms"
            + (f" (kernel ×{k:.2f} the speed of {base}'s)" if k is not None else "")
            + f" can make the step at most ×{bound:.3f} faster here"
        )
    kern = {a: kernel_words(results, a) for a in (base, arm)}
    if any(kern.values()):
        lines.append("kernels: " + "; ".join(f"{a} {k or 'not recorded'}" for a, k in kern.items()))
    nc = results.get("null_control") or {}
    if nc.get("interval"):
        ok, band = nc.get("interval_within"), nc.get("band", 0.03)
        shown = nc.get("bootstrap") or nc["interval"]
        shown = {"mean": shown.get("median", shown.get("mean")), "low": shown["low"], "high": shown["high"]}
        lines.append(
            f"null control ({control} ÷ {base}): {_iv(shown, '.3f')}, "
            + (f"within its ±{band:.0%} band" if ok else f"outside its ±{band:.0%} band")
        )
    if claim:
        lines.append(f"the 10–30 % claim: {claim['decided_by']}")
    decided = (claim or {}).get("decided_by") or ""
    noise = noise_reasons(cmp, nc, decided)
    if verdict == NOT_MEASURABLE and bound is not None and bound < THROUGHPUT_THRESHOLD:
        says = (
            f"the norms' measured share of the step, at the measured kernel speed-up, allows at most "
            f"×{bound:.3f}: below the claim's ×{THROUGHPUT_THRESHOLD:.2f} whatever the timing says."
        )
        if noise:
            says += f" The timing itself was {TOO_NOISY} ({'; '.join(noise)})."
        change = "a model or device where norms take a larger share of the step (wider or memory-bound layers)."
    elif verdict == NOT_MEASURABLE and noise:
        says = f"{TOO_NOISY}: {'; '.join(noise)}, so no speed verdict is given."
        change = "a quieter machine (load below the CPU count, the null control inside its band), then the same study."
    elif tr and tr.get("verdict") in ("higher", "lower"):
        says = (
            f"{arm} trains {'faster' if tr['verdict'] == 'higher' else 'slower'} than {base} here: ×{tr['mean']:.3f}."
        )
        change = "another device or kernel (--kernels); the ratio belongs to this implementation and machine."
    else:
        says = "training speed was not compared."
        if tr is not None:
            interval = fmt_t_interval(tr, ".3f").split(" ", 1)[-1]
            says = f"no measurable difference in training speed (×{tr['mean']:.3f} {interval})."
        change = "more seeds or timed steps could resolve a small difference; a ×1.10 one would have shown."
    return {"topic": "speed", "verdict": verdict, "says": says, "evidence": lines, "change": change}


def noise_reasons(cmp: dict, nc: dict, decided: str) -> list[str]:
    """Why the machine could not tell a speed difference: comparisons[arm].throughput_gates when the
    study recorded them, else what the claim's text and the null control say."""
    gates = cmp.get("throughput_gates")
    if isinstance(gates, dict):
        out = []
        if _num(gates.get("busy_load")) is not None:
            out.append(f"load average {gates['busy_load']:g} on {gates.get('cpus', '?')} CPUs")
        if gates.get("control_within") is False:
            out.append("the null control outside its band")
        return out
    out = ["load average above the CPU count"] if "load average" in decided else []
    if TOO_NOISY in decided and not out or (nc and nc.get("interval_within") is False):
        out.append("the null control outside its band")
    return out


def _memory(results, arm) -> dict:
    cmp = results["comparisons"][arm]
    base = results.get("baseline", "layernorm")
    mr = cmp.get("peak_memory_ratio")
    diff = cmp.get("peak_memory_difference_bytes")
    lines = [
        f"peak memory, {arm} ÷ {base}: {_iv(mr, '.4f')}{_seeds(mr)}: " + _verdict_word(mr, "more", "less")
        if mr
        else "peak memory: not measured"
    ]
    if diff and _num(diff.get("mean")) is not None:
        mib = diff["mean"] / 2**20
        lines.append(
            f"difference: {mib:+.2f} MiB per step" if abs(mib) >= 0.01 else f"difference: {diff['mean']:+,.0f} bytes"
        )
    method = next((((u.get("memory") or {}).get("method")) for u in ref_units(results, arm)), None)
    if method:
        lines.append(f"method: {method}")
    kern = kernel_words(results, arm)
    if not mr:
        verdict, says = NOT_MEASURABLE, "not measured in this study."
    elif mr.get("verdict") in ("higher", "lower"):
        verdict = "measured difference"
        pct = (mr["mean"] - 1) * 100
        # a measured change below 0.1 % keeps two significant digits: "0.0 % less" read as none
        size = f"{abs(pct):.1f}" if abs(pct) >= 0.1 else f"{abs(pct):.2g}"
        says = f"{arm} uses {size}% {'more' if pct > 0 else 'less'} peak memory than {base} (×{mr['mean']:.4f})."
    else:
        verdict, says = NO_DIFFERENCE, f"no measurable difference in peak memory (×{mr['mean']:.3f})."
    change = (
        "another norm implementation: memory follows the kernel"
        + (f" (here {kern.split(' (')[0]})" if kern else f" (here --kernels {kernels_words(results['setup'])})")
        + " and what it saves for backward."
    )
    return {"topic": "memory", "verdict": verdict, "says": says, "evidence": lines, "change": change}


def _stability(results, arm) -> dict:
    base = results.get("baseline", "layernorm")
    claim = claim_of(results, "better low-precision", arm) or claim_of(results, "stab", arm)
    verdict = claim["verdict"] if claim else NOT_MEASURABLE
    precision = results["setup"].get("precision", "fp32")
    lines = []
    st = results.get("stability") or {}
    for a in (base, arm):
        if isinstance(st.get(a), dict):
            lines.append(stability_line(a, st[a]))
    sweep_cmp = ((results.get("stability_sweep") or {}).get("comparisons") or {}).get(arm) or {}
    for key, what, spec, hi, lo in STABILITY_MEASURES:
        iv = sweep_cmp.get(key)
        if iv:
            lines.append(f"{what}, {arm} − {base}: {_iv(iv, spec)}{_seeds(iv)}: {_verdict_word(iv, hi, lo)}")
    inst = (results["comparisons"][arm] or {}).get("instabilities_difference")
    if inst:
        lines.append(
            f"loss spikes and non-finite steps in training ({precision}), {arm} − {base}: {_iv(inst, '+.2f')}: "
            + _verdict_word(inst, f"{arm} more", f"{arm} fewer")
        )
    if claim:
        lines.append(f"the claim: {claim['decided_by']}")
    if verdict == REPRODUCED:
        says = f"{arm} was more stable than {base} here."
        change = "another precision, learning-rate range or model could differ."
    elif verdict == NOT_REPRODUCED:
        says = f"{arm} was not more stable than {base} here."
        change = "a lower precision or a sweep to higher learning rates (--stability) could separate them."
    elif precision == "fp32":
        says = "trained in fp32, where neither norm meets low-precision rounding."
        change = "a --precision bf16 or fp16 study with a --stability sweep."
    elif not st:
        says = "no --stability sweep: learning rates were never raised until an arm diverged."
        change = "a --stability sweep (rates rising to divergence) with ≥ 6 seeds (--seeds 6)."
    else:
        says = "the sweep's intervals do not separate the arms."
        change = (
            "more seeds (a unanimous difference needs ≥ 6: the exact sign-flip test), or more rates between "
            "the last stable and the first diverged one."
        )
    return {"topic": "stability", "verdict": verdict, "says": says, "evidence": lines, "change": change}


# stability_sweep.comparisons[arm]: (key, what, format, words when higher, words when lower)
STABILITY_MEASURES = (
    ("largest_stable_steps_difference", "largest stable learning rate (sweep steps)", "+.2f", "higher", "lower"),
    ("diverged_runs_difference", "diverged runs", "+.2f", "more", "fewer"),
    ("heldout_spike_rate_difference", "held-out spike rate", "+.3f", "higher", "lower"),
)


def stability_line(arm: str, row: dict) -> str:
    """``rmsnorm: largest stable lr 0.008 (per seed 0.008, 0.016), diverged 3 of 10 runs, held-out
    spike rate 0.05`` from stability[arm]."""
    lr = row.get("largest_stable_lr")
    per_seed = [v for v in row.get("largest_stable_lr_per_seed") or []]
    text = f"{arm}: largest stable lr " + ("n/a" if lr is None else f"{lr:g}")
    if len(per_seed) > 1:
        text += " (per seed " + ", ".join("n/a" if v is None else f"{v:g}" for v in per_seed) + ")"
    if row.get("censored_seeds"):
        text += f", {row['censored_seeds']} seed(s) stable at every rate tried"
    if row.get("runs"):
        text += f", diverged {row.get('diverged_runs', 0)} of {row['runs']} runs"
    if _num(row.get("heldout_spike_rate")) is not None:
        text += f", held-out spike rate {row['heldout_spike_rate']:.3f}"
    return text


def bottom_line(results) -> list[dict]:
    """Quality, speed, memory and stability of the primary arm against the baseline, each
    ``{topic, verdict, says, evidence, change}``; empty for a study that compared no arm."""
    arm = primary_arm(results)
    if arm is None:
        return []
    return [f(results, arm) for f in (_quality, _speed, _memory, _stability)]


def seeds_run(setup: dict):
    """The seeds a study ran (more than --seeds when a verdict was open; older results: --seeds)."""
    return setup.get("seeds_run", setup.get("seeds", "?"))


def scope(results) -> str:
    """ "on this model, data and machine": the words the bottom line is scoped by."""
    s = results["setup"]
    load = (results.get("timing") or {}).get("load_average_start")
    load_words = f", load {load[0]:g}" if isinstance(load, list) and load else ""
    return (
        f"{results['model']}, {s.get('data', '?')} text, {s.get('steps', '?')} steps × {seeds_run(s)} seeds, "
        f"{s.get('precision', '?')} on {s.get('device', '?')} ({s.get('threads', '?')} thread(s){load_words})"
    )


# ------------------------------------------------------------------------------- differences
# (key, what, format, words when higher, words when lower)
MEASURES = (
    ("final_eval_loss_difference", "final held-out loss (nats)", "+.4f", "higher (worse)", "lower (better)"),
    ("throughput_ratio", "training tokens/s ratio", ".3f", "faster", "slower"),
    ("peak_memory_ratio", "peak memory ratio", ".4f", "more memory", "less memory"),
    ("norm_share_difference", "norm share of the step", "+.3f", "larger share", "smaller share"),
    ("instabilities_difference", "loss spikes and non-finite steps", "+.2f", "more", "fewer"),
)


def differences(results) -> list[dict]:
    """Every compared arm's measured differences as verdicts, arms that share a verdict grouped:
    ``{measure, verdict, arms: [(arm, interval text)], measured: bool}``; the stability sweep's
    paired comparisons after the training runs'."""
    out = []
    sweep = (results.get("stability_sweep") or {}).get("comparisons") or {}
    for source, measures in ((results.get("comparisons") or {}, MEASURES), (sweep, STABILITY_MEASURES)):
        out += _grouped_differences(source, measures)
    return out


def _grouped_differences(comparisons: dict, measures) -> list[dict]:
    out = []
    for key, what, spec, hi, lo in measures:
        rows = []
        for arm, cmp in comparisons.items():
            iv = throughput_interval(cmp)[0] if key == "throughput_ratio" else cmp.get(key)
            if not iv:
                continue
            rows.append({"arm": (arm, fmt_t_interval(iv, spec)), "verdict": _verdict_word(iv, hi, lo)})
        for g in grouped(rows, "arm", ("verdict",)):
            out.append(
                {
                    "measure": what,
                    "verdict": g["verdict"],
                    "arms": g["arm"],
                    "measured": g["verdict"] not in (NO_DIFFERENCE, "not measured"),
                }
            )
    return out


def difference_line(d: dict) -> str:
    """``peak memory ratio: rmsnorm more memory, 1.0376 [1.0376, 1.0376]``; grouped arms share one verdict."""
    if len(d["arms"]) == 1:
        arm, text = d["arms"][0]
        return f"{d['measure']}: {arm}: {d['verdict']}, {text}"
    return f"{d['measure']}: {d['verdict']} for " + "; ".join(f"{a} {t}" for a, t in d["arms"])


def claim_groups(results) -> list[dict]:
    """Claims with the arms that share the same verdict and evidence merged: ``{claim, arm: [..],
    verdict, decided_by}``."""
    return grouped(list(results.get("claims") or []), "arm", ("claim", "verdict", "decided_by"))
