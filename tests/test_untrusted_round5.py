"""Untrusted input, round 5 (issue #45): the benches' outputs, reads with no bound, weight files
whose sizes lie, and options read back on resume. Compile caches: tests/test_compile_cache.py; side
files transformers reads on its own: tests/test_side_files.py.

"Another user" is simulated with ownership (tests run as root in CI: ``os.chown`` to another uid)
and with modes; a check that needs that is skipped, with the reason, where it is impossible.
"""

import json
import os
from pathlib import Path

import pytest

from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 4242
SECRET = "export SECRET=do-not-touch\n"
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="another user's file needs chown (root)"
)
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


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


def test_bench_convert_save_replaces_a_planted_link_never_writes_through_it(tmp_path, monkeypatch):
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
    assert bench.main(["--save", str(shared / "run")]) == 0
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


@pytest.mark.parametrize("option", ["--out", "--markdown"])
def test_bench_kernels_out_that_is_a_directory_is_one_line_before_timing(tmp_path, run_cli, option):
    (tmp_path / "d").mkdir()
    code, _, err = run_cli("bench", "kernels", "--quick", option, tmp_path / "d")
    _one_line(code, err, option, "is a directory")


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
        code, _, err = run_cli("bench", bench, f"{src}={conv}", "--json", json_out)
        _one_line(code, err, "--json", "overlaps the model", "inputs are never modified")
    assert target.read_bytes() == b"the converted weights"
    assert sorted(p.name for p in conv.iterdir()) == ["config.json", "model.normswap.safetensors"]


# -- case 5: reads with no bound, or no file-type check ---------------------------------------------------

CAP = 4 << 30  # the address-space cap: each refusal below must come well within it


def _normswap(*args, timeout: int = 60) -> tuple[int, str]:
    """``python -m normswap ARGS`` in a child under a 4 GB address-space cap and a 1 GB file-size cap,
    with a timeout: a read that blocks (a FIFO) or allocates without bound fails the test instead of
    hanging it or the machine."""
    import resource
    import subprocess
    import sys

    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        r = subprocess.run(
            [sys.executable, "-m", "normswap", *map(str, args)],
            env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=limits,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"normswap {' '.join(map(str, args))} did not answer in {timeout} s (a blocking read?)")
    return r.returncode, r.stderr


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


# -- softer cases ---------------------------------------------------------------------------------------------


def test_report_md_escapes_raw_html_from_results_json_as_report_html_does(tmp_path, run_cli):
    demo = json.loads((ROOT / "docs" / "demo" / "results.json").read_text())
    payload = "<img src=x onerror=alert(1)>"
    old = demo["models"][0]["name"]
    text = json.dumps(demo).replace(json.dumps(old), json.dumps(old + payload))
    (tmp_path / "results.json").write_text(text)
    code, _, err = run_cli("eval", "render", tmp_path / "results.json")
    assert code == 0, err
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt;" in md
    assert "<img src=x" not in page  # what report.html already did


def _finished_run(tmp_path, run_cli) -> Path:
    from normswap.finetune.config import RUN_FILE

    out = tmp_path / "ft"
    code, _, err = run_cli(
        "finetune",
        "normswap:kjv-gpt2",
        out,
        "--steps",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--warmup-steps",
        "0",
    )
    assert code == 0, err
    return out / RUN_FILE


@pytest.mark.parametrize(
    "key,value,said",
    [("steps", -3, "steps must be >= 1, got -3"), ("batch_size", "8", "batch_size must be a whole number, got '8'")],
)
def test_resume_revalidates_the_stored_options(tmp_path, run_cli, key, value, said):
    """A stored ``steps: -3`` published a model, exit 0; ``batch_size: "8"`` ended in a TypeError line."""
    run_file = _finished_run(tmp_path, run_cli)
    record = json.loads(run_file.read_text())
    record["config"][key] = value
    record["status"] = "running"
    run_file.write_text(json.dumps(record))
    before = sorted(str(p) for p in run_file.parent.rglob("*"))
    code, _, err = run_cli("finetune", "normswap:kjv-gpt2", run_file.parent, "--resume")
    _one_line(code, err, "the options recorded in finetune_run.json are not valid", said)
    assert sorted(str(p) for p in run_file.parent.rglob("*")) == before


@pytest.mark.parametrize(
    "option,value", [("--batch-size", "100000000"), ("--steps", "1000000000000"), ("--eval-tokens", "1000000000")]
)
def test_every_count_option_has_an_upper_bound(tmp_path, run_cli, option, value):
    code, _, err = run_cli("finetune", "normswap:kjv-gpt2", tmp_path / "ft", option, value)
    _one_line(code, err, option, "must be <=")
    assert not (tmp_path / "ft").exists()


def test_every_count_option_is_declared_with_a_maximum():
    from normswap.finetune.config import options

    counts = [f.name for f in options() if f.metadata["kind"] == "int" and f.name != "seed"]
    assert counts and all(f.metadata["maximum"] is not None for f in options() if f.name in counts), counts


def test_a_batch_whose_logits_cannot_fit_is_refused_before_the_model_loads(tmp_path, run_cli, monkeypatch):
    """Within the declared bound but beyond the memory: refused in one line, before any allocation
    (the memory available is pinned to 1 GiB so the test means the same on every machine)."""
    import normswap.devices

    monkeypatch.setattr(normswap.devices, "available_memory", lambda device="cpu": 1 << 30)
    code, _, err = run_cli("finetune", "normswap:kjv-gpt2", tmp_path / "ft", "--batch-size", "65536", "--seq-len", "64")
    errors = [line for line in err.strip().splitlines() if not line.startswith("normswap finetune:")]
    assert code == 2 and len(errors) == 1 and "one micro-batch's logits (65,536 × 64 × " in errors[0], err
    assert "1.0 GiB of memory is available" in errors[0] and "lower --batch-size" in errors[0]
    assert not (tmp_path / "ft").exists()


def test_sigterm_ends_a_command_with_one_line(tmp_path):
    """SIGTERM unwinds (staging removed, lock released) and says so in one line."""
    import signal
    import subprocess
    import sys
    import time

    fifo_free_wait = "import time, sys; from normswap.cli.main import main; sys.argv=['normswap']; "
    code = (
        fifo_free_wait
        + "import normswap.cli.main as m; m._exit_cleanly_on_sigterm(); print('ready', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM and err.strip() == "normswap: stopped by SIGTERM", err
