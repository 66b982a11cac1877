"""The migration rule, tested so that it can fail: γ = 1, linear warmup, η_RMS = η_LN × g, where g is
the gradient-scale ratio (the RMSNorm arm's mean global gradient norm over the first steps ÷
LayerNorm's, at the reference rate, geometric mean over seeds).

From ``--lr-sweep`` (at least MIN_RATES log-spaced multipliers) every arm's final model is scored
per held-out block on two disjoint sets: **validation** (the study's held-out blocks) and **test**
(the corpus's test split; for data without its own splits, the validation blocks are split in two,
even rows validation, odd rows test). Then, per arm:

* **chosen on validation**: the mean validation loss per rate; its lowest rate; a best rate at the
  sweep's edge is not a bracket (the runner extends the sweep by up to MAX_EXTENSIONS rates past
  that edge; still at the edge: said, and never "reproduced"); the fit window = that rate and its
  two neighbours;
* **judged on test**: η* = the vertex of the quadratic in log η through the window's three test
  losses (a non-convex fit keeps the window's lowest rate; the vertex is kept inside the window);
  the ratio η*_RMS ÷ η*_LN, and its bootstrap interval (BOOTSTRAP resamples of the seeds — the same
  seeds for both arms, they share initialisation and data — and of the test blocks, the same blocks
  for both arms; percentile interval).

Verdict: reproduced when the rule's ratio g lies inside the interval and the interval spans at most
MAX_WIDTH (high ÷ low: narrow enough that a rule off by more than that factor would fall outside);
not reproduced when the interval is that narrow and excludes g; otherwise not measurable here (with
the width said). From random initialisation both arms start with γ = 1 and β = 0, so g ≈ 1 by
construction and the rule reduces to "keep the rate" — said beside the verdict; from a trained
checkpoint (γ ≠ 1) g is measured. Ablations: the ``rmsnorm-approx`` arm keeps γ (folded) instead
of resetting it to 1, so its row is the γ = 1 ablation; the warmup ablation is the same study with
``--warmup-steps 0``.
"""

from __future__ import annotations

import math
import statistics

import torch

from normswap.report.claims import NOT_MEASURABLE, NOT_REPRODUCED, REPRODUCED
from normswap.stats.bootstrap import two_way_interval
from normswap.stats.levels import LEVEL

MIN_RATES = 5
MAX_EXTENSIONS = 2
BOOTSTRAP = 1000
MAX_WIDTH = 2.0  # the interval's high ÷ low: at most ×2 (about ×1.41 either side)
ABLATIONS = {"rmsnorm-approx": "γ kept (folded into the readers) instead of γ = 1: the γ = 1 ablation"}


# ---------------------------------------------------------------------------- held-out blocks


def blocks(tokenizer, eval_spec: str, cfg, eval_set: torch.Tensor) -> dict:
    """``{"validation": rows, "test": rows, "how": ...}``: the study's held-out blocks and a disjoint test set."""
    from normswap.data import has_own_splits
    from normswap.finetune.batches import eval_blocks

    if has_own_splits(eval_spec):
        test = eval_blocks(tokenizer, eval_spec, cfg.seq_len, cfg.eval_tokens, split="test")
        return {"validation": eval_set, "test": test, "how": "validation split / test split of the corpus"}
    return {
        "validation": eval_set[0::2],
        "test": eval_set[1::2],
        "how": "the held-out blocks split in two (even rows validation, odd rows test)",
    }


def block_losses(model, rows: torch.Tensor, precision: str, device, micro: int = 8) -> list[float] | None:
    """Mean next-token loss of each block (row), or None when any is non-finite."""
    from normswap.study.interleaved import autocast_for

    was = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad(), autocast_for(precision, device):
            for i in range(0, len(rows), micro):
                ids = rows[i : i + micro].to(device)
                logits = model(input_ids=ids).logits[:, :-1].float()
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
                )
                out += loss.view(ids.shape[0], -1).double().mean(-1).tolist()
    finally:
        model.train(was)
    return out if all(math.isfinite(v) for v in out) else None


def add_block_losses(group_arms, held_out: dict, precision: str, device) -> None:
    """Each finished arm's final per-block losses on validation and test (outside any timed step)."""
    for arm in group_arms:
        if arm.stopped:
            arm.record["final_block_losses"] = None
            continue
        arm.record["final_block_losses"] = {
            split: block_losses(arm.model, held_out[split], precision, device) for split in ("validation", "test")
        }


# ---------------------------------------------------------------------------- fitting η*


def _window(curve: list[float]) -> tuple[int, bool]:
    """(index of the lowest finite loss, at the sweep's edge)."""
    finite = [i for i, v in enumerate(curve) if math.isfinite(v)]
    if not finite:
        return -1, True
    i = min(finite, key=lambda j: curve[j])
    return i, i == 0 or i == len(curve) - 1


def fit_eta(xs: list[float], ys: list[float]) -> float:
    """log η* from three (log η, loss) points around the lowest: the quadratic's vertex, kept inside them."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    if not all(math.isfinite(y) for y in ys):
        return x1
    d = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / d
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / d
    if a <= 0:
        return xs[min(range(3), key=lambda j: ys[j])]
    return min(max(-b / (2 * a), x0), x2)


def _losses(units: dict, arm: str, seeds: list[int], mults: list[float], split: str):
    """losses[s][k] = per-block list (None: diverged or missing) for seed s, rate k."""
    out = []
    for s in seeds:
        row = []
        for m in mults:
            u = units.get((arm, s, m))
            fb = (u or {}).get("final_block_losses") or {}
            row.append(fb.get(split))
        out.append(row)
    return out


def _curve(losses, seed_idx, block_idx) -> list[float]:
    curve = []
    for k in range(len(losses[0]) if losses else 0):
        vals = []
        for s in seed_idx:
            b = losses[s][k]
            if b is None:
                vals = None
                break
            vals += [b[j] for j in block_idx]
        curve.append(statistics.fmean(vals) if vals else math.inf)
    return curve


def extension(units: dict, arms: list[str], mults: list[float], seeds: list[int]) -> float | None:
    """The next rate past the edge where some arm's validation minimum sits (None: every minimum bracketed,
    or no sweep to extend)."""
    mults = sorted(mults)
    if len(mults) < MIN_RATES:
        return None
    for arm in arms:
        losses = _losses(units, arm, seeds, mults, "validation")
        n_blocks = next((len(b) for row in losses for b in row if b), 0)
        if not n_blocks:
            continue
        i, edge = _window(_curve(losses, range(len(seeds)), range(n_blocks)))
        if i < 0:
            continue
        if edge:
            return mults[0] ** 2 / mults[1] if i == 0 else mults[-1] ** 2 / mults[-2]
    return None


# ---------------------------------------------------------------------------- the rule


def grad_scale_ratio(units: dict, arm: str, base: str, seeds: list[int], ref: float) -> tuple[float | None, list]:
    ratios = []
    for s in seeds:
        a, b = units.get((arm, s, ref)), units.get((base, s, ref))
        ga, gb = (a or {}).get("grad_scale_start"), (b or {}).get("grad_scale_start")
        if ga and gb:
            ratios.append(ga / gb)
    return (math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None), ratios


def analyse(
    units: dict, arm: str, base: str, mults: list[float], seeds: list[int], ref: float, *, from_scratch: bool, rng=None
) -> dict:
    """results.json's ``migration_rule[arm]``."""
    mults = sorted(mults)
    g, g_seeds = grad_scale_ratio(units, arm, base, seeds, ref)
    out = {
        "arm": arm,
        "rates": mults,
        "grad_scale_ratio": g,
        "grad_scale_ratio_per_seed": g_seeds,
        "reference_multiplier": ref,
        "ratio_by_construction": from_scratch,
        "ablation": ABLATIONS.get(arm),
        "max_width": MAX_WIDTH,
        "min_rates": MIN_RATES,
    }
    if len(mults) < MIN_RATES:
        return dict(out, problem=f"needs ≥ {MIN_RATES} swept rates (has {len(mults)})")
    steps = [math.log(b / a) for a, b in zip(mults, mults[1:])]
    out["log_spaced"] = max(steps) - min(steps) <= 0.05 * max(steps)
    xs = [math.log(m) for m in mults]
    val = {a: _losses(units, a, seeds, mults, "validation") for a in (base, arm)}
    test = {a: _losses(units, a, seeds, mults, "test") for a in (base, arm)}
    n_val = next((len(b) for row in val[base] for b in row if b), 0)
    n_test = next((len(b) for row in test[base] for b in row if b), 0)
    if not n_val or not n_test:
        return dict(out, problem="no per-block held-out losses (every run diverged?)")
    all_seeds = list(range(len(seeds)))
    windows, edges = {}, {}
    for a in (base, arm):
        curve = _curve(val[a], all_seeds, range(n_val))
        i, edge = _window(curve)
        windows[a], edges[a] = i, edge
        out[f"validation_curve_{'baseline' if a == base else 'arm'}"] = [v if math.isfinite(v) else None for v in curve]
    best = {a: mults[windows[a]] if windows[a] >= 0 else None for a in (base, arm)}
    out["validation_best_multiplier"] = {"baseline": best[base], "arm": best[arm]}
    out["at_edge"] = {"baseline": edges[base], "arm": edges[arm]}
    if any(edges.values()):
        return dict(out, problem="a best rate sits at the sweep's edge: not bracketed")

    def eta(a, seed_idx, block_idx):
        i = windows[a]
        curve = _curve(test[a], seed_idx, block_idx)
        return fit_eta(xs[i - 1 : i + 2], curve[i - 1 : i + 2])

    point = {a: eta(a, all_seeds, range(n_test)) for a in (base, arm)}
    ratio = math.exp(point[arm] - point[base])
    rng = rng or torch.Generator().manual_seed(0)
    lo, hi = (
        math.exp(b)
        for b in two_way_interval(
            lambda s_idx, b_idx: eta(arm, s_idx, b_idx) - eta(base, s_idx, b_idx),
            len(seeds),
            n_test,
            draws=BOOTSTRAP,
            generator=rng,
        )
    )
    return dict(
        out,
        eta_star_multiplier={"baseline": math.exp(point[base]), "arm": math.exp(point[arm])},
        eta_ratio=ratio,
        eta_ratio_interval={"low": lo, "high": hi, "level": LEVEL, "resamples": BOOTSTRAP, "width": hi / lo},
        predicted_ratio=g,
        predicted_multiplier=None if g is None else math.exp(point[base]) * g,
        problem=None,
    )


def judge(rule: dict | None) -> tuple[str, str]:
    """The migration claim's verdict for one arm."""
    if rule is None:
        return NOT_MEASURABLE, f"needs --lr-sweep with ≥ {MIN_RATES} log-spaced multipliers bracketing each best rate"
    g = rule.get("grad_scale_ratio")
    note = (
        " (from random initialisation: γ = 1, β = 0 in both arms, g ≈ 1 by construction)"
        if rule.get("ratio_by_construction")
        else ""
    )
    if rule.get("problem"):
        best = rule.get("validation_best_multiplier") or {}
        where = f"; validation best ×{best.get('baseline')} (layernorm), ×{best.get('arm')} (arm)" if best else ""
        return NOT_MEASURABLE, rule["problem"] + where
    if g is None:
        return NOT_MEASURABLE, "no gradient-scale ratio (an arm diverged in its first steps)"
    iv = rule["eta_ratio_interval"]
    text = (
        f"η*_RMS/η*_LN {rule['eta_ratio']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}] (test split, bootstrap over "
        f"seeds and blocks, window chosen on validation); the rule predicts g = {g:.3f}{note}"
    )
    if iv["width"] > MAX_WIDTH:
        return NOT_MEASURABLE, text + f": the interval spans ×{iv['width']:.2f} > ×{MAX_WIDTH:g}, too wide to fail"
    if iv["low"] <= g <= iv["high"]:
        return REPRODUCED, text + f" (interval ×{iv['width']:.2f} wide, ≤ ×{MAX_WIDTH:g})"
    return NOT_REPRODUCED, text + ": outside the interval"
