"""Every relative link in README.md and docs/*.md points at a file (and a heading) that exists."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to -."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken_links(page: Path) -> list[str]:
    """The links in ``page`` whose file (or ``#heading`` in a markdown file) does not exist."""
    broken, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        for target in [] if fenced else LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title here\n\n## Second `part`: x\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n[ok](docs/a.md) [ok](docs/a.md#second-part-x) [ok](#top) [web](https://x.org/y)\n"
        "```\n[in code](nowhere.md)\n```\n"
        "[bad](docs/b.md) [bad heading](docs/a.md#third)\n"
    )
    assert broken_links(page) == ["README.md: docs/b.md (no such file)", "README.md: docs/a.md#third (no such heading)"]


# -- every path a page or a docstring names exists -------------------------------------------------

# a repository path: one of the tree's top folders, then path characters; one followed by a pattern
# character (results/decode-*/, results/gpu-<stamp>/, results/decode-…) or with an upper-case
# placeholder part (models/NAME/) names a family of paths, not one
PATH = re.compile(r"(?<![\w./~$-])((?:normswap|docs|bench|results|tests|scripts)/[\w./-]*+)(?![*<{$\[…])")
OUTSIDE = re.compile(r"\.\./shared/|/work/shared/")


def named_paths(text: str) -> list[str]:
    return [m.group(1).rstrip(".-") for m in PATH.finditer(text)]


def exists(root: Path, name: str) -> bool:
    """``name`` is a file or folder, a placeholder pattern, or the SAVE prefix of files beside it
    (``--save results/<run>/convert`` writes convert.json and convert.md)."""
    path = root / name
    if path.exists() or any(part.isupper() for part in name.split("/")):
        return True
    return path.parent.is_dir() and any(c.name.startswith(path.name + ".") for c in path.parent.iterdir())


def docstrings(source: str) -> list[str]:
    return [
        doc
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        for doc in [ast.get_docstring(node, clean=False)]
        if doc
    ]


def missing_paths(root: Path, skip=()) -> list[str]:
    """'where: path' for each path named in README.md, bench/README.md, docs/*.md or a docstring of
    normswap/, tests/, bench/ or scripts/ that does not exist, or that lies outside the repository."""
    texts = [(p, [p.read_text(encoding="utf-8")]) for p in pages_under(root)]
    for pattern in ("normswap/**/*.py", "tests/*.py", "bench/*.py", "scripts/*.py"):
        for p in sorted(root.glob(pattern)):
            rel = p.relative_to(root).as_posix()
            if not any(rel.startswith(s) for s in skip):
                texts.append((p, docstrings(p.read_text(encoding="utf-8"))))
    found = []
    for page, parts in texts:
        where = page.relative_to(root).as_posix()
        for text in parts:
            found += [f"{where}: {n}" for n in named_paths(text) if not exists(root, n)]
            found += [f"{where}: {m.group(0)}... (outside the repository)" for m in OUTSIDE.finditer(text)]
    return sorted(set(found))


def pages_under(root: Path) -> list[Path]:
    found = [root / "README.md", root / "bench" / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [p for p in found if p.exists()]


def test_every_named_path_exists():
    missing = missing_paths(ROOT)
    assert not missing, "paths named in docs or docstrings that do not exist:\n" + "\n".join(missing)


def test_a_missing_path_is_caught(tmp_path):
    # negative control: a page naming a file that is not there, a docstring naming a gone module and
    # a path outside the repository are each reported; patterns, placeholders and SAVE prefixes are not
    (tmp_path / "docs").mkdir()
    (tmp_path / "normswap").mkdir()
    (tmp_path / "results" / "run-20261201T0000Z").mkdir(parents=True)
    (tmp_path / "results" / "run-20261201T0000Z" / "convert.json").write_text("{}")
    (tmp_path / "normswap" / "a.py").write_text('"""Reads normswap/gone.py and ../shared/probe.py."""\n')
    (tmp_path / "README.md").write_text(
        "See docs/missing.md, normswap/a.py, results/run-*/, results/gpu-<stamp>/, normswap/models/NAME/,\n"
        "`--save results/run-20261201T0000Z/convert`, results/run-20261201T0000Z/.\n"
    )
    assert missing_paths(tmp_path) == [
        "README.md: docs/missing.md",
        "normswap/a.py: ../shared/... (outside the repository)",
        "normswap/a.py: normswap/gone.py",
    ]


# -- the Python API page names what exists ---------------------------------------------------------

API_NAME = re.compile(r"`(normswap(?:\.\w+)+)")


def unimportable(names: list[str]) -> list[str]:
    """The dotted names that do not resolve: the longest importable module prefix, then attributes."""
    import importlib

    bad = []
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                bad.append(name)
            break
        else:
            bad.append(name)
    return bad


def test_every_name_on_the_api_page_imports():
    names = sorted(set(API_NAME.findall((ROOT / "docs" / "api.md").read_text(encoding="utf-8"))))
    assert len(names) >= 15, names  # the page's names were found
    assert unimportable(names) == []
    # negative control: the top-level convert_model the convert page once named, and a gone module
    assert unimportable(["normswap.convert_model", "normswap.nowhere.f", "normswap.convert.convert_model"]) == [
        "normswap.convert_model",
        "normswap.nowhere.f",
    ]
