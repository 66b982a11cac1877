"""Reads of untrusted files are bounded and type-checked (no /dev/zero, FIFO or 20 GB record read
without end), and sizes a weight file declares must be backed by its bytes (a .bin of expanded views
is refused before anything allocates).

"Another user" is simulated with ownership and modes; a check that needs it is skipped where impossible.
"""

import json
import os
from pathlib import Path

import pytest
from helpers import normswap_capped

from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def _normswap(*args) -> tuple[int, str]:
    return normswap_capped(*args, timeout=60)


# -- case 5: reads with no bound, or no file-type check ---------------------------------------------------


def _kjv_copy(dest: Path) -> Path:
    from normswap.assets.models import model_path

    dest.mkdir()
    for p in Path(model_path("kjv-gpt2")).iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def _errors(err: str) -> list:
    """The error lines (progress lines start with the command's name)."""
    return [line for line in err.strip().splitlines() if not line.startswith("normswap convert:")]


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_modules_json_that_is_no_regular_file_is_one_line(tmp_path, kind):
    """``MODEL/modules.json`` was read by every command that opens a model, before the side-file rule:
    linked to /dev/zero it read until MemoryError, a FIFO never answered."""
    src = _kjv_copy(tmp_path / "src")
    if kind == "dev-zero":
        (src / "modules.json").symlink_to("/dev/zero")
    elif hasattr(os, "mkfifo"):
        os.mkfifo(src / "modules.json")
    else:
        pytest.skip("no FIFOs here")
    code, err = _normswap("convert", src, tmp_path / "out", "--no-verify")
    lines = _errors(err)
    assert code == 2 and len(lines) == 1 and "modules.json" in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_eval_render_results_json_that_is_no_regular_file_is_one_line(tmp_path, kind):
    results = tmp_path / "results.json"
    if kind == "dev-zero":
        results.symlink_to("/dev/zero")
    elif hasattr(os, "mkfifo"):
        os.mkfifo(results)
    else:
        pytest.skip("no FIFOs here")
    code, err = _normswap("eval", "render", results)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "not a regular file" in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def _sparse(path: Path, head: bytes, size: int = 20 << 30) -> Path:
    """A file of ``size`` bytes that takes no disk: ``head``, then a hole (zeros) to the end."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


@pytest.mark.parametrize(
    "name,head,needle",
    [
        ("one.jsonl", b'{"text": "', "a line longer than"),
        ("one.json", b'[{"text": "', "element 0 is longer than"),
        ("one.json", b'   \n [ "', "element 0 is longer than"),
    ],
)
def test_a_20_gb_record_is_refused_within_the_per_record_cap(tmp_path, name, head, needle):
    """``--data one.jsonl`` of one 20 GB line, or a ``[``-led one.json, ran into MemoryError (round 2
    bounded only .txt): each record is now held only up to bounded_load.MAX_RECORD_BYTES."""
    from normswap.data.sources import load_documents

    data = _sparse(tmp_path / name, head)
    with pytest.raises(NormswapError, match=needle):
        next(load_documents(str(data), "all"))
    if name == "one.jsonl":  # the same through a command, under the 4 GB address-space cap
        code, err = _normswap("eval", "ppl", "normswap:kjv-gpt2", "--data", data, "--split", "all")
        lines = err.strip().splitlines()
        assert code != 0 and needle in lines[-1] and "Traceback" not in err, err


def test_records_of_a_json_array_are_streamed_one_at_a_time(tmp_path):
    """The control: a streamed array gives the records a whole-file parse gives, delimiters in any place."""
    from normswap.bounded_load import json_array

    records = [{"text": "a" * 3000, "n": i} for i in range(500)] + ["plain", {"text": "ünï\ncode"}]
    path = tmp_path / "d.json"
    path.write_text("\n [" + " ,\n".join(json.dumps(r) for r in records) + "\n]\n")
    assert [v for _, v in json_array(path, max_record=5000)] == records
    path.write_text('[{"text": "x"} {"text": "y"}]')
    with pytest.raises(NormswapError, match="expected ',' or ']'"):
        list(json_array(path))
    path.write_text('[{"text": "x"}, ')
    with pytest.raises(NormswapError, match="ends before"):
        list(json_array(path))


@needs_fifo
def test_a_fifo_in_place_of_pytorch_model_bin_is_refused_not_waited_on(tmp_path):
    src = _kjv_copy(tmp_path / "src")
    (src / "model.safetensors").unlink()
    os.mkfifo(src / "pytorch_model.bin")
    code, err = _normswap("convert", src, tmp_path / "out")
    lines = _errors(err)
    assert code == 2 and len(lines) == 1, err
    assert "pytorch_model.bin is a FIFO (named pipe), not a regular file" in lines[0], err


# -- case 6: a size bomb the size check missed --------------------------------------------------------------


def _bomb(directory: Path, **sizes) -> Path:
    """A GPT-2 whose ``pytorch_model.bin`` holds, for every weight, an expanded view (stride 0) of one
    float: the shapes match the config exactly, the file is ~50 KB."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    directory.mkdir()
    config = GPT2Config(**sizes)
    config.save_pretrained(directory)
    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in GPT2LMHeadModel(config).state_dict().items()}
    one = torch.zeros(1)
    state = {k: one.expand(*shape) for k, shape in shapes.items() if k != "lm_head.weight"}
    torch.save(state, directory / "pytorch_model.bin")
    return directory


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_a_bin_of_expanded_views_declaring_3_3b_parameters_is_refused_before_anything_allocates(tmp_path, command):
    """13 GB declared in ~50 KB: convert wrote 13 GB before failing, finetune allocated it. Under a 4 GB
    address-space cap both now refuse in one line, naming the tensor and the bytes it really has."""
    bomb = _bomb(tmp_path / "bomb", n_embd=2560, n_layer=40, n_head=32)
    assert (bomb / "pytorch_model.bin").stat().st_size < 100_000
    extra = ["--steps", "1", "--seq-len", "16"] if command == "finetune" else []
    code, err = _normswap(command, bomb, tmp_path / "out", *extra)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "transformer.wte.weight declares shape [50257, 2560]" in line, err
    assert "over 4 bytes stored" in line and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_overlapping_views_are_refused_and_tied_weights_pass(tmp_path):
    """Views that each fit their storage but overlap one another declare more than the file holds;
    the same view saved under two names (tied weights) is one tensor's bytes, and passes."""
    import torch

    from normswap.checkpoint.tensor_source import check_backed

    base = torch.arange(100, dtype=torch.float32)
    check_backed({"wte": base, "lm_head": base}, "tied")  # the control
    with pytest.raises(NormswapError, match="800 bytes over 400 bytes stored"):
        check_backed({"a": base, "b": base.view(10, 10)}, "overlap")
    with pytest.raises(NormswapError, match="over 4 bytes stored"):
        check_backed({"a": torch.zeros(1).expand(10, 10)}, "expanded")
