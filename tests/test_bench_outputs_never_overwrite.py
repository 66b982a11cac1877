"""A bench's outputs are its own: never written through a planted link (symlink, hard link, FIFO,
another user's file), never over a model it measures; refused in one line before timing starts."""

import json
import os
from pathlib import Path

import pytest

from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 4242
SECRET = "export SECRET=do-not-touch\n"


def _one_line(code, err, *needles):
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, (code, err)
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


def _bench_script(name: str):
    import importlib

    return importlib.import_module(f"normswap.benchmarks.{name}")


# -- case 3: writes through planted links -----------------------------------------------------------


def test_bench_convert_save_replaces_a_planted_link_never_writes_through_it(tmp_path, monkeypatch, run_cli):
    """``--save PREFIX`` used ``write_text``: a link PREFIX.json -> ~/.bashrc overwrote the victim's file.
    The measurement is stood in for (it takes minutes); the writing is the real code."""
    bench = _bench_script("conversion")
    bashrc = tmp_path / "home" / ".bashrc"
    bashrc.parent.mkdir()
    bashrc.write_text(SECRET)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "run.json").symlink_to(bashrc)
    (shared / "run.md").symlink_to(bashrc)
    monkeypatch.setattr(bench, "bench_convert", lambda **kw: {"measured": True})
    monkeypatch.setattr(bench, "markdown", lambda result: "| table |\n")
    code, out, err = run_cli("bench", "convert", "--save", shared / "run")
    assert code == 0 and out == "| table |\n", err
    assert bashrc.read_text() == SECRET
    assert json.loads((shared / "run.json").read_text()) == {"measured": True}
    assert (shared / "run.md").read_text() == "| table |\n"
    assert not (shared / "run.json").is_symlink() and not (shared / "run.md").is_symlink()


def test_bench_convert_save_inside_the_work_directory_is_refused_before_work(tmp_path, run_cli):
    work = tmp_path / "work"
    work.mkdir()
    code, _, err = run_cli("bench", "convert", "--workdir", work, "--save", work / "run", "--params", "30000000")
    _one_line(code, err, "--save", "overlaps the work directory")
    assert list(work.iterdir()) == []


def _jsonlines(path):
    return _bench_script("norm_kernels")._JsonLines(path)


def test_bench_kernels_jsonl_refuses_a_planted_link_and_appends_to_its_own_file(tmp_path):
    bashrc = tmp_path / ".bashrc"
    bashrc.write_text(SECRET)
    link = tmp_path / "cases.jsonl"
    link.symlink_to(bashrc)
    with pytest.raises(NormswapError, match="symbolic link"):
        _jsonlines(link)
    assert bashrc.read_text() == SECRET
    # the control: a file of ours is appended to, line by line, and kept between runs
    own = tmp_path / "own.jsonl"
    for run in range(2):
        log = _jsonlines(own)
        log.write({"run": run, "case": "a"})
        log.write({"run": run, "case": "b"})
    assert [json.loads(line)["case"] for line in own.read_text().splitlines()] == ["a", "b", "a", "b"]


def test_bench_kernels_jsonl_refuses_a_link_swapped_in_between_lines(tmp_path):
    bashrc = tmp_path / ".bashrc"
    bashrc.write_text(SECRET)
    path = tmp_path / "cases.jsonl"
    log = _jsonlines(path)
    log.write({"case": 1})
    path.unlink()
    path.symlink_to(bashrc)
    with pytest.raises(NormswapError, match="symbolic link"):
        log.write({"case": 2})
    assert bashrc.read_text() == SECRET


def test_bench_kernels_jsonl_refuses_a_hard_link_a_fifo_and_another_users_file(tmp_path):
    bashrc = tmp_path / ".bashrc"
    bashrc.write_text(SECRET)
    os.link(bashrc, tmp_path / "hard.jsonl")
    with pytest.raises(NormswapError, match="hard link"):
        _jsonlines(tmp_path / "hard.jsonl")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.jsonl")
        with pytest.raises(NormswapError, match="FIFO"):
            _jsonlines(tmp_path / "fifo.jsonl")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        theirs = tmp_path / "theirs.jsonl"
        theirs.write_text("")
        os.chown(theirs, OTHER_UID, OTHER_UID)
        with pytest.raises(NormswapError, match="belongs to uid"):
            _jsonlines(theirs)
        assert theirs.read_text() == ""
    assert bashrc.read_text() == SECRET


def test_bench_kernels_cli_refuses_a_planted_jsonl_link_before_timing(tmp_path, run_cli):
    bashrc = tmp_path / ".bashrc"
    bashrc.write_text(SECRET)
    (tmp_path / "cases.jsonl").symlink_to(bashrc)
    code, _, err = run_cli("bench", "kernels", "--quick", "--jsonl", tmp_path / "cases.jsonl")
    _one_line(code, err, "--jsonl", "symbolic link")
    assert bashrc.read_text() == SECRET


@pytest.mark.parametrize("option", ["--save", "--out", "--markdown"])  # --out: --save's spelling before
def test_bench_kernels_out_that_is_a_directory_is_one_line_before_timing(tmp_path, run_cli, option):
    (tmp_path / "d").mkdir()
    code, _, err = run_cli("bench", "kernels", "--quick", option, tmp_path / "d")
    _one_line(code, err, "--markdown" if option == "--markdown" else "--save", "is a directory")


# -- case 4: a bench never writes over what it measures --------------------------------------------------


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.normswap.safetensors").write_bytes(b"the converted weights")
    return path


@pytest.mark.parametrize("bench", ["decode", "onnx"])
def test_bench_json_inside_a_model_it_reads_is_refused(tmp_path, run_cli, bench):
    """``bench decode SRC=CONV --json CONV/model.normswap.safetensors`` replaced the converted weights
    with its JSON, exit 0. Refused in one line before any work; the weights are untouched."""
    src, conv = _model_dir(tmp_path / "src"), _model_dir(tmp_path / "conv")
    target = conv / "model.normswap.safetensors"
    for json_out in (target, conv / "results.json", src / "new.json"):
        code, _, err = run_cli("bench", bench, f"{src}={conv}", "--save", json_out)
        _one_line(code, err, "--save", "overlaps the model", "inputs are never modified")
    assert target.read_bytes() == b"the converted weights"
    assert sorted(p.name for p in conv.iterdir()) == ["config.json", "model.normswap.safetensors"]
