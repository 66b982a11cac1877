"""The report's figures (matplotlib, Agg backend: no display needed), written as PNG files.

Each function takes the results dict and returns the path it wrote, or None when the run has
nothing to plot for it (e.g. no fine-tuned model, speed not measured).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PALETTE = ["#4c6ef5", "#f76707", "#2b8a3e", "#c2255c", "#5f3dc4", "#0b7285", "#e67700", "#495057"]
METRICS = (("forward", "forward"), ("train_step", "train step"), ("prefill", "prefill"), ("decode", "decode"))


def _style(ax):
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#e9ecef", linewidth=0.8)
    ax.set_axisbelow(True)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def colors(results) -> dict:
    return {m["name"]: PALETTE[i % len(PALETTE)] for i, m in enumerate(results["models"])}


def perplexity_plot(results, out: Path) -> Path | None:
    models = [m for m in results["models"] if m.get("perplexity") is not None]
    if not models:
        return None
    c = colors(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2 + 0.1 * len(models)))
    for ax, key, title in ((axes[0], "perplexity", "token perplexity"), (axes[1], "bits_per_byte", "bits per byte")):
        names = [m["name"] for m in models]
        values = [m[key] for m in models]
        bars = ax.bar(names, values, color=[c[n] for n in names])
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.3f}" if key == "bits_per_byte" else f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v),
                        ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
        ax.set_title(f"{title} (lower is better)", fontsize=10)
        ax.tick_params(axis="x", labelrotation=15, labelsize=9)
        ax.set_ylim(0, max(values) * 1.15)
        _style(ax)
    d = results["data"]
    fig.suptitle(f"{d['spec']} / {d['split']}: {d['characters']:,} characters", fontsize=10)
    return _save(fig, out / "perplexity.png")


def throughput_plot(results, out: Path) -> Path | None:
    models = [m for m in results["models"] if m.get("tokens_per_second")]
    if not models:
        return None
    c = colors(results)
    has_ratio = any(m.get("ratios") for m in models)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        tps = m["tokens_per_second"]
        xs, ys, labels = [], [], []
        for j, (key, _) in enumerate(METRICS):
            if tps.get(key) is None:
                continue
            if has_ratio:
                r = (m.get("ratios") or {}).get("tokens_per_second", {}).get(key)
                if r is None:
                    continue
                ys.append(r)
                labels.append(f"{r:.2f}×")
            else:
                ys.append(tps[key])
                labels.append(f"{tps[key]:,.0f}")
            xs.append(j + (i - (len(models) - 1) / 2) * width)
        bars = ax.bar(xs, ys, width=width * 0.95, color=c[m["name"]], label=m["name"])
        for bar, lab in zip(bars, labels):
            ax.annotate(lab, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(METRICS)), [label for _, label in METRICS])
    if has_ratio:
        ax.axhline(1.0, color="#868e96", linewidth=1, linestyle="--")
        ax.set_ylabel(f"tokens/s relative to {results.get('baseline')}")
        ax.set_title("throughput ratio (higher is better)", fontsize=10)
    else:
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s")
        ax.set_title("throughput (higher is better)", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    _style(ax)
    ax = axes[1]
    shares = [(m["name"], m.get("norm_time_share")) for m in models if m.get("norm_time_share") is not None]
    if shares:
        bars = ax.bar([n for n, _ in shares], [s * 100 for _, s in shares], color=[c[n] for n, _ in shares])
        for bar, (_, s) in zip(bars, shares):
            ax.annotate(f"{s * 100:.1f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
        ax.set_ylim(0, max(max(s for _, s in shares) * 100 * 1.25, 1))
        ax.set_ylabel("% of forward time")
        ax.set_title("time in norm layers", fontsize=10)
        ax.tick_params(axis="x", labelrotation=15, labelsize=9)
    else:
        ax.axis("off")
    _style(ax)
    return _save(fig, out / "throughput.png")


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
        style = {"marker": "o", "markersize": 3 + 2 * (len(models) - 1 - i), "linewidth": 1 + 1.2 * (len(models) - 1 - i),
                 "color": c[m["name"]], "label": m["name"], "alpha": 0.9}
        axes[0].plot(xs, [lay.get("rms") for lay in layers], **style)
        axes[1].plot(xs, [lay.get("token_mean_abs") for lay in layers], **style)
    axes[0].set_title("RMS of the input to each norm layer", fontsize=10)
    axes[1].set_title("|per-token mean| of that input (0 = centred)", fontsize=10)
    values = [lay.get("rms") for m in models for lay in m["diagnostics"]["layers"] if lay.get("rms")]
    if values and max(values) / max(min(values), 1e-30) > 30:
        axes[0].set_yscale("log")  # deep models: the residual stream grows by orders of magnitude
    for ax in axes:
        ax.set_xlabel("norm layer (model order)")
        ax.legend(fontsize=8, frameon=False)
        _style(ax)
    return _save(fig, out / "activations.png")


def finetune_plot(results, out: Path) -> Path | None:
    models = [m for m in results["models"] if (m.get("finetune") or {}).get("steps")]
    if not models:
        return None
    c = colors(results)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for m in models:
        ft = m["finetune"]
        ax.plot(ft["steps"], ft["loss"], color=c[m["name"]], linewidth=1.2, label=f"{m['name']} train loss")
        if ft.get("eval_steps"):
            ax.plot(ft["eval_steps"], ft["eval_loss"], color=c[m["name"]], linestyle="--", marker="o", markersize=3,
                    label=f"{m['name']} eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("fine-tune loss", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    _style(ax)
    return _save(fig, out / "finetune_loss.png")


def all_plots(results, out: Path) -> dict[str, Path]:
    out = Path(out)
    made = {}
    for key, fn in (("perplexity", perplexity_plot), ("throughput", throughput_plot),
                    ("finetune_loss", finetune_plot), ("activations", activation_plot)):
        path = fn(results, out)
        if path is not None:
            made[key] = path
    return made
