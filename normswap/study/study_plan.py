"""What a study will do (``Plan``, fixed before DIR changes) and what its training left (``Trained``):
the records the stages of study/runner.py hand each other."""

from __future__ import annotations

import dataclasses

from normswap.study.config import StudyConfig
from normswap.study.persistence.study_dir import StudyDir
from normswap.study.training.interleaved import Dist


@dataclasses.dataclass
class Plan:
    """What the study will do, fixed before DIR changes (stage 1: ``plan_study``)."""

    cfg: StudyConfig
    study: StudyDir
    recorded: dict | None
    source: object
    arms: list[str]
    notes: list[str]
    n_params: int
    norms_replaced: int
    dist: Dist
    data: dict
    baselines: dict
    kernel_setup: dict
    workers: int

    @property
    def main(self) -> bool:
        return self.dist.rank == 0


@dataclasses.dataclass
class Trained:
    """What training left (stage 2: ``train_units``)."""

    units: dict
    seeds_done: list[int]
    mults: list[float]
    stop_reason: str | None = None
    spent: float = 0.0
    stab_units: dict | None = None
