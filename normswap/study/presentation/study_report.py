"""report.md, report.html, the PNG figures and the terminal summary of a study.

The report answers the question first (bottom_line.py: quality, speed, memory, stability, each with
its evidence and what would change it), then every measured difference as a verdict, the claims,
the terms it uses, and only then the full tables. Tables, plots, page CSS and glossary are the
report package's (normswap/report/), shared with ``normswap eval report``.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path

from normswap.publish import atomic_write_text
from normswap.report.glossary import glossary
from normswap.report.page import (
    CLAIMS_TABLE,
    CLAIMS_TABLE_END,
    claims_table_header,
    claims_table_row,
    escape,
    html_end,
    html_figure,
    html_meta,
    html_notes,
    html_start,
    html_terms,
    html_warnings,
    md_figure,
    md_terms,
    md_warnings,
)
from normswap.report.plots import interval_dots, log_if_wide, palette, plt, range_bars, save_figure, style_axes
from normswap.report.tables import TERMINAL_WIDTH, html_table, markdown_table, text_table
from normswap.stats.t_intervals import PAIRED_BY_SEED_METHOD, fmt_t_interval
from normswap.study.judging.bottom_line import (
    bottom_line,
    claim_groups,
    difference_line,
    differences,
    kernels_words,
    lm_eval_rows,
    primary_arm,
    ref_units,
    scope,
    seeds_run,
    share_range,
    throughput_interval,
)
from normswap.study.measuring.precision import IMPLS
from normswap.study.measuring.precision import lost as information_lost
from normswap.study.training import migration

MARKDOWN, HTML = "report.md", "report.html"


def _colors(results) -> dict:
    return palette(results["setup"]["arms"])


def _num(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _band(series: list[list]) -> tuple[list, list, list, list]:
    """Steps, mean, min and max over the seeds of per-step series (None where a seed has stopped)."""
    n = max((len(s) for s in series), default=0)
    xs, mean, lo, hi = [], [], [], []
    for i in range(n):
        vals = [_num(s[i]) for s in series if i < len(s) and _num(s[i]) is not None]
        if vals:
            xs.append(i + 1)
            mean.append(statistics.fmean(vals))
            lo.append(min(vals))
            hi.append(max(vals))
    return xs, mean, lo, hi


# ------------------------------------------------------------------------------------ figures
def curves_plot(results, out: Path) -> Path | None:
    arms = results["setup"]["arms"]
    c = _colors(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for arm in arms:
        units = ref_units(results, arm)
        if not units:
            continue
        for ax, key in ((axes[0], "loss"), (axes[1], "grad_norm")):
            xs, mean, lo, hi = _band([u[key] for u in units])
            ax.plot(
                xs,
                mean,
                color=c[arm],
                linewidth=1.2,
                label=arm,
                linestyle="--" if arm == results.get("control") else "-",
            )
            ax.fill_between(xs, lo, hi, color=c[arm], alpha=0.18, linewidth=0)
        steps = sorted({e["step"] for u in units for e in u["eval"]})
        ev = [[next((e["loss"] for e in u["eval"] if e["step"] == s), None) for s in steps] for u in units]
        _, mean, lo, hi = _band(ev)
        axes[2].errorbar(
            steps[: len(mean)],
            mean,
            yerr=[[m - a for m, a in zip(mean, lo)], [b - m for m, b in zip(mean, hi)]],
            color=c[arm],
            marker="o",
            markersize=3,
            capsize=2,
            linewidth=1.2,
            label=arm,
            linestyle="--" if arm == results.get("control") else "-",
        )
    for ax, title in zip(
        axes,
        (
            "training loss (mean, band: min–max over seeds)",
            "global gradient norm (before clipping)",
            "held-out loss (mean, bars: min–max over seeds)",
        ),
    ):
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
        style_axes(ax)
    log_if_wide(axes[1], [g for u in results.get("units") or [] for g in u.get("grad_norm") or [] if _num(g)])
    axes[0].legend(fontsize=8, frameon=False)
    return save_figure(fig, out / "curves.png")


def bars_plot(results, out: Path) -> Path | None:
    """Throughput and memory ratios as dots with their paired intervals (every arm, the null control
    included), and each arm's norm share of the step as bars from 0 with its range over seeds."""
    cmp = results.get("comparisons") or {}
    if not cmp:
        return None
    c = _colors(results)
    base = results.get("baseline", "layernorm")
    fig, axes = plt.subplots(1, 3, figsize=(14, max(3.6, 1.6 + 0.6 * len(cmp))))
    for ax, key, title, xlabel in (
        (axes[0], "throughput_ratio", "training tokens/s ÷ " + base, "ratio (1 = same speed; right = faster)"),
        (axes[1], "peak_memory_ratio", "peak memory ÷ " + base, "ratio (1 = same memory; right = more)"),
    ):
        rows = []
        for a, row in cmp.items():
            iv = (throughput_interval(row)[0] if key == "throughput_ratio" else row.get(key)) or {}
            rows.append((a, iv.get("mean"), iv.get("low"), iv.get("high"), c.get(a, "#495057")))
        if any(r[1] is not None for r in rows):
            interval_dots(
                ax, rows, reference=1.0, xlabel=xlabel, fmt="{:.3f}" if key == "throughput_ratio" else "{:.4f}"
            )
            ax.set_title(title + "\n(dot: estimate, line: its 95 % interval, paired by seed)", fontsize=10)
        else:
            ax.axis("off")
    shares = []
    for a in results["setup"]["arms"]:
        r = share_range(results, a)
        if r is None:
            continue
        vals = [
            u["timing"]["norm_share"]["share"]
            for u in ref_units(results, a)
            if (u.get("timing") or {}).get("norm_share")
        ]
        diff = (cmp.get(a) or {}).get("norm_share_difference")
        solid = a == base or bool(diff and diff.get("verdict") in ("higher", "lower"))
        shares.append((a, statistics.fmean(vals) * 100, r[0] * 100, r[1] * 100, c.get(a, "#495057"), solid))
    if shares:
        range_bars(axes[2], shares, ylabel="% of a training step")
        axes[2].set_title("time in norm layers\n(bar: mean over seeds, whisker: min–max)", fontsize=10)
    else:
        axes[2].axis("off")
    return save_figure(fig, out / "throughput_memory.png")


def norm_grads_plot(results, out: Path) -> Path | None:
    arms = results["setup"]["arms"]
    c = _colors(results)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    drew = False
    for i, arm in enumerate(arms):
        units = ref_units(results, arm)
        if not units or not isinstance(units[0].get("norm_input_grad_norm"), dict):
            continue
        layers = [k for k, v in units[0]["norm_input_grad_norm"].items() if isinstance(v, dict)]
        means = [
            statistics.fmean(
                [
                    u["norm_input_grad_norm"][name]["mean"]
                    for u in units
                    if _num(u["norm_input_grad_norm"].get(name, {}).get("mean")) is not None
                ]
                or [float("nan")]
            )
            for name in layers
        ]
        # identical arms (the null control) overlap exactly: earlier ones drawn wider stay visible
        wide = len(arms) - 1 - i
        ax.plot(
            range(len(layers)), means, color=c[arm], marker="o", markersize=3 + 2 * wide, linewidth=1 + wide, label=arm
        )
        ax.set_xticks(range(len(layers)), [n.split("transformer.")[-1] for n in layers], rotation=60, fontsize=7)
        drew = True
    if not drew:
        plt.close(fig)
        return None
    log_if_wide(ax, [v for line in ax.get_lines() for v in line.get_ydata()])
    ax.set_title("gradient norm at each norm layer's input (mean over steps and seeds)", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    style_axes(ax)
    return save_figure(fig, out / "norm_input_grads.png")


def sweep_plot(results, out: Path) -> Path | None:
    sw = results.get("lr_sweep")
    if not sw:
        return None
    c = _colors(results)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for arm, row in sw["mean_final_eval_loss"].items():
        pts = [(float(m), v) for m, v in row.items() if v is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c.get(arm), marker="o", label=arm)
    ax.set_xscale("log")
    ax.set_xlabel(f"learning-rate multiplier (× {results['setup']['lr']:g})")
    ax.set_title("final held-out loss by rate (mean over seeds)", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    style_axes(ax)
    return save_figure(fig, out / "lr_sweep.png")


FIGURES = (
    ("curves", curves_plot, "Training curves", "Per step, at the common rate: mean over seeds, band min–max."),
    (
        "bars",
        bars_plot,
        "Throughput, memory and time in norms",
        "Dots: mean ratio to the baseline over seeds, lines: 95 % paired interval; the dashed line is 1 (no "
        "change). Bars start at 0; a hatched bar is a norm share not measurably different from the baseline's.",
    ),
    ("norm_grads", norm_grads_plot, "Gradients entering the norms", "Norm of the gradient at each norm layer's input."),
    ("sweep", sweep_plot, "Learning-rate sweep", "Each arm's final held-out loss at each swept rate."),
)


# ------------------------------------------------------------------------------------ tables
def _bytes(n):
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def setup_lines(results) -> list[str]:
    s, arch, timing = results["setup"], results.get("architecture") or {}, results.get("timing") or {}
    start = "random initialisation per seed" if results.get("from_scratch") else "its trained weights"
    mults = s.get("multipliers") or [1.0]
    schedule = s.get("lr_schedule")
    if isinstance(schedule, dict):
        schedule = ", ".join(f"{k} {v}" for k, v in schedule.items())
    margin = s.get("margin_nats")
    lines = [
        f"model: {results['model']} ({arch.get('model_type', '?')}, "
        + (f"{arch['parameters']:,} parameters, " if arch.get("parameters") else "")
        + f"{arch.get('norms_replaced', '?')} norms reading the residual stream), from {start}",
        f"arms: {', '.join(s['arms'])}; {seeds_run(s)} seed(s); "
        f"{s.get('steps', '?')} steps × {s.get('batch_size', '?')} × {s.get('seq_len', '?')} tokens"
        + (f" ({s['tokens_per_step']:,} tokens/step)" if s.get("tokens_per_step") else "")
        + f"; warmup {s.get('warmup', '?')}; lr {s.get('lr', 0):g}"
        + (f" × {', '.join(f'{m:g}' for m in mults)}" if len(mults) > 1 else "")
        + (f"; schedule {schedule}" if schedule else ""),
        f"precision {s.get('precision', '?')}; kernels {kernels_words(s)}; device {s.get('device', '?')} × "
        f"{s.get('world_size', 1)} process(es), {s.get('threads', '?')} thread(s); data {s.get('data', '?')}"
        + (f" (held-out {s['eval_tokens_used']:,} tokens)" if s.get("eval_tokens_used") else "")
        + (f"; equivalence margin ±{margin:g} nats" if margin is not None else ""),
    ]
    if timing.get("wall_seconds") is not None:
        lines.append(
            f"wall {timing['wall_seconds']:.0f} s; load average at start {timing.get('load_average_start')}, "
            f"at end {timing.get('load_average_end')}"
        )
    return lines + list(results.get("notes") or [])


def claims_rows(results) -> list[list[str]]:
    """One row per claim and verdict; arms with the same verdict and evidence share a row."""
    return [[c["claim"], ", ".join(c["arm"]), c["verdict"], decided_text(c)] for c in claim_groups(results)]


def decided_text(c: dict) -> str:
    p = c.get("p_holm")
    return c["decided_by"] + (f" (Holm-adjusted p = {p:.3g})" if isinstance(p, (int, float)) else "")


def multiplicity_line(results) -> str | None:
    """How the claims were corrected for being tested together (results.json ``multiplicity``)."""
    m = results.get("multiplicity")
    if not isinstance(m, dict):
        return None
    return (
        f"multiplicity: {m.get('method', 'Holm')}: {m.get('family_size', '?')} claim(s) in the family at "
        f"α = {m.get('alpha', 0.05):g}; {m.get('untested', 0)} decided without a test"
    )


def comparison_rows(results) -> tuple[list[str], list[list[str]]]:
    header = [
        "arm",
        "Δ final held-out loss",
        "relative",
        "tokens/s ratio",
        "cost at equal tokens",
        "peak memory ratio",
        "Δ instabilities",
        "Δ norm share of step",
    ]
    keys = (
        ("final_eval_loss_difference", "+.4f"),
        ("final_eval_loss_relative", "+.2%"),
        ("throughput_ratio", ".3f"),
        ("cost_at_equal_tokens", ".3f"),
        ("peak_memory_ratio", ".4f"),
        ("instabilities_difference", "+.2f"),
        ("norm_share_difference", "+.3f"),
    )
    rows = [[arm] + [fmt_t_interval(c.get(k), spec) for k, spec in keys] for arm, c in results["comparisons"].items()]
    if any(c.get("amdahl_bound") is not None for c in results["comparisons"].values()):
        from normswap.study.judging.bottom_line import amdahl_bound

        header.append("Amdahl bound")
        for row, c in zip(rows, results["comparisons"].values()):
            b = amdahl_bound(c)
            row.append("n/a" if b is None else f"×{b:.3f}")
    return header, rows


def unit_rows(results) -> tuple[list[str], list[list[str]]]:
    header = [
        "arm",
        "seed",
        "lr",
        "status",
        "final held-out loss",
        "tokens/s",
        "peak memory",
        "norm share",
        "instabilities",
    ]
    rows = []
    kernels = any(u.get("norm_kernel") for u in results["units"])
    if kernels:
        header.append("norm kernel")
    for u in results["units"]:
        t = u.get("timing") or {}
        share = (t.get("norm_share") or {}).get("share")
        rows.append(
            [
                u["arm"],
                u["seed"],
                f"{u['lr']:.3g}",
                u["status"] + (f" @ {u['nonfinite']['step']}" if u.get("nonfinite") else ""),
                "n/a" if u.get("final_eval_loss") is None else f"{u['final_eval_loss']:.4f}",
                "n/a" if t.get("tokens_per_second") is None else f"{t['tokens_per_second']:,.0f}",
                _bytes((u.get("memory") or {}).get("peak_bytes")),
                "n/a" if share is None else f"{share:.1%}",
                u.get("instabilities", "n/a"),
            ]
            + ([_kernel_cell(u)] if kernels else [])
        )
    return header, rows


def _kernel_cell(u) -> str:
    name = u.get("norm_kernel") or "n/a"
    fused = u.get("norm_kernel_fused")
    return (
        name
        + ("" if fused is None else (" (fused)" if fused else " (composite)"))
        + (f", {u['norm_compute_dtype']}" if u.get("norm_compute_dtype") else "")
    )


def precision_rows(results) -> tuple[list[str], list[list[str]]]:
    """Worst error over the widths per (case, dtype), each implementation's y / dx / dγ, in units of the dtype's ε."""
    rows_in = (results.get("precision") or {}).get("rows") or []
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows_in)]  # the kernels the arms ran
    info = any(r.get("correlation") is not None for r in rows_in)
    header = ["case", "dtype"]
    for i in impls:
        header += [f"{i}: y / dx / dγ (ε)"] + ([f"{i}: 1 − corr"] if info else [])
    keys = []
    for r in rows_in:
        if (r["case"], r["dtype"]) not in keys:
            keys.append((r["case"], r["dtype"]))
    out = []
    for case, dt in keys:
        row = [case, dt]
        for impl in impls:
            mine = [r for r in rows_in if r["case"] == case and r["dtype"] == dt and r["impl"] == impl]
            if any("error" in r for r in mine):
                row.append("unsupported")
                continue

            def w(k, mine=mine):
                vals = [float(r[k]) for r in mine]
                v = max(vals)
                return "inf" if math.isinf(v) else f"{v:.2f}"

            row.append(" / ".join(w(k) for k in ("forward", "grad_x", "grad_weight")))
            if info:  # information lost: 1 − correlation with the exact LayerNorm, worst over widths
                lost = [information_lost(r) for r in mine]
                row.append("n/a" if None in lost or not lost else f"{max(lost):.2e}")
        out.append(row)
    return header, out


def sweep_lines(results) -> list[str]:
    sw, rules = results.get("lr_sweep"), results.get("migration_rule") or {}
    if not sw:
        return ["No --lr-sweep: each arm trained at --lr only; the migration rule is not measurable here."]
    lines = ["best multiplier: " + ", ".join(f"{a} ×{m:g}" for a, m in sw["best_multiplier"].items())]
    for arm, r in rules.items():
        if "eta_ratio_interval" in r or r.get("problem") or r.get("grad_scale_ratio") is None:
            lines.append(f"{arm}: {migration.judge(r)[1]}")
        else:  # a results.json from before the fitted η* (rule multiplier against the swept best)
            lines.append(
                f"{arm}: gradient-scale ratio {r['grad_scale_ratio']:.3f} → swept ×{r.get('rule_multiplier')}; "
                f"best ×{r.get('arm_best_multiplier')}; pick − best {fmt_t_interval(r.get('rule_vs_best'), '+.4f')}"
            )
    return lines


def null_control_line(results) -> str | None:
    nc = results.get("null_control")
    phase = results.get("speed_phase")
    if phase:  # the timing phase's null control: layernorm against its second copy
        n = phase["null"]
        return (
            f"throughput null control (layernorm ÷ its second copy, timing phase): {n['ratio']:.3f} "
            f"[{n['low']:.3f}, {n['high']:.3f}] over {n['pairs']} pairs — {n['verdict']}; "
            f"stopped: {phase['stop_reason']}"
        )
    if not nc or "per_seed" not in nc:
        return None
    vals = ", ".join(f"{v:.3f}" for v in nc["per_seed"])
    b = nc.get("bootstrap")
    interval = (
        f"bootstrap {b['median']:.3f} [{b['low']:.3f}, {b['high']:.3f}]" if b else fmt_t_interval(nc["interval"], ".3f")
    )
    return (
        f"throughput null control ({results.get('control')} ÷ {results.get('baseline')}, interleaved): "
        f"per seed {vals}; interval {interval} — "
        f"every seed within ±{nc['band']:.0%}: {'yes' if nc['per_seed_within'] else 'NO'}; "
        f"interval within ±{nc['band']:.0%}: {'yes' if nc['interval_within'] else 'no'}"
    )


MEANING = [
    "reproduced: the 95 % interval (paired by seed) lies wholly on the claim's side of its threshold.",
    "not reproduced: it lies wholly on the other side.",
    "not measurable here: the interval straddles the threshold (more seeds or steps would be needed), "
    "or the study lacks what the claim needs (e.g. --lr-sweep for the migration rule, ≥ 2 seeds for any "
    "interval, low precision for stability), or the claim cannot be reached on this model and machine.",
]
TERMS_USED = [
    "paired interval",
    "no measurable difference",
    "TOST margin",
    "not measurable here",
    "null control",
    "too noisy to tell",
    "norm share",
    "Amdahl bound",
    "cost at equal tokens",
    "unigram / bigram baseline",
    "Holm correction",
    "ε (machine epsilon)",
]


def terms(results) -> list[tuple[str, str]]:
    """The glossary entries this study's report uses (Holm only when the study applied it)."""
    said = " ".join(str(results.get(k, "")) for k in ("setup", "claims", "multiplicity")).lower()
    used = [t for t in TERMS_USED if t != "Holm correction" or "holm" in said]
    if not results.get("baselines"):
        used.remove("unigram / bigram baseline")
    return glossary(used)


def precision_heading(results) -> str | None:
    rows = (results.get("precision") or {}).get("rows")
    if not rows:
        return None
    widths = ", ".join(str(w) for w in sorted({r["width"] for r in rows}))
    return f"Kernel accuracy (error in units of the dtype's ε against float64; worst over widths {widths})"


def precision_note(results) -> str | None:
    c = (results.get("precision") or {}).get("compare")
    if not c:
        return None
    judged = f" (judged on {c['judged_on']})" if c.get("judged_on") else ""
    return (
        f"{c.get('rms_kernel', 'RMSNorm')} keeps ≥ {c['factor']:g}× more of the input than LayerNorm{judged} in: "
        f"{', '.join(c['rms_better']) or 'no case'}; less in: {', '.join(c['rms_worse']) or 'no case'}."
        if c.get("judged_on")
        else f"RMSNorm ≥ {c['factor']:g}× more accurate than LayerNorm in: {', '.join(c['rms_better']) or 'no case'}; "
        f"less accurate in: {', '.join(c['rms_worse']) or 'no case'}."
    )


# ------------------------------------------------------------------------------------ output
def title(results) -> str:
    return "LayerNorm vs RMSNorm: study of " + results["model"]


def bottom_line_heading(results) -> str:
    arm = primary_arm(results)
    if arm is None:
        return f"Bottom line: no arm besides the null control, on {scope(results)}"
    return f"Bottom line: {arm} against {results.get('baseline', 'layernorm')} on {scope(results)}"


NO_ARM = (
    "This study compared no norm with the baseline: it trained only the baseline and its null control, so it "
    "measures the noise floor (the null control's differences below), not RMSNorm."
)


def markdown(results, figures: dict) -> str:
    out = [f"# {title(results)}", ""] + md_warnings(results.get("warnings"))
    bl = bottom_line(results)
    out += [f"## {bottom_line_heading(results)}", ""] + ([] if bl else [NO_ARM, ""])
    if bl:
        for item in bl:
            out.append(f"- **{item['topic']}: {item['verdict']}** — {item['says']}")
            out += [f"  - {e}" for e in item["evidence"]]
            out.append(f"  - *what would change it:* {item['change']}")
        out.append("")
    diffs = differences(results)
    if diffs:
        out += ["## What was measured (every arm against " + results.get("baseline", "layernorm") + ")", ""]
        out += [
            ("- **" if d["measured"] else "- ") + difference_line(d) + ("**" if d["measured"] else "") for d in diffs
        ]
        out += ["", "Bold: a measured difference (the 95 % paired interval excludes no change).", ""]
    out += ["## Claims", ""] + markdown_table(["claim", "arms", "verdict", "decided by"], claims_rows(results)) + [""]
    out += [f"- {m}" for m in MEANING + [multiplicity_line(results)] if m] + [""]
    out += ["## Setup", ""] + [f"- {line}" for line in setup_lines(results)] + [""]
    header, rows = comparison_rows(results)
    out += ["## Differences from the baseline (mean [95 % interval], paired by seed)", ""]
    out += markdown_table(header, rows) + [""]
    ncl = null_control_line(results)
    if ncl:
        out += [f"- {ncl}"]
    out += [f"- statistics: {results['setup'].get('statistics', PAIRED_BY_SEED_METHOD)}", ""]
    lm = lm_eval_rows(results)
    if lm:
        out += ["## Downstream (lm-eval, one seed's final model per arm)", ""] + markdown_table(*lm) + [""]
    out += ["## Learning rate", ""] + [f"- {line}" for line in sweep_lines(results)] + [""]
    heading = precision_heading(results)
    if heading:
        header, rows = precision_rows(results)
        out += [f"## {heading}", ""] + markdown_table(header, rows) + [""]
        note = precision_note(results)
        out += [f"- {note}", ""] if note else []
    header, rows = unit_rows(results)
    out += ["## Units (arm × seed × rate)", ""] + markdown_table(header, rows) + [""]
    if figures:
        out += ["## Figures", ""]
        for key, _, t, caption in FIGURES:
            if key in figures:
                out += md_figure(t, figures[key], caption)
    out += md_terms(terms(results))
    out += ["---", "Schema and definitions: docs/study-schema.md. Curves per unit: units/*.json.", ""]
    return "\n".join(out)


def html_report(results, figures: dict) -> str:
    parts = html_start(title(results)) + [f"<h1>{escape(title(results))}</h1>"] + html_warnings(results.get("warnings"))
    bl = bottom_line(results)
    parts.append(f"<h2>{escape(bottom_line_heading(results))}</h2>" + ("" if bl else f"<p>{escape(NO_ARM)}</p>"))
    if bl:
        parts += [CLAIMS_TABLE, claims_table_header("question", "answer, evidence, and what would change it")]
        for item in bl:
            body = (
                f"<strong>{escape(item['says'])}</strong><ul>"
                + "".join(f"<li>{escape(e)}</li>" for e in item["evidence"])
                + f"</ul><div class='why'>What would change it: {escape(item['change'])}</div>"
            )
            parts.append(claims_table_row(item["topic"], item["verdict"], body))
        parts.append(CLAIMS_TABLE_END)
    diffs = differences(results)
    if diffs:
        parts.append(f"<h2>What was measured (every arm against {escape(results.get('baseline', 'layernorm'))})</h2>")
        parts.append(
            "<ul>"
            + "".join(
                (
                    f"<li><strong>{escape(difference_line(d))}</strong></li>"
                    if d["measured"]
                    else f"<li>{escape(difference_line(d))}</li>"
                )
                for d in diffs
            )
            + "</ul><p class='sub'>Bold: a measured difference (the 95 % paired interval excludes no change).</p>"
        )
    parts.append("<h2>Claims</h2>" + CLAIMS_TABLE + claims_table_header("claim", "this study"))
    parts += [
        claims_table_row(c["claim"], c["verdict"], f"{escape(', '.join(c['arm']))}: {escape(decided_text(c))}")
        for c in claim_groups(results)
    ]
    parts.append(CLAIMS_TABLE_END + html_notes(m for m in MEANING + [multiplicity_line(results)] if m))
    parts.append("<h2>Setup</h2>" + html_meta(setup_lines(results)))
    header, rows = comparison_rows(results)
    parts.append("<h2>Differences from the baseline</h2>" + html_table(header, rows))
    notes = [
        n
        for n in (
            null_control_line(results),
            "statistics: " + results["setup"].get("statistics", PAIRED_BY_SEED_METHOD),
        )
        if n
    ]
    parts.append(html_notes(notes))
    lm = lm_eval_rows(results)
    if lm:
        parts.append("<h2>Downstream (lm-eval, one seed's final model per arm)</h2>" + html_table(*lm))
    parts.append("<h2>Learning rate</h2>" + html_notes(sweep_lines(results)))
    heading = precision_heading(results)
    if heading:
        header, rows = precision_rows(results)
        note = precision_note(results)
        parts.append(f"<h2>{escape(heading)}</h2>" + html_table(header, rows) + (html_notes([note]) if note else ""))
    for key, _, t, caption in FIGURES:
        if key in figures:
            parts.append(html_figure(t, figures[key], caption))
    header, rows = unit_rows(results)
    parts.append("<h2>Units</h2>" + html_table(header, rows))
    parts.append(html_terms(terms(results)))
    parts.append(
        html_end("Schema and definitions: docs/study-schema.md. Raw numbers: results.json; curves: units/*.json.")
    )
    return "\n".join(parts)


def write_report(results: dict, out) -> dict[str, Path]:
    """The figures, report.md and report.html into ``out`` (each file written atomically)."""
    out = Path(out)
    figures = {}
    for key, fn, _, _ in FIGURES:
        path = fn(results, out)
        if path is not None:
            figures[key] = path
    atomic_write_text(out / MARKDOWN, markdown(results, figures))
    atomic_write_text(out / HTML, html_report(results, figures))
    return figures


def _wrapped(text: str, indent: str, width: int = TERMINAL_WIDTH, first: str | None = None) -> list[str]:
    return textwrap.wrap(
        text,
        width,
        initial_indent=indent if first is None else first,
        subsequent_indent=indent,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def summary_lines(results, out) -> list[str]:
    """What `normswap study` prints: the bottom line first, then the measured differences and the
    claims; every line fits ``TERMINAL_WIDTH`` columns."""
    lines = [f"study of {results['model']} -> {out}"]
    for w in results.get("warnings") or []:
        lines += _wrapped(w, "  ", first="WARNING: ")
    for line in setup_lines(results):
        lines += _wrapped(line, "    ", first="  ")
    lines.append("")
    bl = bottom_line(results)
    lines += _wrapped(bottom_line_heading(results), "  ") + ([] if bl else _wrapped(NO_ARM, "  ")) + [""]
    if bl:
        for item in bl:
            pad = " " * 12
            lines += _wrapped(f"{item['verdict'].upper()} — {item['says']}", pad, first=f"  {item['topic']:<10}")
            for e in item["evidence"]:
                lines += _wrapped(e, pad + "  ", first=pad + "- ")
            lines += _wrapped("what would change it: " + item["change"], pad + "  ", first=pad + "> ")
        lines.append("")
    diffs = differences(results)
    if diffs:
        lines.append(
            f"What was measured against {results.get('baseline', 'layernorm')} "
            "(95 % paired intervals; * = a difference):"
        )
        for d in diffs:
            lines += _wrapped(difference_line(d), "      ", first="  * " if d["measured"] else "    ")
        lines.append("")
    ncl = null_control_line(results)
    if ncl:
        lines += _wrapped(ncl, "  ") + [""]
    lines += text_table(
        ["claim", "arms", "verdict", "decided by"], claims_rows(results), width=TERMINAL_WIDTH
    ).splitlines()
    ml = multiplicity_line(results)
    lines += _wrapped(ml, "  ") if ml else []
    lines += ["", f"report: {Path(out) / MARKDOWN}", "  (beside it: report.html, results.json, the figures)"]
    return lines
