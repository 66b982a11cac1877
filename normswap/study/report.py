"""report.md, report.html and the PNG figures of a study, in the style of ``normswap eval report``
(the same tables, palette, plot style and page CSS: normswap/report/)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from normswap.publish import atomic_write_text
from normswap.report.plots import PALETTE, plt, save_figure, style_axes
from normswap.report.render import CSS, escape, image_data_uri
from normswap.report.tables import markdown_table, text_table
from normswap.study import stats
from normswap.study.precision import IMPLS

MARKDOWN, HTML = "report.md", "report.html"


def _colors(results) -> dict:
    return {a: PALETTE[i % len(PALETTE)] for i, a in enumerate(results["setup"]["arms"])}


def _ref_units(results, arm):
    ref = results["setup"]["reference_multiplier"]
    return [u for u in results["units"] if u["arm"] == arm and u["lr_multiplier"] == ref]


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
        units = _ref_units(results, arm)
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
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8, frameon=False)
    return save_figure(fig, out / "curves.png")


def bars_plot(results, out: Path) -> Path | None:
    cmp = results["comparisons"]
    if not cmp:
        return None
    c = _colors(results)
    arms = list(cmp)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, key, title in (
        (axes[0], "throughput_ratio", "training tokens/s ÷ layernorm (95 % interval over seeds)"),
        (axes[1], "peak_memory_ratio", "peak memory ÷ layernorm (95 % interval over seeds)"),
    ):
        means, errs = [], [[], []]
        for a in arms:
            iv = cmp[a].get(key)
            m = iv["mean"] if iv else float("nan")
            means.append(m)
            errs[0].append(m - iv["low"] if iv and iv["low"] is not None else 0)
            errs[1].append(iv["high"] - m if iv and iv["high"] is not None else 0)
        ax.bar(arms, [m - 1 for m in means], bottom=1, color=[c[a] for a in arms], yerr=errs, capsize=4)
        ax.axhline(1, color="#868e96", linewidth=1)
        if key == "throughput_ratio":
            ax.axhspan(0.97, 1.03, color="#adb5bd", alpha=0.15, linewidth=0)
        for i, m in enumerate(means):
            if math.isfinite(m):
                ax.annotate(
                    f"{m:.3f}", (i, m), ha="center", va="bottom", fontsize=8, xytext=(8, 2), textcoords="offset points"
                )
        ax.set_title(title, fontsize=10)
        style_axes(ax)
    return save_figure(fig, out / "throughput_memory.png")


def norm_grads_plot(results, out: Path) -> Path | None:
    arms = results["setup"]["arms"]
    c = _colors(results)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    drew = False
    for arm in arms:
        units = _ref_units(results, arm)
        if not units:
            continue
        layers = list(units[0]["norm_input_grad_norm"])
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
        ax.plot(range(len(layers)), means, color=c[arm], marker="o", markersize=3, label=arm)
        ax.set_xticks(range(len(layers)), [n.split("transformer.")[-1] for n in layers], rotation=60, fontsize=7)
        drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.set_yscale("log")
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
    ("bars", bars_plot, "Throughput and memory", "Paired by seed; the grey band is ±3 % (the null control's target)."),
    ("norm_grads", norm_grads_plot, "Gradients entering the norms", "Norm of the gradient at each norm layer's input."),
    ("sweep", sweep_plot, "Learning-rate sweep", "Each arm's final held-out loss at each swept rate."),
)


# ------------------------------------------------------------------------------------ tables
def _bytes(n):
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def setup_lines(results) -> list[str]:
    s = results["setup"]
    start = "random initialisation per seed" if results["from_scratch"] else "its trained weights"
    lines = [
        f"model: {results['model']} ({results['architecture']['model_type']}, "
        f"{results['architecture']['parameters']:,} parameters, "
        f"{results['architecture']['norms_replaced']} norms reading the residual stream), from {start}",
        f"arms: {', '.join(s['arms'])}; {s['seeds']} seed(s); "
        f"{s['steps']} steps × {s['batch_size']} × {s['seq_len']} tokens "
        f"({s['tokens_per_step']:,} tokens/step); warmup {s['warmup']}; lr {s['lr']:g}"
        + (f" × {', '.join(f'{m:g}' for m in s['multipliers'])}" if len(s["multipliers"]) > 1 else ""),
        f"precision {s['precision']}; kernels {s['kernels']}; device {s['device']} × {s['world_size']} process(es), "
        f"{s['threads']} thread(s); data {s['data']} (held-out {s['eval_tokens_used']:,} tokens)",
        f"wall {results['timing']['wall_seconds']:.0f} s; "
        f"load average at start {results['timing']['load_average_start']}, "
        f"at end {results['timing']['load_average_end']}",
    ]
    return lines + list(results.get("notes") or [])


def claims_rows(results) -> list[list[str]]:
    return [[c["claim"], c["arm"], c["verdict"], c["decided_by"]] for c in results["claims"]]


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
    rows = []
    for arm, c in results["comparisons"].items():
        rows.append(
            [
                arm,
                stats.fmt(c["final_eval_loss_difference"], "+.4f"),
                stats.fmt(c["final_eval_loss_relative"], "+.2%"),
                stats.fmt(c["throughput_ratio"], ".3f"),
                stats.fmt(c["cost_at_equal_tokens"], ".3f"),
                stats.fmt(c["peak_memory_ratio"], ".4f"),
                stats.fmt(c["instabilities_difference"], "+.2f"),
                stats.fmt(c["norm_share_difference"], "+.3f"),
            ]
        )
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
    for u in results["units"]:
        t = u["timing"]
        share = (t.get("norm_share") or {}).get("share")
        rows.append(
            [
                u["arm"],
                u["seed"],
                f"{u['lr']:.3g}",
                u["status"] + (f" @ {u['nonfinite']['step']}" if u["nonfinite"] else ""),
                "n/a" if u["final_eval_loss"] is None else f"{u['final_eval_loss']:.4f}",
                "n/a" if t["tokens_per_second"] is None else f"{t['tokens_per_second']:,.0f}",
                _bytes((u["memory"] or {}).get("peak_bytes")),
                "n/a" if share is None else f"{share:.1%}",
                u["instabilities"],
            ]
        )
    return header, rows


def precision_rows(results) -> tuple[list[str], list[list[str]]]:
    """Worst error over the widths per (case, dtype), each implementation's y / dx / dγ, in units of the dtype's ε."""
    rows_in = results["precision"]["rows"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows_in)]  # the kernels the arms ran
    header = ["case", "dtype"] + [f"{i}: y / dx / dγ" for i in impls]
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
        out.append(row)
    return header, out


def sweep_lines(results) -> list[str]:
    sw, rules = results.get("lr_sweep"), results.get("migration_rule") or {}
    if not sw:
        return ["No --lr-sweep: each arm trained at --lr only; the migration rule is not measurable here."]
    lines = ["best multiplier: " + ", ".join(f"{a} ×{m:g}" for a, m in sw["best_multiplier"].items())]
    for arm, r in rules.items():
        if r.get("rule_multiplier") is None:
            lines.append(f"{arm}: no gradient-scale ratio")
            continue
        per_seed = ", ".join(f"{v:.3f}" for v in r["grad_scale_ratio_per_seed"])
        lines.append(
            f"{arm}: gradient-scale ratio {r['grad_scale_ratio']:.3f} (per seed {per_seed})"
            f" → predicted ×{r['predicted_multiplier']:.3g} → swept ×{r['rule_multiplier']:g}; "
            f"best ×{r['arm_best_multiplier']:g}; "
            f"pick − best {stats.fmt(r['rule_vs_best'], '+.4f')}; "
            f"keeping layernorm's best rate − best {stats.fmt(r['keep_vs_best'], '+.4f')}"
        )
    return lines


def null_control_line(results) -> str | None:
    nc = results.get("null_control")
    if not nc:
        return None
    vals = ", ".join(f"{v:.3f}" for v in nc["per_seed"])
    return (
        f"throughput null control (layernorm-control ÷ layernorm, interleaved): per seed {vals}; interval "
        f"{stats.fmt(nc['interval'], '.3f')} — "
        f"every seed within ±{nc['band']:.0%}: {'yes' if nc['per_seed_within'] else 'NO'}; "
        f"interval within ±{nc['band']:.0%}: {'yes' if nc['interval_within'] else 'no'}"
    )


MEANING = [
    "reproduced: the 95 % interval (paired by seed) lies wholly on the claim's side of its threshold.",
    "not reproduced: it lies wholly on the other side.",
    "not measurable here: the interval straddles the threshold (more seeds or steps would be needed), "
    "or the study lacks what the "
    "claim needs (e.g. --lr-sweep for the migration rule, ≥ 2 seeds for any interval).",
    "no measurable difference: an interval that contains 0 (1 for ratios).",
]


# ------------------------------------------------------------------------------------ output
def markdown(results, figures: dict) -> str:
    out = ["# LayerNorm vs RMSNorm: study of " + results["model"], ""]
    out += [f"- {line}" for line in setup_lines(results)] + [""]
    out += ["## Claims", ""] + markdown_table(["claim", "arm", "verdict", "decided by"], claims_rows(results)) + [""]
    out += [f"- {m}" for m in MEANING] + [""]
    header, rows = comparison_rows(results)
    out += (
        ["## Differences from layernorm (mean [95 % interval], paired by seed)", ""]
        + markdown_table(header, rows)
        + [""]
    )
    ncl = null_control_line(results)
    if ncl:
        out += [f"- {ncl}"]
    out += [f"- statistics: {results['setup']['statistics']}", ""]
    out += ["## Learning rate", ""] + [f"- {line}" for line in sweep_lines(results)] + [""]
    header, rows = precision_rows(results)
    out += [
        "## The norms in low precision (error in units of the dtype's ε vs float64; worst over widths "
        + ", ".join(str(w) for w in sorted({r["width"] for r in results["precision"]["rows"]}))
        + ")",
        "",
    ]
    out += markdown_table(header, rows) + [""]
    c = results["precision"]["compare"]
    out += [
        f"- RMSNorm (torch) ≥ {c['factor']:g}× more accurate than LayerNorm (torch) in: "
        f"{', '.join(c['rms_better']) or 'no case'}; "
        f"less accurate in: {', '.join(c['rms_worse']) or 'no case'}.",
        "",
    ]
    header, rows = unit_rows(results)
    out += ["## Units (arm × seed × rate)", ""] + markdown_table(header, rows) + [""]
    if figures:
        out += ["## Figures", ""]
        for key, _, title, caption in FIGURES:
            if key in figures:
                out += [f"### {title}", "", f"![{title}]({Path(figures[key]).name})", "", caption, ""]
    out += ["---", "Schema and definitions: docs/study-schema.md. Curves per unit: units/*.json.", ""]
    return "\n".join(out)


def _html_table(header, rows, cls="text2") -> str:
    return (
        f"<div class='tablewrap'><table class='{cls}'><thead><tr>"
        + "".join(f"<th>{escape(h)}</th>" for h in header)
        + "</tr></thead><tbody>"
        + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        + "</tbody></table></div>"
    )


def html_report(results, figures: dict) -> str:
    title = "LayerNorm vs RMSNorm: study of " + results["model"]
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width,initial-scale=1'>",
        f"<title>{escape(title)}</title>",
        f"<style>{CSS}</style></head><body><main>",
        f"<h1>{escape(title)}</h1>",
    ]
    parts.append(
        "<div class='meta'>" + "".join(f"<div>{escape(line)}</div>" for line in setup_lines(results)) + "</div>"
    )
    parts.append(
        "<h2>Claims</h2><div class='tablewrap'><table class='claims'>"
        "<thead><tr><th>claim</th><th>this study</th></tr></thead><tbody>"
    )
    for c in results["claims"]:
        cls = {"reproduced": "v-yes", "not reproduced": "v-no"}.get(c["verdict"], "v-na")
        parts.append(
            f"<tr><td>{escape(c['claim'])}<div class='verdict {cls}'>{escape(c['verdict'])}</div></td>"
            f"<td>{escape(c['arm'])}: {escape(c['decided_by'])}</td></tr>"
        )
    parts.append(
        "</tbody></table></div><ul class='notes'>" + "".join(f"<li>{escape(m)}</li>" for m in MEANING) + "</ul>"
    )
    header, rows = comparison_rows(results)
    parts.append("<h2>Differences from layernorm</h2>" + _html_table(header, rows))
    notes = [n for n in (null_control_line(results), "statistics: " + results["setup"]["statistics"]) if n]
    parts.append("<ul class='notes'>" + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>")
    parts.append(
        "<h2>Learning rate</h2><ul class='notes'>"
        + "".join(f"<li>{escape(n)}</li>" for n in sweep_lines(results))
        + "</ul>"
    )
    header, rows = precision_rows(results)
    parts.append(
        "<h2>The norms in low precision</h2>"
        "<p class='sub'>Error in units of the dtype's ε against a float64 reference, "
        "worst over the widths.</p>" + _html_table(header, rows)
    )
    for key, _, t, caption in FIGURES:
        if key in figures:
            parts.append(
                f"<h2>{escape(t)}</h2><figure><img alt='{escape(t)}' src='{image_data_uri(figures[key])}'>"
                f"<figcaption>{escape(caption)}</figcaption></figure>"
            )
    header, rows = unit_rows(results)
    parts.append("<h2>Units</h2>" + _html_table(header, rows))
    parts.append(
        "<footer>Schema and definitions: docs/study-schema.md. Raw numbers: results.json; "
        "curves: units/*.json.</footer></main></body></html>"
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


def summary_lines(results, out) -> list[str]:
    """What `normswap study` prints: the setup, the differences, the verdicts."""
    lines = [f"study of {results['model']} -> {out}"] + [f"  {line}" for line in setup_lines(results)] + [""]
    header, rows = comparison_rows(results)
    lines += text_table(header, rows).splitlines() + [""]
    ncl = null_control_line(results)
    if ncl:
        lines += [ncl, ""]
    lines += text_table(["claim", "arm", "verdict", "decided by"], claims_rows(results)).splitlines()
    lines += ["", f"report: {Path(out) / MARKDOWN} (and report.html, results.json)"]
    return lines
