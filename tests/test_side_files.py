"""Side files (tokenizer, vocabulary, generation config...) reach OUT only from inside the model directory.

Issue #22, case 5: `vocab.txt -> ~/secret` used to put the secret into OUT. A link that leaves
the model directory is refused with its name, before any work; one that stays inside is
followed and OUT gets a plain copy (normswap/checkpoint/side_files.py says why refuse, not skip).
"""

import os
import re
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
    assert code == 2 and "merges.txt is a FIFO (named pipe), not a regular file" in err, err


# -- issue #45, case 2: every file transformers itself reads from a model directory -------------------


def _kjv_copy(dest: Path) -> Path:
    """A shipped model with a real tokenizer, copied (the chat-template cases need one to load)."""
    from normswap.assets.models import model_path

    dest.mkdir()
    for p in Path(model_path("kjv-gpt2")).iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_a_linked_additional_chat_template_is_refused_and_never_published(tmp_path, run_cli):
    """transformers reads every ``additional_chat_templates/*.jinja``, following links, and
    ``finetune`` saved the tokenizer into OUT: a link to a secret was published. Now the model is
    refused by name before any work, by every command (finetune and convert here)."""
    secret = tmp_path / "id_rsa"
    secret.write_text(SECRET)
    src = _kjv_copy(tmp_path / "src")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").symlink_to(secret)
    for command in (["finetune", src, tmp_path / "ft", "--steps", "1"], ["convert", src, tmp_path / "cv"]):
        code, _, err = run_cli(*command)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert "additional_chat_templates/tool_use.jinja is a symbolic link" in lines[0], err
    assert not (tmp_path / "ft").exists() and not (tmp_path / "cv").exists()
    from normswap import load_tokenizer

    with pytest.raises(NormswapError, match="outside the model directory"):
        load_tokenizer(src)  # never read either
    assert secret.read_text() == SECRET


def test_an_additional_chat_template_inside_is_carried(tmp_path, run_cli):
    """The control: a regular template (and one linked inside) reaches OUT as a plain file."""
    src = _kjv_copy(tmp_path / "src")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    (src / "additional_chat_templates" / "again.jinja").symlink_to("tool_use.jinja")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", src, out, "--no-verify")
    assert code == 0, err
    for name in ("tool_use.jinja", "again.jinja"):
        copied = out / "additional_chat_templates" / name
        assert copied.read_text() == "{{ messages }}" and not copied.is_symlink()


@pytest.mark.parametrize(
    "name", ["tokenizer.4.0.0.json", "spm_custom.model", "audio_tokenizer_config.json", "qwen.tiktoken"]
)
def test_names_transformers_finds_by_pattern_are_checked(tmp_path, model_dir, name):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    src = _copy_model(model_dir, tmp_path / "src")
    (src / name).symlink_to(secret)
    with pytest.raises(NormswapError, match=f"{re.escape(name)} is a symbolic link"):
        side_files(src)


def test_a_sub_tokenizer_folder_is_checked(tmp_path, model_dir):
    """A processor loads extra tokenizers from a folder named after them (``decoder_tokenizer/``)."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    src = _copy_model(model_dir, tmp_path / "src")
    (src / "decoder_tokenizer").mkdir()
    (src / "decoder_tokenizer" / "tokenizer_config.json").write_text("{}")
    (src / "decoder_tokenizer" / "vocab.json").symlink_to(secret)
    with pytest.raises(NormswapError, match="decoder_tokenizer/vocab.json is a symbolic link"):
        side_files(src)


def test_fast_tokenizer_files_must_name_files_in_the_model_directory(tmp_path, model_dir):
    src = _copy_model(model_dir, tmp_path / "src")
    (src / "tokenizer_config.json").write_text('{"fast_tokenizer_files": ["../../elsewhere/tokenizer.1.json"]}')
    with pytest.raises(NormswapError, match="fast_tokenizer_files"):
        side_files(src)


def _transformers_reads() -> tuple[set, set]:
    """(file names, folder names) the installed transformers opens in a model directory on its own:
    the file-name constants of its loaders, and every tokenizer class's vocab_files_names (read from
    its source, so no tokenizer module needs importing)."""
    import ast

    import transformers
    from transformers import tokenization_utils_base, utils
    from transformers.utils import hub

    files, folders = set(), {hub.CHAT_TEMPLATE_DIR}
    not_side = {utils.WEIGHTS_NAME, utils.WEIGHTS_INDEX_NAME, utils.SAFE_WEIGHTS_NAME}
    not_side |= {utils.SAFE_WEIGHTS_INDEX_NAME, utils.MODEL_CARD_NAME}
    for module in (utils, tokenization_utils_base, hub):
        for key, value in vars(module).items():
            if key == "TRANSFORMERS_DYNAMIC_MODULE_NAME":  # the cache package remote code is imported as
                continue
            if key.isupper() and key.endswith(("_NAME", "_FILE")) and isinstance(value, str) and value not in not_side:
                files.add(value)
    for path in Path(transformers.__file__).parent.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "VOCAB_FILES_NAMES" not in text and "vocab_files_names" not in text:
            continue
        tree = ast.parse(text)
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Dict):
                continue
            if not any(getattr(t, "id", getattr(t, "attr", "")) in ("VOCAB_FILES_NAMES", "vocab_files_names")
                       for t in node.targets):  # fmt: skip
                continue
            for v in node.value.values:
                value = v.value if isinstance(v, ast.Constant) else consts.get(getattr(v, "id", None))
                if isinstance(value, str):
                    files.add(value)
    return files, folders


def test_every_file_the_installed_transformers_reads_is_a_side_file():
    """A transformers that starts reading a new name from model directories fails here, so the rule
    learns it before a link of that name can carry a secret into OUT."""
    from normswap.checkpoint.side_files import SIDE_DIRS, is_side_name

    files, folders = _transformers_reads()
    assert len(files) > 30  # the derivation found the tokenizers' vocabularies, not only the constants
    missed = sorted(name for name in files if not is_side_name(name))
    assert not missed, f"transformers reads these from a model directory; add them to SIDE_FILES: {missed}"
    assert folders <= set(SIDE_DIRS)
