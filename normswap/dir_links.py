"""The link rule for a directory normswap walks that someone else may have filled (a ``--data`` corpus
directory, a saved dataset): what is read from it lies inside it.

A model directory has the rule already (``checkpoint/side_files.py``): a link that stays inside is
followed, one that leaves is refused by name, never skipped. A data directory is the same kind of
input -- a shared corpus folder any user may add to -- and a link in it to a file in a private
directory (``notes.txt -> /home/victim/private/diary.txt``) was read as training or evaluation text,
its words carried into a fine-tuned model and its perplexity into a report. Here:

* :func:`files_inside` walks the directory without following a link to a directory, and refuses, in one
  line naming it, any link (to a file or to a directory) whose target lies outside the directory;
* :func:`check_opened` checks an opened file where it really is (``/proc/self/fd``), so a link swapped in
  between the walk and the read is refused too.

The other walks in normswap read directories it made itself (OUT, staging, study and run
directories, checked by their own owners' rules) or its own package files.
"""

from __future__ import annotations

import os
from pathlib import Path

from normswap.errors import NormswapError


def _refuse(path: Path, real: Path, root: Path, what: str) -> NormswapError:
    return NormswapError(
        f"{path} is a symbolic link to {real}, outside {what} {root}: normswap reads nothing from outside the "
        "directory it was given; copy the file in instead of linking it (or remove the link); nothing was read"
    )


def files_inside(directory, *, what: str = "the data directory") -> list[Path]:
    """Every file below ``directory`` (links that stay inside included, as the path inside), sorted;
    refuses a link whose target leaves ``directory``. Links to directories are checked, not descended
    into (their files are reached by their own path inside, or are outside)."""
    directory = Path(directory)
    root = directory.resolve()
    found = []
    for here, dirs, files in os.walk(directory, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            p = Path(here) / name
            if p.is_symlink():
                real = p.resolve()
                if not real.is_relative_to(root):
                    raise _refuse(p, real, root, what)
        found += [Path(here) / name for name in files if (Path(here) / name).is_file()]
    return sorted(found)


def check_opened(fd: int, path: Path, root: Path, *, what: str = "the data directory") -> None:
    """The opened file ``fd`` (named ``path``) lies inside ``root`` (already resolved)."""
    if not os.path.isdir("/proc/self/fd"):
        return
    real = Path(os.path.realpath(f"/proc/self/fd/{fd}"))
    if not real.is_relative_to(root):
        raise _refuse(path, real, root, what)
