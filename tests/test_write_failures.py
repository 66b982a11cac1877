"""Known OS and format failures end in one line with the path and what to do, and leave nothing behind.

Issue #22, case 9: a full disk, a read-only destination, OUT = `.` with --force (a busy rename,
once found only after the whole conversion), a mount point as OUT, a corrupt parquet file and a
.jsonl record nested 100k deep each used to end in a raw OSError / RecursionError. Where the
machine allows it (root, tmpfs) the disk really is full or read-only; the errno is also injected
at the writer so the check runs everywhere.
"""

import contextlib
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import tiny_model

from normswap.data import load_documents
from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "gpt2"
    tiny_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=512).save_pretrained(path)
    return path


@contextlib.contextmanager
def _tmpfs(where: Path, *options):
    """A real small file system at ``where`` (root only); skips the test where none can be mounted."""
    where.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True, check=False
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _left(parent: Path, name: str = "out") -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((name, f".{name}")))


def _one_line(code, err, *needles, progress_before=False):
    """Exactly one error line holding ``needles``; with ``progress_before`` the work had started
    (its progress lines come first), else the refusal is all there is."""
    assert code == 2, err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("normswap: error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), err
    assert progress_before or len(lines) == 1, err
    return errors[0]


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, src, run_cli):
    with _tmpfs(tmp_path / "small", "size=256k") as disk:
        code, _, err = run_cli("convert", src, disk / "out", "--no-verify")
        line = _one_line(code, err, "No space left on device", "free some space", progress_before=True)
        assert str(disk / "out") in line
        assert _left(disk) == []  # no OUT, no staging directory, no lock
        assert os.statvfs(disk).f_bfree == os.statvfs(disk).f_blocks  # every byte given back


def test_a_full_disk_injected_at_the_writer(tmp_path, src, run_cli, monkeypatch):
    """The same on any machine: the shard writer's pwrite fails with ENOSPC half-way through."""
    from normswap.checkpoint import shards

    calls = []
    real = os.pwrite

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(shards.os, "pwrite", failing)
    code, _, err = run_cli("convert", src, tmp_path / "out", "--no-verify")
    _one_line(
        code,
        err,
        "cannot write OUT",
        str(tmp_path / "out"),
        "No space left on device",
        "free some space",
        progress_before=True,
    )
    assert _left(tmp_path) == []
    monkeypatch.undo()  # the control: with room to write, the same command publishes OUT
    code, _, err = run_cli("convert", src, tmp_path / "out", "--no-verify")
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


def test_a_read_only_destination_is_refused_before_any_work(tmp_path, src, run_cli):
    with _tmpfs(tmp_path / "ro", "size=1m", "ro") as disk:
        code, _, err = run_cli("convert", src, disk / "out", "--no-verify")
        _one_line(code, err, f"cannot write in {disk}", "read-only", "choose an OUT")
        assert _left(disk) == []


def test_out_dot_with_force_is_refused_before_the_conversion(tmp_path, src, run_cli, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the user's files\n")
    monkeypatch.chdir(work)
    code, _, err = run_cli("convert", src, ".", "--force", "--no-verify")
    _one_line(code, err, "current directory", "give a new directory as OUT")
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    code, _, err = run_cli("convert", src, "..", "--force", "--no-verify")  # a directory holding the current one
    _one_line(code, err, "current directory or holds it")
    # the control: a new directory under the current one is converted into
    code, _, err = run_cli("convert", src, "converted", "--no-verify")
    assert code == 0, err
    assert sorted(p.name for p in work.iterdir()) == ["converted", "notes.txt"]
    # and a directory a command only writes into (a recipe's run directory) may be the current one
    from normswap.publish import output_lock

    with output_lock(".", replaced_whole=False) as locked:
        assert locked == work.resolve()
    with pytest.raises(NormswapError, match="current directory"), output_lock("."):
        pass


def test_a_mount_point_as_out_is_refused_before_the_conversion(tmp_path, src, run_cli):
    with _tmpfs(tmp_path / "mnt", "size=1m") as mnt:
        (mnt / "old.txt").write_text("x")
        code, _, err = run_cli("convert", src, mnt, "--force", "--no-verify")
        _one_line(code, err, "is a mount point", "directory inside it")
        assert sorted(p.name for p in mnt.iterdir()) == ["old.txt"]
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mnt")] == []


def test_a_corrupt_parquet_file_is_named(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": [f"line {i} " * 50 for i in range(2000)]}), path, compression="snappy")
    assert sum(1 for _ in load_documents(str(path), "train")) > 0  # the control: the intact file reads
    raw = bytearray(path.read_bytes())
    for i in range(200, len(raw) // 2, 7):  # scramble the compressed pages, keep the footer
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises(NormswapError) as e:
        list(load_documents(str(path), "train"))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_jsonl_nested_100k_deep_is_one_line(tmp_path, run_cli):
    path = tmp_path / "corpus.jsonl"
    good = "".join(json.dumps({"text": f"In the beginning {i} was the word."}) + "\n" for i in range(40))
    path.write_text(good + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(NormswapError, match=r"corpus.jsonl:41: JSON nested too deeply"):
        list(load_documents(str(path), "train"))
    code, _, err = run_cli("eval", "ppl", "normswap:kjv-gpt2", "--data", path, "--max-tokens", "256", "--quiet")
    _one_line(code, err, "corpus.jsonl:41", "nested too deeply")
    path.write_text(good)  # the control: the same corpus without the deep record is evaluated
    code, out, err = run_cli(
        "eval", "ppl", "normswap:kjv-gpt2", "--data", path, "--max-tokens", "256", "--quiet", "--json"
    )
    assert code == 0, err


def test_an_os_error_no_step_anticipated_is_still_one_line_with_its_path(tmp_path, src, run_cli, monkeypatch, capsys):
    """main()'s net: an OSError about the machine that escapes every command is one line with the
    path and advice, exit 2; any other exception keeps the bug report line (exit 1)."""
    from normswap.cli.main import main
    from normswap.convert import pipeline

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "out" / "x"))

    monkeypatch.setattr(pipeline, "convert_checkpoint", read_only)
    code, _, err = run_cli("convert", src, tmp_path / "out")
    _one_line(code, err, str(tmp_path / "out" / "x"), "Read-only file system", "choose an OUT on a writable disk")

    def bug(*args, **kwargs):
        raise OSError(errno.ENOEXEC, os.strerror(errno.ENOEXEC))

    monkeypatch.setattr(pipeline, "convert_checkpoint", bug)
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(tmp_path / "out")])
    assert e.value.code == 1 and "rerun with --debug" in capsys.readouterr().err
