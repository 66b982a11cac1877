"""Side files (tokenizer, vocabulary, generation config...) reach OUT only from inside the model directory.

Issue #22, case 5: `vocab.txt -> ~/secret` used to put the secret into OUT. A link that leaves
the model directory is refused with its name, before any work; one that stays inside is
followed and OUT gets a plain copy (normswap/checkpoint/side_files.py says why refuse, not skip).
"""

import os
from pathlib import Path

import pytest
from helpers import tiny_model

from normswap.checkpoint.side_files import copy_side_files, side_files
from normswap.errors import NormswapError

SECRET = "-----BEGIN PRIVATE KEY----- not for OUT\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "gpt2"
    tiny_model("gpt2", n_layer=1, n_embd=32, vocab_size=64).save_pretrained(path)
    return path


def _copy_model(model_dir: Path, dest: Path) -> Path:
    dest.mkdir()
    for p in model_dir.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def _tree_text(path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in path.rglob("*") if p.is_file())


def test_a_link_out_of_the_model_directory_is_refused_by_name(tmp_path, model_dir, run_cli):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    src = _copy_model(model_dir, tmp_path / "src")
    (src / "vocab.txt").symlink_to(secret)
    out = tmp_path / "out"

    code, _, err = run_cli("convert", src, out, "--no-verify")

    assert code == 2
    lines = err.strip().splitlines()
    assert (
        len(lines) == 1 and "vocab.txt is a symbolic link" in lines[0] and "outside the model directory" in lines[0]
    ), err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no lock or staging left
    assert secret.read_text() == SECRET


def test_a_link_inside_the_model_directory_is_followed_and_copied(tmp_path, model_dir, run_cli):
    src = _copy_model(model_dir, tmp_path / "src")
    (src / "shared").mkdir()
    (src / "shared" / "vocab.txt").write_text("hello\nworld\n")
    (src / "vocab.txt").symlink_to(Path("shared") / "vocab.txt")
    out = tmp_path / "out"

    code, _, err = run_cli("convert", src, out, "--no-verify")

    assert code == 0, err
    assert (out / "vocab.txt").read_text() == "hello\nworld\n"
    assert not (out / "vocab.txt").is_symlink()


def test_the_copy_itself_refuses_a_link_out_even_when_nothing_checked_first(tmp_path, model_dir):
    """copy_side_files is the last guard (a model directory that never went through resolve)."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    src = _copy_model(model_dir, tmp_path / "src")
    (src / "tokenizer.json").symlink_to(secret)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(NormswapError, match="tokenizer.json is a symbolic link"):
        copy_side_files(src, dest)
    assert SECRET not in _tree_text(dest)


def test_a_hub_cache_snapshot_may_link_into_its_blobs(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"vocab": 1}')
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "vocab.json").symlink_to(Path("..") / ".." / "blobs" / "abc123")
    assert [name for name, _ in side_files(snap)] == ["vocab.json"]
    # the same layout outside a repository folder is an ordinary directory: the link leaves it
    (tmp_path / "plain" / "snapshots").mkdir(parents=True)
    (tmp_path / "plain" / "blobs").mkdir()
    (tmp_path / "plain" / "blobs" / "abc123").write_text("{}")
    odd = tmp_path / "plain" / "snapshots" / "rev1"
    odd.mkdir()
    (odd / "vocab.json").symlink_to(Path("..") / ".." / "blobs" / "abc123")
    with pytest.raises(NormswapError, match="outside the model directory"):
        side_files(odd)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_side_file_that_is_not_a_regular_file_is_refused(tmp_path, model_dir, run_cli):
    src = _copy_model(model_dir, tmp_path / "src")
    os.mkfifo(src / "merges.txt")  # reading it would block forever
    code, _, err = run_cli("convert", src, tmp_path / "out", "--no-verify")
    assert code == 2 and "merges.txt is not a regular file" in err, err
