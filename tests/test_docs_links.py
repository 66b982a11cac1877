"""Every relative link in README.md and docs/*.md points at a file (and a heading) that exists."""

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
