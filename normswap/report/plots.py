"""The report's figures (matplotlib, Agg backend: no display needed), written as PNG files.

Each function takes the results dict and returns the path it wrote, or None when the run has
nothing to plot for it (e.g. no fine-tuned model, speed not measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
# Every string a figure shows is text, never TeX: model names, tasks and titles come from directory
# names and received results.json files, and matplotlib parses anything between two ``$`` as math
# (``kjv$\x$`` raised in its parser after a whole evaluation; nested ``^{`` recursed out of the
# stack). Decided here, the one module through which normswap draws (reports, studies, benches).
matplotlib.rcParams["text.parse_math"] = False
matplotlib.rcParams["text.usetex"] = False
import matplotlib.pyplot as plt  # noqa: E402

from normswap.publish import atomic_write_with  # noqa: E402
from normswap.report.intervals import change_interval, difference_resolved  # noqa: E402
from normswap.report.tables import signed_percent  # noqa: E402

PALETTE = ["#4c6ef5", "#f76707", "#2b8a3e", "#c2255c", "#5f3dc4", "#0b7285", "#e67700", "#495057"]
METRICS = (("forward", "forward"), ("train_step", "train step"), ("prefill", "prefill"), ("decode", "decode"))


def style_axes(ax):
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#e9ecef", linewidth=0.8)
    ax.set_axisbelow(True)


def save_figure(fig, path: Path) -> Path:
    """Saved through a fresh temporary file renamed over ``path`` (normswap.publish): a link planted at
    ``path`` (``curves.png -> ~/.bashrc``) is replaced, never written through."""
    fig.tight_layout()
    fmt = Path(path).suffix.lstrip(".") or "png"
    try:
        atomic_write_with(path, lambda f: fig.savefig(f, dpi=110, format=fmt))
    finally:
        plt.close(fig)
    return path


def log_if_wide(ax, values, factor: float = 30) -> bool:
    """A log y-axis when the positive values span more than ``factor``× (a residual stream growing by
    orders of magnitude); a linear one otherwise (a log axis over 1.12–1.28 labels every tick
    1.2×10⁻¹ and hides the differences). True when it chose log."""
    vals = [v for v in values if isinstance(v, (int, float)) and v > 0]
    if vals and max(vals) / min(vals) > factor:
        ax.set_yscale("log")
        return True
    return False


def palette(names) -> dict:
    """One colour per name, in order (the same names get the same colours in every figure)."""
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def colors(results) -> dict:
    return palette(m["name"] for m in results["models"])


def perplexity_plot(results, out: Path) -> Path | None:
    """Perplexity as the change from the baseline (a 1.8 % gap is invisible on bars from 0), and
    the absolute values on an axis zoomed to them."""
    # an infinite perplexity (text the model cannot predict) stays in the table; no axis can hold it
    models = [m for m in results["models"] if m.get("perplexity") is not None and math.isfinite(m["perplexity"])]
    if not models:
        return None
    c = colors(results)
    base = next((m for m in models if m["name"] == results.get("baseline")), None)
    panels = 2 if base is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.4 + 0.1 * len(models)), squeeze=False)
    axes = axes[0]
    names = [m["name"] for m in models]
    if base is not None:
        ax = axes[0]
        deltas = [(m["perplexity"] / base["perplexity"] - 1) * 100 for m in models]
        ends = list(deltas)
        for i, (m, d) in enumerate(zip(models, deltas)):
            iv = change_interval(m, "perplexity") if m is not base else None
            solid = m is base or difference_resolved(m, "perplexity")
            ax.bar(
                [i],
                [d],
                color=c[m["name"]],
                alpha=1.0 if solid else 0.45,
                hatch=None if solid else "///",
                edgecolor="white" if solid else c[m["name"]],
                linewidth=0,
            )
            tip = d
            if iv is not None:  # the interval of the change, over documents
                low, high = (iv["low"] - 1) * 100, (iv["high"] - 1) * 100
                ax.errorbar([i], [d], yerr=[[max(d - low, 0)], [max(high - d, 0)]], fmt="none", ecolor="#343a40")
                ends += [low, high]
                tip = high if d >= 0 else low
            ax.annotate(
                signed_percent(d),
                (i, tip),
                ha="center",
                va="bottom" if d >= 0 else "top",
                fontsize=9,
                xytext=(0, 2 if d >= 0 else -2),
                textcoords="offset points",
            )
        ax.axhline(0, color="#868e96", linewidth=1)
        span = max(max(ends) - min(ends), max(abs(e) for e in ends), 0.05)
        ax.set_ylim(min(min(ends), 0) - 0.25 * span, max(max(ends), 0) + 0.25 * span)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(f"% vs {base['name']}")
        ax.set_title("token perplexity, change from the baseline (lower is better)", fontsize=10)
        ax.tick_params(axis="x", labelrotation=15, labelsize=9)
        style_axes(ax)
    ax = axes[-1]
    values = [m["perplexity"] for m in models]
    bottom, top, zoomed = value_limits(values)
    ax.plot(names, values, linestyle="none", marker="o", markersize=8, color="#495057", zorder=1)
    for n, v in zip(names, values):
        ax.scatter([n], [v], s=70, color=c[n], zorder=2)
        ax.annotate(
            f"{v:,.2f}", (n, v), ha="center", va="bottom", fontsize=9, xytext=(0, 6), textcoords="offset points"
        )
    ax.set_ylim(bottom, top)
    ax.margins(x=0.2)  # keep the end labels clear of the axis
    ax.set_ylabel("perplexity")
    ax.set_title(
        "token perplexity" + (f"\n(axis zoomed: starts at {bottom:,.2f}, not 0)" if zoomed else ""), fontsize=10
    )
    ax.tick_params(axis="x", labelrotation=15, labelsize=9)
    style_axes(ax)
    d = results.get("data") or {}
    if d:
        fig.suptitle(d.get("caption") or f"{d['spec']} / {d['split']}: {d['characters']:,} characters", fontsize=10)
    return save_figure(fig, out / "perplexity.png")


def value_limits(values: list[float]) -> tuple[float, float, bool]:
    """The y-range of a chart of positive values zoomed to them: (bottom, top, zoomed). A range whose
    padding would run below 0 starts at 0 instead (then it is not zoomed, and says nothing about it);
    ``zoomed`` is True only when the axis really starts above 0."""
    lo, hi = min(values), max(values)
    pad = max((hi - lo) * 0.3, hi * 0.002)
    bottom = lo - pad
    if bottom <= 0:
        return 0.0, hi + 2 * pad, False
    return bottom, hi + 2 * pad, True


# A whisker reaching past this multiple of the tallest bar is clipped at the axis top and marked
# with its value: one repeat at ×21 would otherwise set the axis to 0–22 and flatten every bar.
CLIP_AT = 1.6


@dataclass
class Bar:
    """One bar of the throughput ratio chart, as drawn: the tests read these, not pixels."""

    model: str
    metric: str
    x: float
    value: float  # the ratio of medians (the bar's height)
    low: float | None  # the per-repeat range (the whisker)
    high: float | None
    clear: bool  # a measured difference (solid); else hatched
    label: str  # the value written on the bar
    label_y: float  # where the label sits: on the bar, never at the whisker's top
    clipped: bool = False  # the whisker runs past the axis top (marked there with its value)


def throughput_bars(results) -> tuple[list[Bar], float]:
    """The ratio chart's bars and its axis top. The axis is sized to the bars and every whisker up to
    ``CLIP_AT`` × the tallest bar; whiskers above it are clipped (``clipped``) and marked."""
    from normswap.evaluate.speed_intervals import intervals_of
    from normswap.stats.verdicts import measurable

    models = [
        m
        for m in results["models"]
        if m.get("tokens_per_second") and m.get("ratios") and m["name"] != results.get("baseline")
    ]
    bars = []
    width = 0.8 / max(len(models), 1)
    for i, m in enumerate(models):
        ivs = (intervals_of(m, results) or {}).get("tokens_per_second") or {}
        for j, (key, _) in enumerate(METRICS):
            r = (m["ratios"].get("tokens_per_second") or {}).get(key)
            if r is None or (m.get("tokens_per_second") or {}).get(key) is None:
                continue
            iv = ivs.get(key)
            bars.append(
                Bar(
                    m["name"],
                    key,
                    j + (i - (len(models) - 1) / 2) * width,
                    r,
                    iv and iv["low"],
                    iv and iv["high"],
                    measurable(iv),
                    f"{r:.2f}",
                    r,
                )
            )
    if not bars:
        return bars, 1.0
    tallest = max(b.value for b in bars)
    limit = CLIP_AT * tallest
    reach = max([tallest] + [b.high for b in bars if b.high is not None and b.high <= limit])
    top = reach * 1.12
    for b in bars:
        b.clipped = b.high is not None and b.high > top
    return bars, top


def throughput_plot(results, out: Path) -> Path | None:
    """Throughput ratios with their per-repeat range as error bars; a hatched bar is a ratio that is no
    measured difference (its range contains 1 or the null control's, or the machine was too noisy).
    Values are written on the bars; a whisker past the axis is clipped and marked with its value.
    Legends sit below the axes, never on the bars."""
    from matplotlib.patches import Patch

    models = [m for m in results["models"] if m.get("tokens_per_second")]
    if not models:
        return None
    c = colors(results)
    has_ratio = any(m.get("ratios") for m in models)
    shown = [m for m in models if not has_ratio or m["name"] != results.get("baseline")] or models
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    width = 0.8 / len(shown)
    hatched = draw_ratio_bars(ax, results, c, width) if has_ratio else draw_tokens_per_second(ax, shown, c, width)
    ax.set_xticks(range(len(METRICS)), [label for _, label in METRICS])
    handles = [Patch(color=c[m["name"]], label=m["name"]) for m in shown]
    if hatched:
        handles.append(
            Patch(facecolor="white", edgecolor="#495057", hatch="///", label="hatched: no measured difference")
        )
    ax.legend(
        handles=handles,
        fontsize=8,
        frameon=False,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        ncol=min(len(handles), 3),
    )
    style_axes(ax)
    draw_norm_share(axes[1], results)
    return save_figure(fig, out / "throughput.png")


def draw_ratio_bars(ax, results, c: dict, width: float) -> bool:
    """The ratio chart (throughput_bars): solid bars for measured differences, hatched otherwise, each
    with its whisker and value. True when any bar is hatched (the legend then says what hatching means)."""
    bars, top = throughput_bars(results)
    for b in bars:
        _draw_ratio_bar(ax, b, c[b.model], width, top)
    ax.axhline(1.0, color="#868e96", linewidth=1, linestyle="--")
    ax.set_ylim(0, top)
    ax.set_ylabel(f"tokens/s relative to {results.get('baseline')}")
    from normswap.evaluate.speed_intervals import INTERVAL_WORDS, throughput_pairs

    how = (
        f"median per-pair ratio, whiskers: {INTERVAL_WORDS}"
        if throughput_pairs(results)
        else "ratio of medians, whiskers: per-repeat range"
    )
    ax.set_title(f"throughput ratio, bars: {how}", fontsize=10)
    return any(not b.clear for b in bars)


def _draw_ratio_bar(ax, b: Bar, color, width: float, top: float) -> None:
    ax.bar(
        [b.x],
        [b.value],
        width=width * 0.92,
        color=color,
        alpha=1.0 if b.clear else 0.45,
        hatch=None if b.clear else "///",
        edgecolor="white" if b.clear else color,
        linewidth=0,
    )
    if b.low is not None:
        high = min(b.high, top)
        ax.errorbar(
            [b.x],
            [b.value],
            yerr=[[max(b.value - b.low, 0)], [max(high - b.value, 0)]],
            fmt="none",
            ecolor="#343a40",
            elinewidth=1,
            capsize=0 if b.clipped else 2,
        )
    if b.clipped:  # the whisker leaves the axis: an arrow at the edge and the value it reached
        ax.annotate(
            f"↑{b.high:.2f}",
            (b.x, top),
            ha="left",
            va="top",
            fontsize=7,
            color="#c92a2a",
            xytext=(3, -1),
            textcoords="offset points",
        )
    ax.annotate(
        b.label,
        (b.x, b.label_y),
        ha="center",
        va="top",
        fontsize=7,
        xytext=(0, -3),
        textcoords="offset points",
        color="white" if b.clear else "#212529",
        fontweight="bold",
    )


def draw_tokens_per_second(ax, shown, c: dict, width: float) -> bool:
    """Without a baseline: absolute tokens/s per model on a log axis (nothing is hatched)."""
    for i, m in enumerate(shown):
        tps = m["tokens_per_second"]
        for j, (key, _) in enumerate(METRICS):
            if tps.get(key) is not None:
                ax.bar([j + (i - (len(shown) - 1) / 2) * width], [tps[key]], width=width * 0.92, color=c[m["name"]])
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput (higher is better)", fontsize=10)
    return False


def draw_norm_share(ax, results) -> None:
    rows = norm_share_rows(results)
    if rows:
        range_bars(ax, [(r.name, r.value, r.low, r.high, r.color, r.solid) for r in rows], ylabel="% of forward time")
        ax.set_title(norm_share_title(results), fontsize=10)
    else:
        ax.axis("off")
        style_axes(ax)


@dataclass
class ShareBar:
    """One bar of the "time in norms" chart: the share, in %, with its per-repeat range where the run
    recorded one (hooked forwards, before the norms were timed by the instrument)."""

    name: str
    value: float
    low: float | None
    high: float | None
    color: str
    solid: bool  # the baseline, the null control, or a measured difference in norm time


def norm_share_rows(results) -> list[ShareBar]:
    """Every model's norm share with its per-repeat range, and the null control's beside them (its
    spread is what noise alone did). A model whose norm time is no measured difference against the
    baseline (normswap/stats/verdicts.py's rule, null control included) is drawn hatched."""
    from normswap.evaluate.speed_intervals import intervals_of
    from normswap.stats.verdicts import measurable

    c = colors(results)
    null = results.get("null_control")
    rows = []
    for m in list(results["models"]) + ([null] if null and null.get("norm_time_share") is not None else []):
        share = m.get("norm_time_share")
        if share is None:
            continue
        per_repeat = [s for s in ((m.get("speed_setup") or {}).get("samples") or {}).get("norm_share") or [] if s]
        is_null = m is null
        if is_null or m["name"] == results.get("baseline"):
            solid = True
        else:
            solid = measurable((intervals_of(m, results) or {}).get("norm_ms_per_forward"))
        rows.append(
            ShareBar(
                m["name"],
                share * 100,
                min(per_repeat) * 100 if per_repeat else None,
                max(per_repeat) * 100 if per_repeat else None,
                "#adb5bd" if is_null else c.get(m["name"], "#495057"),
                solid,
            )
        )
    return rows


def norm_share_title(results) -> str:
    """What the bars and whiskers are, and how much the null control moved the norm time."""
    from normswap.evaluate.speed_intervals import fmt_interval

    spread = ((results.get("speed_noise") or {}).get("null_spread") or {}).get("norm_ms_per_forward")
    ranged = any(r.low is not None for r in norm_share_rows(results))
    if ranged:
        how = "bar: median, whisker: per-repeat range"
    elif spread and spread.get("pairs"):
        how = "bar: norm layers' time ÷ forward time (medians of the instrument's blocks)"
    else:
        how = "median (per-repeat range not recorded in this run)"
    title = "time in norm layers\n" + how
    if spread:
        title += f"\nnull control ÷ baseline {fmt_interval(spread)}"
        if "norm_ms_per_forward" in _noisy(results):
            title += ": too noisy to tell"
    return title


def _noisy(results) -> list[str]:
    from normswap.evaluate.speed_intervals import noisy_kinds

    return noisy_kinds(results)


def activation_plot(results, out: Path) -> Path | None:
    models = [m for m in results["models"] if (m.get("diagnostics") or {}).get("layers")]
    if not models:
        return None
    c = colors(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, m in enumerate(models):
        layers = m["diagnostics"]["layers"]
        xs = range(len(layers))
        # Exact conversions overlap their source exactly: earlier lines are drawn wider so that
        # every model stays visible underneath the later ones.
        style = {
            "marker": "o",
            "markersize": 3 + 2 * (len(models) - 1 - i),
            "linewidth": 1 + 1.2 * (len(models) - 1 - i),
            "color": c[m["name"]],
            "label": m["name"],
            "alpha": 0.9,
        }
        axes[0].plot(xs, [lay.get("rms") for lay in layers], **style)
        axes[1].plot(xs, [lay.get("token_mean_abs") for lay in layers], **style)
    axes[0].set_title("RMS of the input to each norm layer", fontsize=10)
    axes[1].set_title("|per-token mean| of that input (0 = centred)", fontsize=10)
    log_if_wide(axes[0], [lay.get("rms") for m in models for lay in m["diagnostics"]["layers"]])
    for ax in axes:
        ax.set_xlabel("norm layer (model order)")
        ax.legend(fontsize=8, frameon=False)
        style_axes(ax)
    return save_figure(fig, out / "activations.png")


def finetune_plot(results, out: Path) -> Path | None:
    """One axis per quantity: training cross-entropy, distillation KL (when used) and held-out
    loss each get their own panel (KL ~0.01 beside cross-entropy ~4.6 would be two flat lines)."""
    models = [m for m in results["models"] if (m.get("finetune") or {}).get("steps")]
    if not models:
        return None
    c = colors(results)
    distilled = any(m["finetune"].get("distill_loss") for m in models)
    panels = [("train", "training loss (cross-entropy)" if not distilled else "training cross-entropy (LM loss)")]
    if distilled:
        panels.append(("distill", "training distillation KL to the teacher"))
    if any(m["finetune"].get("eval_steps") for m in models):
        panels.append(("eval", "held-out loss (cross-entropy)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (kind, title) in zip(axes[0], panels):
        for m in models:
            ft = m["finetune"]
            if kind == "train":
                ys = ft.get("lm_loss") or ft["loss"] if distilled else ft["loss"]
                pts = [(s, y) for s, y in zip(ft["steps"], ys) if y is not None]
                ax.plot([s for s, _ in pts], [y for _, y in pts], color=c[m["name"]], linewidth=1.2, label=m["name"])
            elif kind == "distill":
                pts = [(s, y) for s, y in zip(ft["steps"], ft.get("distill_loss") or []) if y is not None]
                ax.plot([s for s, _ in pts], [y for _, y in pts], color=c[m["name"]], linewidth=1.2, label=m["name"])
            elif ft.get("eval_steps"):
                ax.plot(
                    ft["eval_steps"], ft["eval_loss"], color=c[m["name"]], marker="o", markersize=4, label=m["name"]
                )
                for s, y in ((ft["eval_steps"][0], ft["eval_loss"][0]), (ft["eval_steps"][-1], ft["eval_loss"][-1])):
                    ax.annotate(f"{y:.3f}", (s, y), fontsize=8, xytext=(0, 5), textcoords="offset points", ha="center")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.08, y=0.15)
        style_axes(ax)
    if len(models) > 1:
        axes[0][0].legend(fontsize=8, frameon=False)
    else:
        fig.suptitle(f"fine-tune of {models[0]['name']}", fontsize=10)
    return save_figure(fig, out / "finetune_loss.png")


def interval_dots(ax, rows, *, reference: float, xlabel: str, fmt: str = "{:.3f}") -> None:
    """A dot plot of estimates with their intervals, one row per arm (``rows``: (label, mean, low,
    high, color)), a line at ``reference`` (no change). Dots, not bars: a bar of a ratio drawn from 1
    hides its length, one drawn from 0 hides a 4 % difference; a dot with its interval shows both.
    Every row is drawn, the null control's included, and each is labelled with its value."""
    ys = list(range(len(rows)))[::-1]
    for y, (_label, mean, low, high, color) in zip(ys, rows):
        if mean is None:
            continue
        if low is not None and high is not None:
            ax.plot([low, high], [y, y], color=color, linewidth=2.2, solid_capstyle="butt")
        ax.plot([mean], [y], marker="o", markersize=7, color=color)
        ax.annotate(fmt.format(mean), (mean, y), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=8)
    ax.axvline(reference, color="#868e96", linewidth=1, linestyle="--")
    ax.set_yticks(ys, [r[0] for r in rows], fontsize=9)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    values = [v for r in rows for v in r[1:4] if v is not None] + [reference]
    span = max(max(values) - min(values), 1e-3)
    ax.set_xlim(min(values) - 0.15 * span, max(values) + 0.15 * span)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", color="#e9ecef", linewidth=0.8)
    ax.set_axisbelow(True)


def range_bars(ax, rows, *, ylabel: str, fmt: str = "{:.1f}%") -> None:
    """Bars from 0 with a whisker over each one's range (``rows``: (label, value, low, high, color,
    solid)); a bar that is no measured difference (``solid`` False) is hatched. Labels sit above the
    whisker so they are never covered by it."""
    xs = range(len(rows))
    top = 0.0
    for x, (_label, value, low, high, color, solid) in zip(xs, rows):
        ax.bar(
            [x],
            [value],
            color=color,
            alpha=1.0 if solid else 0.45,
            hatch=None if solid else "///",
            edgecolor="white" if solid else color,
            linewidth=0,
        )
        tip = value
        if low is not None and high is not None:
            ax.errorbar(
                [x], [value], yerr=[[max(value - low, 0)], [max(high - value, 0)]], fmt="none", ecolor="#343a40"
            )
            tip = max(value, high)
        top = max(top, tip)
        ax.annotate(
            fmt.format(value), (x, tip), ha="center", va="bottom", fontsize=9, xytext=(0, 3), textcoords="offset points"
        )
    ax.set_xticks(list(xs), [r[0] for r in rows], fontsize=9, rotation=15)
    ax.set_ylim(0, max(top * 1.2, 1e-9))
    ax.set_ylabel(ylabel)
    style_axes(ax)


SLICE_BASES = (("pca", "one rotation (PCA)"), ("per-layer", "per layer (SliceGPT)"), ("random", "random rotation"))


def slice_curve_plot(results, out: Path) -> Path | None:
    """Perplexity before healing (left) and speed (right) against the share of the stream's width
    deleted, from results' ``slice_curve`` (docs/results-schema.md): a line per basis and model with the
    original's perplexity as a dashed line; speed ratios as dots with their intervals, one colour a
    kind. None when the results hold no curve."""
    curve = results.get("slice_curve") if isinstance(results, dict) else None
    if not curve or not curve.get("perplexity"):
        return None
    speed = curve.get("speed") or []
    fig, axes = plt.subplots(1, 2 if speed else 1, figsize=(9.6 if speed else 5.2, 3.6), squeeze=False)
    ax = axes[0][0]
    c = palette(name for name, _ in SLICE_BASES)
    styles = ["-", "--", ":", "-."]
    for i, row in enumerate(curve["perplexity"]):
        points = sorted(row["points"], key=lambda p: p["fraction"])
        for basis, label in SLICE_BASES:
            pts = [(p["fraction"], p["perplexity"].get(basis)) for p in points]
            pts = [(x, y) for x, y in pts if isinstance(y, (int, float))]
            if pts:
                ax.plot(
                    [100 * x for x, _ in pts],
                    [y for _, y in pts],
                    color=c[basis],
                    linestyle=styles[i % len(styles)],
                    marker="o",
                    markersize=4,
                    label=f"{row['model']}: {label}",
                )
        if isinstance(row.get("original"), (int, float)):
            ax.axhline(row["original"], color="#868e96", linewidth=1, linestyle=styles[i % len(styles)])
    log_if_wide(ax, [p["perplexity"].get(b) for r in curve["perplexity"] for p in r["points"] for b, _ in SLICE_BASES])
    ax.set_xlabel("width deleted (%)")
    ax.set_ylabel("perplexity before healing (held-out)")
    ax.set_title("perplexity against the fraction sliced (grey: the original)", fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    style_axes(ax)
    if speed:
        ax = axes[0][1]
        kinds = palette(dict.fromkeys(s["kind"] for s in speed))
        for s in speed:
            x = 100 * s["fraction"]
            ax.plot([x, x], [s["low"], s["high"]], color=kinds[s["kind"]], linewidth=2.2, solid_capstyle="butt")
            ax.plot([x], [s["ratio"]], marker="o", markersize=6, color=kinds[s["kind"]])
            ax.annotate(
                f"{s['kind']} ×{s['ratio']:.2f} vs {s['baseline']}",
                (x, s["ratio"]),
                xytext=(6, 0),
                textcoords="offset points",
                fontsize=7,
                va="center",
            )
        bounds = sorted({(s["fraction"], s["flop_bound"]) for s in speed if s.get("flop_bound")})
        if bounds:
            ax.plot([100 * f for f, _ in bounds], [b for _, b in bounds], "k+", markersize=9, label="FLOP bound")
            ax.legend(fontsize=7, frameon=False)
        ax.axhline(1.0, color="#868e96", linewidth=1, linestyle="--")
        ax.set_xlim(0, 60)
        ax.set_xlabel("width deleted (%)")
        ax.set_ylabel("speed ÷ baseline's (>1 faster)")
        ax.set_title("speed of the sliced model, 95 % intervals", fontsize=10)
        style_axes(ax)
    return save_figure(fig, out / "slice_curve.png")
