"""A --data directory's links are not followed out of it (issue #57, case 6).

A link in a shared corpus directory to a file in a private directory was read as training or
evaluation text. The link rule of model directories now holds for data directories
(normswap/dir_links.py): a link that stays inside is followed, one that leaves is refused in one line
naming it, before anything is read -- also a link to a directory, a link in a saved dataset, and a
file swapped for a link after the directory was walked.
"""

import os

import pytest

from normswap.data import load_documents
from normswap.errors import NormswapError

SECRET = "the victim's private diary, never training text"


@pytest.fixture
def shared(tmp_path):
    """A corpus directory with one verse file, and a private directory beside it holding a secret."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "diary.txt").write_text(SECRET + "\n")
    corpus = tmp_path / "corpus"
    (corpus / "books").mkdir(parents=True)
    (corpus / "books" / "genesis.txt").write_text("In the beginning God created the heaven and the earth.\n")
    return corpus, private


def _text(corpus) -> str:
    return "\n".join(load_documents(str(corpus), "all"))


def test_a_link_to_a_private_file_is_refused_by_name(shared):
    corpus, private = shared
    assert "In the beginning" in _text(corpus)  # the control: the corpus as it is reads
    (corpus / "books" / "notes.txt").symlink_to(private / "diary.txt")
    with pytest.raises(NormswapError, match=r"notes.txt is a symbolic link to .*diary.txt, outside the data directory"):
        _text(corpus)


def test_a_link_to_a_private_directory_is_refused(shared):
    corpus, private = shared
    (corpus / "more").symlink_to(private, target_is_directory=True)
    with pytest.raises(NormswapError, match=r"more is a symbolic link to .*private, outside the data directory"):
        _text(corpus)


def test_a_link_that_stays_inside_is_followed(shared):
    corpus, _ = shared
    (corpus / "again.txt").symlink_to(corpus / "books" / "genesis.txt")
    assert _text(corpus).count("In the beginning") == 2  # the control of the rule: inside is read


def test_a_saved_dataset_with_a_link_out_is_refused(shared, tmp_path):
    import datasets

    corpus, private = shared
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["a verse"]}).save_to_disk(str(saved))
    assert "a verse" in _text(saved)  # the control
    (saved / "extra.arrow").symlink_to(private / "diary.txt")
    with pytest.raises(NormswapError, match="extra.arrow is a symbolic link"):
        _text(saved)


def test_a_file_swapped_for_a_link_after_the_walk_is_refused(shared, monkeypatch):
    """The opened file is checked where it really is: a swap between the walk and the read is caught."""
    from normswap import dir_links

    corpus, private = shared
    walk = dir_links.files_inside

    def walk_then_swap(directory, **kw):
        found = walk(directory, **kw)
        victim = corpus / "books" / "genesis.txt"
        os.unlink(victim)
        victim.symlink_to(private / "diary.txt")
        return found

    monkeypatch.setattr(dir_links, "files_inside", walk_then_swap)
    with pytest.raises(NormswapError, match="genesis.txt is a symbolic link to .*diary.txt"):
        _text(corpus)


def test_eval_refuses_the_linked_corpus_in_one_line(shared, run_cli):
    corpus, private = shared
    (corpus / "notes.txt").symlink_to(private / "diary.txt")
    code, _, err = run_cli("eval", "ppl", "normswap:kjv-gpt2", "--data", corpus, "--quiet")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "outside the data directory" in lines[0], err
