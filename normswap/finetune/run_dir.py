"""OUT of a fine-tune, as the trainer sees it: the run file, the log, the checkpoints.

    OUT/finetune_run.json      status (running / finished), the options in force, the resumes
    OUT/train_log.jsonl        one JSON row per step (step 0: the held-out loss before training)
    OUT/checkpoints/step-K/    resumable state (see state.py), while the run is unfinished
    OUT/config.json, weights   the final model in convert's format, written last

Only process 0 writes. Every write is atomic (a temporary file or directory renamed into place),
so a kill at any instant leaves complete files only.

OUT is read back (``--resume``), so it is untrusted input like any model directory:
OUT must be ours and writable by nobody else, and no directory on the way to it replaceable by
another user (normswap.private_dirs.open_private_dir); everything inside it is reached through
directory handles with ``O_NOFOLLOW`` (private_dirs' "tree read through handles"): a link planted
at ``checkpoints/``, a ``step-K/`` or any file in them, the log or the run record is refused by
name, never followed, and a file or directory another user can write is never read. Rotation and
clean-up delete only the names this run makes (``step-K``, ``.tmp-step-K``), through the handle
of ``checkpoints/``, so no link can send a delete outside OUT. What normswap creates here has no
group or other write bit whatever the umask, so that it passes the same check when read back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path

from normswap import private_dirs as pd
from normswap.errors import NormswapError
from normswap.finetune.config import LOG_FILE, RUN_FILE
from normswap.overlap import check_disjoint
from normswap.publish import publish_dir, staging_dir

CHECKPOINTS = "checkpoints"
MAX_RUN_BYTES = 16 << 20  # the run record: options, resumes and a summary
_STEP = re.compile(r"step-(\d+)")
_OURS = re.compile(r"\.tmp-step-\d+(-old)?")  # the staging names save_checkpoint makes; nothing else is removed
_NOT_WRITABLE_BY_OTHERS = ~(stat.S_IWGRP | stat.S_IWOTH)


# A train_log.jsonl read back from a model directory someone handed over (eval's loss curve): a row a
# step holds a few numbers, so 256 MiB is over a million steps at 256 bytes a row, far past any healing
# run; a larger file is refused in one line instead of read whole. A row is at most 64 KiB.
MAX_LOG_BYTES = 256 << 20
MAX_LOG_ROW_BYTES = 64 << 10


def read_log_rows(path: Path) -> list[dict]:
    """The rows of a train_log.jsonl; a torn last line (a killed run) and what follows are dropped.
    The file is read by the side-file rule (a regular file inside its model directory, no link out)
    and with bounds: at most :data:`MAX_LOG_BYTES`, each row at most :data:`MAX_LOG_ROW_BYTES`."""
    return list(iter_log_rows(path))


def iter_log_rows(path: Path):
    """The rows of the train_log.jsonl ``path`` one at a time (:func:`read_log_rows`' bounds): only
    one row is ever held as text."""
    from normswap.checkpoint.side_files import open_inside

    path = Path(path)
    f = open_inside(path.parent, path.name, cap=MAX_LOG_BYTES)
    if f is None:
        return
    with f:
        lineno = 0
        while line := f.readline(MAX_LOG_ROW_BYTES + 1):
            lineno += 1
            if len(line) > MAX_LOG_ROW_BYTES and not line.endswith(b"\n"):
                raise NormswapError(
                    f"{path}:{lineno}: a row longer than {MAX_LOG_ROW_BYTES:,} bytes; a training log holds one "
                    "short row a step, so this is not one"
                )
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:
                return  # a torn last line from a kill: everything after it is not trusted


def parse_log_rows(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
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


def check_new_out(cfg) -> None:
    """A fresh run (no --resume) never writes over an OUT that exists unless --force says so;
    cheap (no torch), so the CLI answers it before the trainer's modules load."""
    if not cfg.resume and Path(cfg.out).exists() and not cfg.force:
        raise NormswapError(
            f"{cfg.out} exists: pass --resume to continue the fine-tune in it, or --force to replace it"
        )


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

    # ---- handles: every read, write and delete below goes through one
    @contextlib.contextmanager
    def _out_fd(self):
        """A handle on OUT, which must be ours alone with nothing above it another user can replace."""
        fd = pd.open_private_dir(self.out)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _checkpoints_fd(self, *, create: bool = False):
        """A handle on OUT/checkpoints (made when ``create``), or None when there is none."""
        with self._out_fd() as out_fd:
            try:
                fd = (pd.make_dir_at if create else pd.open_dir_at)(out_fd, CHECKPOINTS, where=self.checkpoints_dir)
            except FileNotFoundError:
                yield None
                return
            try:
                yield fd
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def checkpoint_at(self, name: str):
        """A handle on OUT/checkpoints/``name`` (a checkpoint or its staging directory): refused
        (NotPrivate) when it, or checkpoints/, is a link, or another user can write it."""
        with self._checkpoints_fd() as ck_fd:
            if ck_fd is None:
                raise FileNotFoundError(f"{self.checkpoints_dir} does not exist")
            fd = pd.open_dir_at(ck_fd, name, where=self.checkpoints_dir / name)
            try:
                yield fd
            finally:
                os.close(fd)

    def _read(self, name: str, max_bytes: int | None = MAX_RUN_BYTES) -> str | None:
        """The text of OUT/``name`` read through OUT's handle (at most ``max_bytes``), or None when it is absent."""
        with self._out_fd() as out_fd:
            try:
                fd = pd.open_file_at(out_fd, name, where=self.out / name)
            except FileNotFoundError:
                return None
        with os.fdopen(fd, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise NormswapError(f"{self.out / name}: more than {max_bytes:,} bytes; a fine-tune never writes that much")
        return data.decode("utf-8", errors="replace")

    def _write(self, name: str, text: str) -> None:
        with self._out_fd() as out_fd:
            pd.write_file_at(out_fd, name, text.encode("utf-8"), where=self.out / name)

    def check(self) -> None:
        """Refuse, before any work, a run directory a resume must not read or write: OUT,
        checkpoints/ and the log must be ours alone and no link (the run record was read under
        the same rule); the refusal names the path and why. A checkpoint that fails the rule is
        not refused here: the resume skips it, naming it, like any broken checkpoint."""
        self.checkpoints()
        self.rows()

    # ---- the run file
    def read_run(self) -> dict | None:
        """The recorded run, or None when OUT holds none."""
        if not (self.out.exists() or self.out.is_symlink()):
            return None
        text = self._read(RUN_FILE)
        if text is None:
            return None
        try:
            run = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise NormswapError(f"{self.run_file} is damaged ({e}); use --force to start again") from None
        if not isinstance(run, dict) or not isinstance(run.get("config"), dict):
            raise NormswapError(f"{self.run_file} is not a normswap fine-tune record; use --force to start again")
        return run

    def write_run(self, run: dict) -> None:
        self._write(RUN_FILE, json.dumps(run, indent=2))

    def start(self, run: dict, *, replace: bool) -> None:
        """A fresh run: OUT created (or replaced), the run file written, the log emptied.

        The fresh run directory is built beside OUT and published in one step, so that with
        ``--force`` a kill at any instant leaves either the old OUT or the new run, never neither.
        Without ``replace`` an existing OUT is refused by publish_dir (the CLI refuses it earlier,
        with advice, in resolve_options)."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with staging_dir(self.out) as tmp:
            fresh = RunDir(tmp)
            fresh.checkpoints_dir.mkdir(mode=0o755)
            fresh.write_run(run)
            fresh.reset_log()
            publish_dir(tmp, self.out, force=replace)
            # publish_dir gives a new directory the umask's mode; OUT is read back, so nobody else may write it
            os.chmod(self.out, stat.S_IMODE(os.stat(self.out).st_mode) & _NOT_WRITABLE_BY_OTHERS)

    # ---- the log
    def rows(self) -> list[dict]:
        text = self._read(LOG_FILE, max_bytes=None)  # a row per step: as long as the run
        return parse_log_rows(text) if text else []

    def reset_log(self) -> None:
        self._write(LOG_FILE, "")

    def truncate_log(self, step: int) -> None:
        """Keep the rows up to ``step`` (a resumed run rewrites what came after its checkpoint)."""
        kept = [r for r in self.rows() if r.get("step", 0) <= step]
        self._write(LOG_FILE, "".join(json.dumps(r) + "\n" for r in kept))

    def open_log(self):
        with self._out_fd() as out_fd:
            return os.fdopen(pd.create_file_at(out_fd, LOG_FILE, where=self.log_file, append=True), "a")

    # ---- checkpoints
    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, directory) of every published checkpoint, oldest first. A ``step-K`` that is a
        link is listed too, so that a resume names it as broken (never follows it)."""
        with self._checkpoints_fd() as ck_fd:
            if ck_fd is None:
                return []
            found = [
                (int(m.group(1)), self.checkpoints_dir / e.name)
                for e in pd.list_dir_at(ck_fd)
                if (m := _STEP.fullmatch(e.name)) and (e.is_symlink() or e.is_dir(follow_symlinks=False))
            ]
        return sorted(found)

    def staging_checkpoint(self, step: int) -> Path:
        """A fresh, empty OUT/checkpoints/.tmp-step-K (one a kill left is removed first)."""
        name = f".tmp-step-{step}"
        with self._checkpoints_fd(create=True) as ck_fd:
            pd.remove_tree_at(ck_fd, name, where=self.checkpoints_dir / name)
            os.close(pd.make_dir_at(ck_fd, name, where=self.checkpoints_dir / name))
        return self.checkpoints_dir / name

    def publish_checkpoint(self, tmp: Path, step: int, keep: int) -> Path:
        """Rename the finished staging directory to step-K (an older step-K, one a resume fell back
        past, moved aside first), then remove all but the ``keep`` newest checkpoints."""
        name, aside = f"step-{step}", f".tmp-step-{step}-old"
        with self._checkpoints_fd() as ck_fd:
            pd.remove_tree_at(ck_fd, aside, where=self.checkpoints_dir / aside)
            with contextlib.suppress(FileNotFoundError):
                pd.replace_at(ck_fd, name, aside)
            pd.replace_at(ck_fd, tmp.name, name)
            pd.remove_tree_at(ck_fd, aside, where=self.checkpoints_dir / aside)
            if keep > 0:
                for _, old in self.checkpoints()[:-keep]:
                    self._remove(ck_fd, old.name)
        return self.checkpoints_dir / name

    def _remove(self, ck_fd: int, name: str) -> None:
        """Remove checkpoints/``name`` through its handle; one another user owns (the resume skipped
        it, naming it) is left alone: never this run's to delete."""
        with contextlib.suppress(pd.NotPrivate):
            pd.remove_tree_at(ck_fd, name, where=self.checkpoints_dir / name)

    def drop_checkpoint(self, tmp: Path) -> None:
        with self._checkpoints_fd() as ck_fd:
            if ck_fd is not None:
                pd.remove_tree_at(ck_fd, tmp.name, where=tmp)

    def drop_checkpoints(self) -> None:
        """Remove every checkpoint (and staging directory) of the finished run, then checkpoints/
        itself when nothing else is left in it: what this run did not make stays."""
        with self._checkpoints_fd() as ck_fd:
            if ck_fd is None:
                return
            for e in pd.list_dir_at(ck_fd):
                if _STEP.fullmatch(e.name) or _OURS.fullmatch(e.name):
                    self._remove(ck_fd, e.name)
        with self._out_fd() as out_fd, contextlib.suppress(OSError):  # not empty: the user's files stay
            os.rmdir(CHECKPOINTS, dir_fd=out_fd)

    def remove_leftovers(self) -> None:
        """Staging directories of a checkpoint that a kill interrupted (those of the final write
        beside OUT go when OUT's lock is taken, see normswap.publish). Only the names
        save_checkpoint makes: anything else in checkpoints/ is not this run's to delete."""
        with self._checkpoints_fd() as ck_fd:
            if ck_fd is None:
                return
            for e in pd.list_dir_at(ck_fd):
                if _OURS.fullmatch(e.name):
                    pd.remove_tree_at(ck_fd, e.name, where=self.checkpoints_dir / e.name)

    # ---- the final model
    def check_final_weights(self) -> None:
        """Refuse (one line) a final model in OUT whose weight files are links or writable by
        others, before a finished run is trained further from them: the model loader follows links
        (a hub snapshot is made of them), the run directory may not."""
        with self._out_fd() as out_fd:
            for e in pd.list_dir_at(out_fd):
                if e.name.endswith((".safetensors", ".safetensors.index.json", ".bin")) or e.name == "config.json":
                    os.close(pd.open_file_at(out_fd, e.name, where=self.out / e.name))

    def write_final(self, model, tokenizer, manifest_updates: dict) -> None:
        """Write the model with save_checkpoint into a fresh sibling directory, then move its files
        into OUT (which already holds the log and run file), ``config.json`` last: a loader never
        sees a half-written model, and a kill during the move leaves no config.json, so --resume
        redoes it. The moves go through handles on both directories; a directory in OUT in the
        way is removed through OUT's handle (a link there is removed, never followed)."""
        from normswap.checkpoint.write import save_checkpoint

        with staging_dir(self.out) as tmp:
            staging = save_checkpoint(model, tmp / "final", tokenizer=tokenizer, manifest_updates=manifest_updates)
            names = sorted(p.name for p in staging.iterdir())
            names = [n for n in names if n != "config.json"] + (["config.json"] if "config.json" in names else [])
            src_fd = os.open(staging, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                with self._out_fd() as out_fd:
                    for name in names:
                        if _is_dir_at(out_fd, name):
                            pd.remove_tree_at(out_fd, name, where=self.out / name)
                        os.replace(name, name, src_dir_fd=src_fd, dst_dir_fd=out_fd)
            finally:
                os.close(src_fd)


def _is_dir_at(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in ``dir_fd`` is a real directory (a link to one is not)."""
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False
