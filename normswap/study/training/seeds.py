"""The seed decision: after --seeds, one more seed while a verdict is still open, below --max-seeds
and within --budget; it trains the baseline and the arms with a verdict open only."""

from __future__ import annotations

import math
import statistics

from normswap.host import usable_cpus
from normswap.study.config import BASELINE, StudyConfig
from normswap.study.distributed import agree
from normswap.study.judging import claim_judges as claims_mod
from normswap.study.judging.analysis import analyse
from normswap.study.study_plan import Plan, Trained


def seed_decision(
    cfg: StudyConfig, seed: int, rows: list[dict], spent: float, per_seed: list[float]
) -> tuple[bool, str]:
    """Whether seed ``seed`` (0-based, beyond --seeds) should run, and why: while a verdict is still
    open (claims.open_rows: more seeds could decide it), below --max-seeds, and while the seeds so
    far (their mean time) say another fits in --budget."""
    if seed >= cfg.seed_limit():
        return False, f"--max-seeds {cfg.seed_limit()} reached"
    pending = claims_mod.open_rows(rows)
    if not pending:
        return False, f"every verdict decided after {seed} seeds"
    estimate = statistics.fmean(per_seed) if per_seed else 0.0
    if cfg.budget and spent + estimate > cfg.budget:
        return False, (
            f"budget: {spent:.0f} s spent, another seed takes ~{estimate:.0f} s of {cfg.budget:g} s "
            f"({len(pending)} verdict(s) still open)"
        )
    names = ", ".join(sorted({f"{r['claim'].split(':')[0]} ({r['arm']})" for r in pending})[:3])
    return True, f"{len(pending)} verdict(s) open after {seed} seeds, e.g. {names}"


def open_questions(plan: Plan, trained: Trained, before: int) -> list[dict]:
    """The claims' rows, and the instrument check's arms still undecided (as open rows): what more
    seeds could decide, from the seeds before ``before`` (a resumed run decides as the first did,
    whatever of seed ``before`` it had finished). In worker processes speed is the timing phase's,
    which seeds do not change."""
    units = {k: u for k, u in trained.units.items() if k[1] < before}
    analysis = analyse(plan.cfg, units, plan.arms, plan.baselines, None, kernel_setup=plan.kernel_setup,
                       cpus=usable_cpus())  # fmt: skip
    rows = [r for r in analysis["claims"] if plan.workers == 1 or r["claim"] != claims_mod.THROUGHPUT]
    for arm, r in ((analysis.get("instrument_check") or {}).get("arms") or {}).items():
        if r["finding"] == "undecided":
            rows.append({"claim": f"instrument check: {r['role']}", "arm": arm, "verdict": claims_mod.NOT_MEASURABLE,
                         "open": True})  # fmt: skip
    return rows


def next_seed(plan: Plan, trained: Trained, seed: int, per_seed: list, echo) -> list[str]:
    """Beyond --seeds: the arms seed ``seed`` trains (none: it does not run), decided by process 0
    from the verdicts so far. Only the baseline and the arms with a verdict still open: a decided
    arm's interval needs no more seeds, and its units would only cost the open ones their budget."""
    rows = open_questions(plan, trained, seed) if plan.main else []
    open_arms = {r.get("arm") for r in claims_mod.open_rows(rows)}
    wanted = [a for a in plan.arms if a == BASELINE or a in open_arms] if plan.main else list(plan.arms)
    # per_seed holds whole seeds' seconds: a seed of fewer arms takes fewer rounds of the workers
    share = worker_rounds(plan, len(wanted)) / worker_rounds(plan, len(plan.arms))
    estimate = [x * share for x in per_seed]
    go, why = seed_decision(plan.cfg, seed, rows, trained.spent, estimate) if plan.main else (True, "")
    flags = agree(plan.dist, [go, *(a in wanted for a in plan.arms)])
    go, wanted = flags[0], [a for a, w in zip(plan.arms, flags[1:]) if w]
    if plan.main:
        also = f" (training {', '.join(wanted)})" if go and len(wanted) < len(plan.arms) else ""
        echo(f"normswap study: {'seed ' + str(seed + 1) + ': ' if go else 'stopping: '}{why}{also}")
    if not go:
        trained.stop_reason = why
        return []
    return wanted


def worker_rounds(plan: Plan, units: int) -> int:
    """Rounds of the worker processes ``units`` units take (each worker trains one at a time)."""
    return max(1, math.ceil(units / max(1, plan.workers)))
