"""'Claims vs measured': the figures usually quoted for LayerNorm -> RMSNorm beside this run's.

Each row: the claim, where the number comes from in general, and what this run measured for
each compared model against the baseline - so a user sees what the swap buys on *their* model
and hardware (often: little end to end, because norms are a small share of the work).
"""

from __future__ import annotations


def _pct(x):
    return f"{x * 100:.1f}%"


def _spread(models):
    """Largest (max - min) / median of any model's forward samples: how noisy this machine was."""
    worst = None
    for m in models:
        samples = ((m.get("speed_setup") or {}).get("samples") or {}).get("forward") or []
        if len(samples) >= 2:
            ordered = sorted(samples)
            median = ordered[len(ordered) // 2]
            if median > 0:
                value = (ordered[-1] - ordered[0]) / median
                worst = value if worst is None else max(worst, value)
    return worst


def claims(results) -> list[dict]:
    models = results["models"]
    base = next((m for m in models if m["name"] == results.get("baseline")), None)
    others = [m for m in models if base is None or m["name"] != base["name"]]
    rows = []

    # 1. arithmetic
    lines = []
    for m in ([base] if base else []) + others:
        f = m.get("flops_per_token") or {}
        if not f.get("model_estimate"):
            continue
        share = f["norms"] / f["model_estimate"]
        lines.append(f"{m['name']}: {m.get('norm_layers', '?')} norm layers, {f['norms']:,} FLOPs/token "
                     f"= {share * 100:.3f}% of ~{f['model_estimate']:,} (2 x parameters)")
    rows.append({
        "claim": "Norm FLOPs ~8d per token (LayerNorm) vs ~4d (RMSNorm): half the arithmetic",
        "measured": lines,
        "meaning": "Halving a share this small cannot move end-to-end speed by itself; norms are bound by memory traffic, not arithmetic.",
    })

    # 2. time inside the norm layers
    lines = []
    if base is not None and (base.get("norm_time") or {}).get("norm_ms_per_forward"):
        b_ms = base["norm_time"]["norm_ms_per_forward"]
        lines.append(f"{base['name']}: {b_ms:.2f} ms per forward in norm layers ({_pct(base['norm_time_share'])} of the forward)")
        for m in others:
            nt = m.get("norm_time") or {}
            if nt.get("norm_ms_per_forward") is None:
                continue
            change = 1 - nt["norm_ms_per_forward"] / b_ms
            word = "less" if change >= 0 else "more"
            lines.append(f"{m['name']}: {nt['norm_ms_per_forward']:.2f} ms ({_pct(abs(change))} {word} time; "
                         f"{_pct(m['norm_time_share'])} of its forward)")
    else:
        for m in models:
            if m.get("norm_time_share") is not None:
                lines.append(f"{m['name']}: {_pct(m['norm_time_share'])} of the forward in norm layers")
    rows.append({
        "claim": "RMSNorm takes 7-64% less time than LayerNorm",
        "measured": lines or ["not measured in this run"],
        "meaning": "Kernel-level gains, measured here inside the whole model (forward hooks; inference forward).",
    })

    # 3. end to end
    lines = []
    bound = None
    if base is not None and base.get("norm_time_share") is not None and base["norm_time_share"] < 1:
        bound = 1 / (1 - base["norm_time_share"])
    for m in others:
        r = (m.get("ratios") or {}).get("tokens_per_second") or {}
        parts = [f"{k.replace('_', ' ')} x{r[k]:.2f}" for k in ("forward", "train_step", "prefill", "decode") if r.get(k) is not None]
        if parts:
            lines.append(f"{m['name']}: " + ", ".join(parts))
    if bound is not None:
        lines.append(f"upper bound (Amdahl): norm time -> 0 would give at most x{bound:.2f} on the forward")
    spread = _spread(models)
    if spread is not None:
        lines.append(f"repeat-to-repeat spread of forward tokens/s in this run: up to {spread * 100:.0f}% of the median "
                     "(ratios closer to 1 than this are noise)")
    rows.append({
        "claim": "10-30% higher throughput after the swap",
        "measured": lines or ["needs --baseline and speed measurements"],
        "meaning": "End-to-end tokens/s against the baseline, medians of interleaved repeats on this device and dtype.",
    })
    return rows
