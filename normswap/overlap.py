"""One rule for every command: what it writes or deletes never touches what it reads.

A command lists the local paths it reads (models, teachers, data files and directories, eval
sets, recipes, family files) and the paths it writes or deletes (OUT, which ``--force`` replaces
whole; the parts of a run directory a recipe writes), and calls ``check_disjoint`` before any
work: before a model loads, before OUT's lock file is made, before anything is deleted.

Two paths overlap when they are the same, or one lies inside the other, in either direction:
writing into a model directory modifies the model, and replacing a directory deletes everything
inside it. Each path is compared in two forms, so that symlinks cannot hide an overlap:

- as named, with only its parent directories resolved: a symlink that lies inside OUT is deleted
  with OUT (its target is not, but the command's later reads through that name fail);
- fully resolved: a symlink to the data means the data is where it points.

Both forms resolve symlinks *before* ``..`` is applied, as the operating system does: with
``work/ln -> models/sub``, ``work/ln/../src`` is ``models/src``, not ``work/src`` (which
``os.path.abspath`` would make of it by dropping ``ln/..`` as text).

Specs that are not local paths (``embedded``, a hub id, a missing path) read nothing here and are
skipped; the command refuses them later with its own message.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from normswap.errors import NormswapError


def local_path(spec) -> Path | None:
    """The local file or directory ``spec`` names, or None when it names none."""
    if spec is None or str(spec) in ("", "embedded"):
        return None
    spec = str(spec)
    from normswap.assets.models import SPEC_PREFIX, model_path

    if spec.startswith(SPEC_PREFIX):  # a model shipped in the package
        try:
            return Path(model_path(spec))
        except NormswapError:
            return None
    path = Path(spec).expanduser()
    return path if path.exists() or path.is_symlink() else None


def _forms(path: Path) -> set[Path]:
    """The path as named (parents resolved) and fully resolved; ``..`` only after symlinks (realpath)."""
    text = os.path.expanduser(os.fspath(path))
    full = Path(os.path.realpath(text))
    head, name = os.path.split(text.rstrip("/") or text)
    if name in ("", ".", ".."):  # the root, or a name that is no entry of its own
        return {full}
    return {Path(os.path.realpath(head or ".")) / name, full}


def _nested(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def overlaps(a, b) -> bool:
    """Whether writing or deleting one of the paths would touch the other (see the module doc)."""
    return any(_nested(x, y) for x in _forms(Path(a)) for y in _forms(Path(b)))


def check_disjoint(
    reads: Iterable, writes: Iterable[tuple[str, object]], *, advice: str = "choose another OUT"
) -> None:
    """Refuse, in one line, a write that would touch a read.

    ``reads``: ``(label, spec)`` pairs such as ``("the data", "D/corpus.txt")``, or bare specs;
    specs that name no local path are skipped. ``writes``: ``(label, path)`` pairs such as
    ``("OUT D", "D")``, the label naming the path as the user gave it.
    """
    pairs = [r if isinstance(r, tuple) else ("", r) for r in reads]
    read_paths = [(label, spec, p) for label, spec in pairs if (p := local_path(spec)) is not None]
    for wlabel, w in writes:
        if w is None:
            continue
        for rlabel, spec, path in read_paths:
            if overlaps(w, path):
                what = f"{rlabel} {spec}" if rlabel else str(spec)
                raise NormswapError(
                    f"{wlabel} overlaps {what}, which this command reads: "
                    f"inputs are never modified or deleted; {advice}"
                )


__all__ = ["check_disjoint", "local_path", "overlaps"]
