"""OUT of a fine-tune, as the trainer sees it: the run file, the log, the checkpoints.

    OUT/finetune_run.json      status (running / finished), the options in force, the resumes
    OUT/train_log.jsonl        one JSON row per step (step 0: the held-out loss before training)
    OUT/checkpoints/step-K/    resumable state (see state.py), while the run is unfinished
    OUT/config.json, weights   the final model in convert's format, written last

Only process 0 writes. Every write is atomic (normswap.publish: a temporary file or directory
renamed into place), so a kill at any instant leaves complete files only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from normswap.errors import NormswapError
from normswap.finetune.config import LOG_FILE, RUN_FILE
from normswap.overlap import check_disjoint
from normswap.publish import atomic_write_text, publish_dir, staging_dir

CHECKPOINTS = "checkpoints"


def read_log_rows(path: Path) -> list[dict]:
    """The rows of a train_log.jsonl; a torn last line (a killed run) and what follows are dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a kill: everything after it is not trusted
    return rows


# What a fine-tune reads, by option name (what a refusal calls it).
READS = {"model": "the model", "distill_from": "the teacher", "data": "the data", "eval_data": "the held-out data"}


def check_out_overlap(cfg) -> None:
    """Refuse an OUT that overlaps anything the fine-tune reads (normswap.overlap), before any work.

    ``cfg``: a FinetuneConfig as given; for ``--resume`` the inputs recorded in OUT count too (they
    are the ones the run will read)."""
    recorded = {}
    if cfg.resume:
        try:
            recorded = (RunDir(cfg.out).read_run() or {}).get("config", {})
        except NormswapError:
            recorded = {}  # a damaged run file: resolve_options says so
    reads = [
        (label, spec) for name, label in READS.items() for spec in {getattr(cfg, name), recorded.get(name)} if spec
    ]
    check_disjoint(reads, [(f"OUT {cfg.out}", cfg.out)])


class RunDir:
    def __init__(self, out):
        self.out = Path(out)
        self.run_file = self.out / RUN_FILE
        self.log_file = self.out / LOG_FILE
        self.checkpoints_dir = self.out / CHECKPOINTS

    # ---- the run file
    def read_run(self) -> dict | None:
        """The recorded run, or None when OUT holds none."""
        if not self.run_file.is_file():
            return None
        try:
            run = json.loads(self.run_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise NormswapError(f"{self.run_file} is damaged ({e}); use --force to start again") from None
        if not isinstance(run, dict) or not isinstance(run.get("config"), dict):
            raise NormswapError(f"{self.run_file} is not a normswap fine-tune record; use --force to start again")
        return run

    def write_run(self, run: dict) -> None:
        atomic_write_text(self.run_file, json.dumps(run, indent=2))

    def start(self, run: dict, *, replace: bool) -> None:
        """A fresh run: OUT created (or replaced), the run file written, the log emptied.

        The fresh run directory is built beside OUT and published in one step, so that with
        ``--force`` a kill at any instant leaves either the old OUT or the new run, never neither.
        Without ``replace`` an existing OUT is refused by publish_dir (the CLI refuses it earlier,
        with advice, in resolve_options)."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with staging_dir(self.out) as tmp:
            fresh = RunDir(tmp)
            fresh.checkpoints_dir.mkdir()
            fresh.write_run(run)
            fresh.log_file.write_text("")
            publish_dir(tmp, self.out, force=replace)

    # ---- the log
    def rows(self) -> list[dict]:
        return read_log_rows(self.log_file)

    def truncate_log(self, step: int) -> None:
        """Keep the rows up to ``step`` (a resumed run rewrites what came after its checkpoint)."""
        kept = [r for r in self.rows() if r.get("step", 0) <= step]
        atomic_write_text(self.log_file, "".join(json.dumps(r) + "\n" for r in kept))

    def open_log(self):
        return open(self.log_file, "a")

    # ---- checkpoints
    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, directory) of every published checkpoint, oldest first."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = [
            (int(p.name[5:]), p)
            for p in self.checkpoints_dir.iterdir()
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()
        ]
        return sorted(found)

    def staging_checkpoint(self, step: int) -> Path:
        tmp = self.checkpoints_dir / f".tmp-step-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def publish_checkpoint(self, tmp: Path, step: int, keep: int) -> Path:
        final = publish_dir(tmp, self.checkpoints_dir / f"step-{step}", force=True)
        if keep > 0:
            for _, old in self.checkpoints()[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def drop_checkpoint(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def drop_checkpoints(self) -> None:
        shutil.rmtree(self.checkpoints_dir, ignore_errors=True)

    def remove_leftovers(self) -> None:
        """Staging directories of a checkpoint that a kill interrupted (those of the final write
        beside OUT go when OUT's lock is taken, see normswap.publish)."""
        for p in self.checkpoints_dir.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)

    # ---- the final model
    def write_final(self, model, tokenizer, manifest_updates: dict) -> None:
        """Write the model with save_checkpoint into a fresh sibling directory, then move its files
        into OUT (which already holds the log and run file), ``config.json`` last: a loader never
        sees a half-written model, and a kill during the move leaves no config.json, so --resume
        redoes it."""
        from normswap.checkpoint.write import save_checkpoint

        with staging_dir(self.out) as tmp:
            staging = save_checkpoint(model, tmp / "final", tokenizer=tokenizer, manifest_updates=manifest_updates)
            names = sorted(p.name for p in staging.iterdir())
            for name in [n for n in names if n != "config.json"] + (["config.json"] if "config.json" in names else []):
                dest = self.out / name
                if dest.is_dir():
                    shutil.rmtree(dest)
                os.replace(staging / name, dest)
