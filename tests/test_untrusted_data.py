"""Data that is not text gets a clear answer (issue #29, case 13): `--data` naming a FIFO or a device
says what it is (it used to say "no such file or directory", and a FIFO read would block), and
`eval ppl` on a file of NUL bytes reports an infinite word perplexity instead of ending in
`OverflowError: math range error`. Controls: a regular text file evaluates to finite numbers."""

from __future__ import annotations

import os

import pytest

from normswap.data import load_documents
from normswap.errors import NormswapError


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_data_that_is_a_fifo_or_a_device_is_named(tmp_path, run_cli, kind):
    if kind == "fifo":
        path, said = tmp_path / "corpus.txt", "is a FIFO (named pipe)"
        os.mkfifo(path)
    else:
        path, said = "/dev/zero", "is a character device"
    with pytest.raises(NormswapError, match=f"the data {path} {said.replace('(', '[(]').replace(')', '[)]')}"):
        next(iter(load_documents(str(path))))
    code, _, err = run_cli("eval", "ppl", "normswap:kjv-gpt2", "--data", path, "--quiet")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and said in lines[0] and "no such file" not in lines[0], err


def test_perplexity_of_nul_bytes_is_infinite_word_perplexity_not_an_overflow(tmp_path, run_cli):
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"\0" * 20_000)
    code, out, err = run_cli("eval", "ppl", "normswap:kjv-gpt2", "--data", nul, "--quiet", "--max-tokens", "512")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("kjv-gpt2"))
    assert row.split()[3] == "inf"  # word ppl: the whole file is one "word"
    text = tmp_path / "text.txt"  # the control: real text, every number finite
    text.write_text("In the beginning God created the heaven and the earth. " * 200)
    code, out, err = run_cli("eval", "ppl", "normswap:kjv-gpt2", "--data", text, "--quiet", "--max-tokens", "512")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("kjv-gpt2"))
    assert all(float(v) < 1e9 for v in row.split()[1:4])
