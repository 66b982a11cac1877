"""Text files are read and tokenised in bounded pieces (issue #22, case 8): memory does not depend
on the longest line, and files whose lines are ordinary give exactly the documents - and so the
token stream - they gave when a file was read whole."""

from __future__ import annotations

import random
import re
import tracemalloc

import pytest

from normswap.data import load_documents, load_text, pack_tokens, sources
from normswap.errors import NormswapError


def _whole_file_documents(text: str, chunk_chars: int = 4000) -> list[str]:
    """The documents of a text file as normswap made them when it read files whole (the reference)."""

    def line_runs(para):
        buf, size = [], 0
        for line in para.split("\n"):
            buf.append(line)
            size += len(line) + 1
            if size >= chunk_chars:
                yield "\n".join(buf)
                buf, size = [], 0
        if buf:
            yield "\n".join(buf)

    docs, buf, size = [], [], 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if len(para) > 2 * chunk_chars and "\n" in para:
            if buf:
                docs.append("\n\n".join(buf))
                buf, size = [], 0
            docs.extend(line_runs(para))
            continue
        buf.append(para)
        size += len(para)
        if size >= chunk_chars:
            docs.append("\n\n".join(buf))
            buf, size = [], 0
    if buf:
        docs.append("\n\n".join(buf))
    return docs


def _ordinary_texts():
    """The embedded corpus as a file, a verse-per-line file, and random texts with every kind of
    paragraph break (whitespace-only lines, CRLF, form feeds, runs of blank lines) and non-ASCII."""
    book = load_text("embedded", "train")[:200_000]
    yield book
    yield book.replace("\n\n", "\n")  # no blank lines: one long paragraph cut into runs of lines
    rng = random.Random(0)
    words = book.split(" ")
    breaks = ["\n", "\n", "\n \n", "\r\n", "\r\n\r\n", "\t\n", "\n\n\n", " é中 ", "\u2028", "\x0c\n", " "]
    for _ in range(12):
        yield "".join(
            rng.choice(breaks) if rng.random() < 0.4 else " ".join(rng.choices(words, k=rng.randint(1, 300)))
            for _ in range(rng.randint(1, 300))
        )


@pytest.mark.parametrize("read_bytes", [5, 4096, 1 << 20])  # characters and lines cut by block ends, or not
def test_ordinary_files_give_the_documents_of_the_whole_file_reader(tmp_path, monkeypatch, read_bytes):
    monkeypatch.setattr(sources, "READ_BYTES", read_bytes)
    path = tmp_path / "t.txt"
    for text in _ordinary_texts():
        path.write_bytes(text.encode("utf-8"))
        assert max(len(line) for line in text.split("\n")) <= sources.LONG_LINE_CHARS
        assert list(load_documents(str(path), "all")) == _whole_file_documents(text)
        if read_bytes == 4096:
            for chunk in (1, 50):  # the grouping rules at other sizes
                assert list(sources._chunk_text(sources._text_lines(path, chunk), chunk)) == _whole_file_documents(
                    text, chunk
                )


def test_ordinary_file_gives_the_same_token_stream(tmp_path):
    import normswap

    tok = normswap.load_tokenizer("normswap:kjv-gpt2")
    text = next(_ordinary_texts())
    path = tmp_path / "book.txt"
    path.write_text(text)
    new = [b.tolist() for b in pack_tokens(tok, load_documents(str(path), "all"), 64)]
    old = [b.tolist() for b in pack_tokens(tok, _whole_file_documents(text), 64)]
    assert new == old and len(new) > 100


def _one_line_file(tmp_path, chars: int):
    line = " ".join(load_text("embedded", "train").split())
    path = tmp_path / "one-line.txt"
    with open(path, "w") as f:
        written = 0
        while written < chars:
            f.write(line + " ")
            written += len(line) + 1
    return path


def test_a_one_line_file_is_read_and_tokenised_in_bounded_pieces(tmp_path):
    import normswap

    path = _one_line_file(tmp_path, 16_000_000)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        lengths = [len(d) for d in load_documents(str(path), "all")]  # streamed: nothing kept but lengths
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a few blocks in memory, never the line (read whole, the file took twice its size: bytes and text)
    assert peak < 8 * 2**20 < size / 2, (peak, size)  # 8 blocks of 1 MiB (sources.READ_BYTES)
    assert max(lengths) <= 2 * sources.TEXT_CHUNK_CHARS and len(lengths) > 3000
    # the hash split spreads the line's pieces over every split (whole, it was one document: refused)
    assert all(any(True for _ in load_documents(str(path), s)) for s in ("train", "validation", "test"))
    # no word is lost or cut: the pieces put back together are the line
    assert " ".join(d for d in load_documents(str(path), "all")) == " ".join(path.read_text().split())

    tok = normswap.load_tokenizer("normswap:kjv-gpt2")
    seen = []

    class Spy:  # the tokenizer, recording how many characters each call is given
        eos_token_id = tok.eos_token_id

        def __call__(self, texts, **kw):
            seen.append(max(map(len, texts)))
            return tok(texts, **kw)

    blocks = pack_tokens(Spy(), load_documents(str(path), "train"), 128)
    for _ in range(50):
        next(blocks)
    assert seen and max(seen) <= 2 * sources.TEXT_CHUNK_CHARS


def test_undecodable_bytes_are_placed_across_block_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "READ_BYTES", 3)
    path = tmp_path / "bad.txt"
    path.write_bytes("ab\né中\n\nxy".encode() + b"\xff" + b"z\n")
    with pytest.raises(NormswapError, match=r"bad.txt:4: not UTF-8 text \(invalid start byte at byte 12\)"):
        list(load_documents(str(path), "all"))
    path.write_bytes("ab\n中".encode()[:-1])  # a character cut by the end of the file
    with pytest.raises(NormswapError, match=r"bad.txt:2: not UTF-8 text \(unexpected end of data at byte 3\)"):
        list(load_documents(str(path), "all"))


def test_evaluation_text_reads_only_what_the_token_cap_reaches(tmp_path):
    """The held-out text of `normswap eval` is truncate_text's cut of the whole split, but only the
    documents the cap reaches are kept and tokenised (the whole split was joined and tokenised)."""
    import normswap
    from normswap.evaluate.perplexity import held_out_text, truncate_text

    tok = normswap.load_tokenizer("normswap:kjv-gpt2")
    whole = load_text("embedded", "test")
    for cap in (50, 1000, 20_000, 0, 10**9):
        want_text, want_cut = truncate_text(whole, tok, cap)
        assert held_out_text(load_documents("embedded", "test"), tok, cap) == (want_text, want_cut, len(whole))
    seen = []

    class Spy:  # the tokenizer, counting the characters it is given
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, texts, **kw):
            seen.append(sum(map(len, [texts] if isinstance(texts, str) else texts)))
            return tok(texts, **kw)

    path = _one_line_file(tmp_path, 4_000_000)
    text, cut, available = held_out_text(load_documents(str(path), "all"), Spy(), 2000)
    assert cut and available > 3_900_000 and len(text) < 20_000
    assert sum(seen) < 100_000  # the tokenizer saw a few documents, not the 4 MB split
