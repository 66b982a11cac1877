"""The study's decision from its units: comparisons, the throughput gates, the sweep and migration
rule, the null control, the power achieved, the instrument check and the claims' verdicts."""

from __future__ import annotations

from normswap.host import usable_cpus
from normswap.study.config import BASELINE, CONTROL, PLANTED_LR, StudyConfig
from normswap.study.judging import claim_judges as claims_mod
from normswap.study.judging import power, speed
from normswap.study.judging import results as res
from normswap.study.study_plan import Plan, Trained
from normswap.study.training import migration


def analyse(
    cfg: StudyConfig,
    units: dict,
    arms: list[str],
    baselines: dict,
    precision: dict | None,
    *,
    kernel_setup: dict | None = None,
    loads=(),
    cpus: int | None = None,
    stability_sweep: dict | None = None,
    mults: list[float] | None = None,
    from_scratch: bool = True,
    speed_phase: dict | None = None,
) -> dict:
    """Comparisons (with the Amdahl bound and the throughput gates, speed.py), sweep, migration rule,
    null control and the claims' verdicts from the units so far (the runner also calls it between
    seeds to decide whether another one is needed)."""
    mults = mults or cfg.multipliers()  # the sweep's rates, extended past an edge where one was
    ref_mult = 1.0 if 1.0 in mults else mults[0]
    diverged_loss = baselines.get("uniform_loss")
    comparisons = {
        a: res.compare(units, a, BASELINE, ref_mult, margin=cfg.margin, diverged_loss=diverged_loss)
        for a in arms
        if a != BASELINE
    }
    control_boot = None
    if speed_phase is not None:  # the timing phase's ratios replace the units' (unpaired in workers)
        control_boot = speed.use_speed_phase(comparisons, speed_phase)
    base_units = [u for (a, _, m), u in units.items() if a == BASELINE and m == ref_mult]
    norm_share = speed.add_amdahl(comparisons, base_units, kernel_setup or {})
    loads = list(loads)
    control_boot = control_boot or (comparisons.get(CONTROL) or {}).get("throughput_ratio_bootstrap")
    for c in comparisons.values():
        c["throughput_gates"] = speed.gates(control_boot, c.get("amdahl_bound"), loads, cpus)
    sw = res.sweep(units, arms, mults, BASELINE)
    rules = {}
    if sw is not None:
        for a in arms:
            if a not in (BASELINE, CONTROL) and a in claims_mod.RMS_ARMS:
                seeds = sorted({s for (arm, s, _) in units if arm == a})
                rules[a] = migration.analyse(units, a, BASELINE, mults, seeds, ref_mult, from_scratch=from_scratch)
    null = claims_mod.null_control(comparisons.get(CONTROL))
    ctx = claims_mod.Context(
        margin=cfg.margin,
        baselines=baselines,
        control=comparisons.get(CONTROL),
        null_control=null,
        precision=precision,
        train_precision=cfg.precision,
        rules=rules,
        loads=tuple(loads),
        cpus=cpus,
        stability_sweep=stability_sweep,
        throughput_null=control_boot,
    )
    verdicts = claims_mod.judge(comparisons, ctx, CONTROL)

    return {
        "power": power.achieved(comparisons, cfg.margin, CONTROL),
        "instrument_check": claims_mod.instrument_check(comparisons, ctx, CONTROL, list(PLANTED_LR)),
        "reference_multiplier": ref_mult,
        "comparisons": comparisons,
        "baseline_norm_share": norm_share,
        "lr_sweep": sw,
        "migration_rule": rules or None,
        "null_control": null,
        "claims": verdicts,
        "multiplicity": claims_mod.multiplicity(verdicts),
    }


def decide(plan: Plan, trained: Trained, speed_record: dict | None, loads: list) -> dict:
    """Stage 4: the kernels' accuracy, the stability summary, the comparisons and the verdicts."""
    from normswap.study.measuring import precision as kernel_acc

    cfg, arms, units = plan.cfg, plan.arms, trained.units
    dev = "cpu" if plan.dist.device.type != "cuda" else plan.dist.device
    kinds = {a: kernel_acc.arm_kind(a) for a in arms}
    precision = kernel_acc.kernel_accuracy(dev, kernel_acc.kernels_for(list(units.values()), cfg.kernels, kinds))
    stability, stability_sweep = None, None
    if trained.stab_units is not None:
        from normswap.study.training import stability as stab

        stab_seeds = list(range(cfg.seeds))
        stability = stab.summarize(trained.stab_units, arms, stab_seeds, cfg)
        stability_sweep = stab.sweep_record(trained.stab_units, arms, stab_seeds, cfg, BASELINE)
    analysis = analyse(
        cfg,
        units,
        arms,
        plan.baselines,
        precision,
        kernel_setup=plan.kernel_setup,
        loads=loads,
        cpus=usable_cpus(),
        stability_sweep=stability_sweep,
        mults=trained.mults,
        from_scratch=plan.source.from_scratch,
        speed_phase=speed_record,
    )
    return dict(analysis, precision=precision, stability=stability, stability_sweep=stability_sweep)
