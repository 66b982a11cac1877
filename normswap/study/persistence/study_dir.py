"""DIR of a study: its run file, one file per finished unit, then results.json and the report.

A unit is one arm × seed × learning-rate multiplier. Its file is written (atomically) the moment it
finishes or diverges, so a study stopped at any point keeps every finished unit; ``--resume`` runs
only the others (interleaved.py: a group of fewer arms computes exactly what the whole group would).
DIR is never another command's input: it may not overlap MODEL or the data, and a directory that
is not a study (a model, anything else that is not empty) is refused even with ``--force``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from normswap import bounded_load
from normswap.errors import NormswapError
from normswap.overlap import check_disjoint
from normswap.private_dirs import why_not_private
from normswap.publish import atomic_write_json
from normswap.study.config import RESULTS_FILE, RUN_FILE, UNITS_DIR, flag, option_errors, options

RUN_KIND = "normswap-study"
# DIR's files are read back on --resume: regular files inside DIR only (a planted link is refused,
# never followed), at most this large (a unit holds a few numbers per step and layer).
MAX_RUN_BYTES = 1 << 20
MAX_UNIT_BYTES = 256 << 20


def unit_key(arm: str, seed: int, multiplier: float) -> str:
    return f"seed{seed}-x{multiplier:g}-{arm}"


def _what_it_holds(out: Path) -> str:
    names = sorted(p.name for p in out.iterdir())
    if "config.json" in names:
        return "a model (config.json)"
    if "finetune_run.json" in names:
        return "a fine-tune run"
    if "run.json" in names:
        return "a recipe run"
    return f"{len(names)} other file(s), e.g. {names[0]}"


class StudyDir:
    def __init__(self, out):
        self.out = Path(out).expanduser()
        self.run_file = self.out / RUN_FILE
        self.units = self.out / UNITS_DIR
        self.results_file = self.out / RESULTS_FILE

    def read_run(self) -> dict | None:
        run = _read_json(self.run_file, "a study's run file", MAX_RUN_BYTES)
        return run if isinstance(run, dict) and run.get("kind") == RUN_KIND else None

    def check(self, *, reads: list, resume: bool, force: bool) -> dict | None:
        """Refuse a DIR that would lose or mix something; return the recorded run of a ``--resume``."""
        check_disjoint(reads, [(f"DIR {self.out}", self.out)], advice="choose another DIR")
        if self.out.exists() and not self.out.is_dir():
            raise NormswapError(f"DIR {self.out} exists and is not a directory")
        for d in (self.out, self.units):  # one that exists must be ours alone: nobody else plants links in it
            why = why_not_private(d) if d.exists() or d.is_symlink() else None
            if why:
                raise NormswapError(
                    f"DIR {self.out}: {why}; a study writes only into a directory that is yours alone "
                    "(choose another DIR, or fix its owner and mode)"
                )
        run = self.read_run() if self.out.is_dir() else None
        if self.out.is_dir() and run is None and any(self.out.iterdir()):
            raise NormswapError(
                f"DIR {self.out} is not a normswap study (it holds {_what_it_holds(self.out)}): "
                "nothing there is replaced; choose another DIR"
            )
        if resume:
            if run is None:
                raise NormswapError(f"cannot resume: {self.out} holds no study (start it without --resume)")
            return run
        if run is not None and not force:
            raise NormswapError(
                f"{self.out} holds a study: pass --resume to continue it (finished units are kept) "
                "or --force to start again"
            )
        return None

    def start(self, record: dict, *, replace: bool) -> None:
        if replace and self.out.exists():
            shutil.rmtree(self.out)
        self.units.mkdir(parents=True, exist_ok=True)
        self.write_run(dict(record, kind=RUN_KIND))

    def write_run(self, record: dict) -> None:
        atomic_write_json(self.run_file, record)

    def unit_file(self, key: str) -> Path:
        return self.units / f"{key}.json"

    def read_unit(self, key: str) -> dict | None:
        rec = _read_json(self.unit_file(key), "a study's unit file", MAX_UNIT_BYTES)
        return rec if isinstance(rec, dict) and rec.get("status") in ("finished", "diverged") else None

    def write_unit(self, key: str, record: dict) -> None:
        atomic_write_json(self.unit_file(key), record)


def _read_json(path: Path, what: str, max_bytes: int):
    """A JSON file of DIR, or None when it is absent or not valid JSON (cut short: it is written again).
    A link, a FIFO, a device or an oversized file is refused in one line, never read."""
    if not (path.exists() or path.is_symlink()):
        return None
    # links, FIFOs and devices are bounded_load's to refuse; a regular file must be ours alone
    if path.is_file() and not path.is_symlink():
        why = why_not_private(path, kind="file")
        if why:
            raise NormswapError(
                f"refusing {what} {path}: {why} — a study reads back only what you alone could have written "
                "(remove it, or start again with --force)"
            )
    try:
        return bounded_load.load_json(path, what=what, max_bytes=max_bytes)
    except bounded_load.BoundedLoadError as e:
        if e.syntax is not None:
            return None
        raise


def resolve_resume(cfg, recorded, given: set[str] | None, where="study_run.json"):
    """The options in force for a ``--resume``: the recorded ones, validated like the command line's
    (the file may have been edited); an option typed again must match."""
    import dataclasses

    if not isinstance(recorded, dict):
        raise NormswapError(f"cannot resume: {where} records no options (it is damaged); start again with --force")
    recorded = {f.name: recorded[f.name] for f in options() if f.metadata["resume"] != "free" and f.name in recorded}
    problems = [f"{flag(n)} {why}" for n, why in option_errors(recorded)]
    if problems:
        raise NormswapError(
            f"cannot resume: {where} records " + "; ".join(problems) + " (the file was edited or damaged: "
            "fix it, or start again with --force)"
        )
    mine = dataclasses.asdict(cfg)
    given = given if given is not None else set()
    merged, mismatches = dict(mine), []
    for f in options():
        if f.metadata["resume"] == "free" or f.name not in recorded:
            continue
        merged[f.name] = recorded[f.name]
        if f.name in given and mine[f.name] != recorded[f.name]:
            mismatches.append(f"{flag(f.name)} is {mine[f.name]!r} but the study used {recorded[f.name]!r}")
    if mismatches:
        raise NormswapError(
            "cannot resume: " + "; ".join(mismatches) + " (--resume takes the recorded options: give none, or the same)"
        )
    return type(cfg)(**merged)
