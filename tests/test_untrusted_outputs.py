"""Issue #29 (untrusted inputs, third round): what normswap writes never replaces an input, never
carries a file that data names or links to, and never removes what is not its own.

Each test runs the attack through the real CLI (or the function the CLI calls) and a control: the
same command on safe input still works.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from normswap.assets.models import model_path


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _one_error_line(code, err, *needles) -> str:
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def model(tmp_path):
    """A private copy of the shipped kjv-gpt2 (a real trained GPT-2 with its tokenizer)."""
    path = tmp_path / "M"
    shutil.copytree(model_path("kjv-gpt2"), path)
    return path


# ------------------------------------------------------------------------------------ case 8
@pytest.fixture
def saved_rows(tmp_path):
    """Rows as `families survey --save` writes them (a few of the committed survey's)."""
    from normswap.architectures.survey import shipped_rows

    path = tmp_path / "rows.json"
    path.write_text(json.dumps(shipped_rows()[:3], indent=1) + "\n")
    return path


def test_families_discover_never_writes_over_the_model(tmp_path, model, run_cli):
    weights = model / "model.safetensors"
    before = _sha(weights)
    code, _, err = run_cli("families", "discover", model, "--family-file", weights)
    _one_error_line(code, err, "overlaps the model", "which this command reads")
    # --out FILE: the spelling before #58, still accepted
    code, _, err = run_cli("families", "discover", model, "--out", model / "family.yaml", "--force")
    _one_error_line(code, err, "overlaps the model")
    assert _sha(weights) == before and not (model / "family.yaml").exists()
    # an existing file is replaced only with --force, and the refusal comes before discovery runs
    taken = tmp_path / "taken.yaml"
    taken.write_text("mine\n")
    code, _, err = run_cli("families", "discover", model, "--family-file", taken)
    _one_error_line(code, err, "already exists; pass --force")
    assert taken.read_text() == "mine\n"
    # the control: with --force it is replaced, atomically, by the checked family file
    code, _, err = run_cli("families", "discover", model / "config.json", "--family-file", taken, "--force")
    assert code == 0, err
    assert "exact on a tiny randomised instance" in err and taken.read_text().startswith("# Discovered by")


@pytest.mark.parametrize("command", ["survey", "matrix"])
def test_families_tables_never_write_over_their_saved_rows(tmp_path, saved_rows, run_cli, command):
    rows = saved_rows
    if command == "matrix":
        rows = tmp_path / "m.json"
        rows.write_text(json.dumps({"rows": [], "meta": {}}))
    before = _sha(rows)
    for flag in ("--markdown", "--save", "--out", "--save-json"):  # the last two: the spellings before #58
        code, _, err = run_cli("families", command, "--from-json", rows, flag, rows, "--force")
        _one_error_line(code, err, "overlaps the saved rows")
        assert _sha(rows) == before
    table = tmp_path / "table.md"
    table.write_text("mine\n")
    code, _, err = run_cli("families", command, "--from-json", rows, "--markdown", table)
    _one_error_line(code, err, f"--markdown {table} already exists; pass --force")
    assert table.read_text() == "mine\n"
    if command == "survey":  # the control: the table from the saved rows, with --force
        code, stdout, _ = run_cli("families", command, "--from-json", rows)
        assert code == 0 and "|" in stdout
        code, _, err = run_cli("families", command, "--from-json", rows, "--markdown", table, "--force")
        assert code == 0, err
        assert table.read_text() == stdout and _sha(rows) == before


# ----------------------------------------------------------------------------------- case 12
OTHER_UID = 4242  # another local user (a test run as root can give files away with os.chown)
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="planting another user's files needs root"
)


@needs_root
def test_another_users_leftover_names_are_left_alone_and_never_block(tmp_path, run_cli):
    """In a shared sticky directory another user plants a staging-style name and a lock file beside the
    user's OUT: neither can be removed by the user (sticky), and neither may stop the command, be deleted,
    or be 'restored' as OUT. They are named in one line; the report is written."""
    shared = tmp_path / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted_dir = shared / ".report.normswap-staging-999999-aaaa"
    planted_dir.mkdir()
    (planted_dir / "results.json").write_text("{}")
    (planted_dir / ".normswap-complete").write_text("")  # would be 'restored' as OUT if trusted
    planted_file = shared / ".report.normswap-staging-999998-bbbb"
    planted_file.write_text("theirs")
    lock = shared / ".report.normswap.lock"
    lock.write_text("theirs")
    for p in (planted_dir / "results.json", planted_dir / ".normswap-complete", planted_dir, planted_file, lock):
        os.chown(p, OTHER_UID, OTHER_UID)

    out = shared / "report"
    from normswap.publish import atomic_write_text, output_lock, publish_dir, staging_dir

    said = []
    with output_lock(out, say=said.append):
        with staging_dir(out) as tmp:
            atomic_write_text(tmp / "report.md", "# ours\n")
            publish_dir(tmp, out, force=False)
    assert (out / "report.md").read_text() == "# ours\n"
    assert planted_dir.is_dir() and (planted_dir / "results.json").read_text() == "{}"
    assert planted_file.read_text() == "theirs" and lock.read_text() == "theirs"
    assert len(said) == 2, said
    assert ".report.normswap.lock" in said[0] and f"uid {OTHER_UID}" in said[0]
    assert planted_dir.name in said[1] and planted_file.name in said[1] and f"uid {OTHER_UID}" in said[1]
    assert not [p for p in shared.iterdir() if p.name.startswith(".report.normswap.lock-")]  # our lock went away

    # through the CLI: no "choose a directory you can write", exit 0
    code, _, err = run_cli("eval", "render", _received(tmp_path / "received"), "--out", out, "--force")
    assert code == 0, err
    assert "directory you can write" not in err and "left alone" in err
    assert planted_dir.is_dir() and planted_file.exists() and lock.exists()


@needs_root
def test_our_own_leftovers_are_still_cleaned_up(tmp_path):
    """The control: a staging directory of a dead run of ours is removed, and said."""
    from normswap.publish import output_lock

    out = tmp_path / "report"
    ours = tmp_path / ".report.normswap-staging-999999-cccc"
    ours.mkdir()
    said = []
    with output_lock(out, say=said.append):
        pass
    assert not ours.exists() and len(said) == 1 and "removed 1 leftover staging directory" in said[0]


# ------------------------------------------------------------------------------- cases 2 and 4
SECRET = {"auths": {"registry.example": {"auth": "c2VjcmV0LXRva2Vu"}}}  # what ~/.docker/config.json holds


def _nowhere_but(root: Path, secret: Path) -> None:
    """The secret's bytes are in no file under ``root`` except the secret itself."""
    needle = SECRET["auths"]["registry.example"]["auth"].encode()
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and p != secret:
            assert needle not in p.read_bytes(), p


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "home" / ".docker" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(SECRET))
    return path


@pytest.mark.parametrize(
    "command",
    [
        ["export", "{M}", "{OUT}", "--format", "stock"],
        ["export", "{M}", "{OUT}", "--format", "onnx"],
        ["finetune", "{M}", "{OUT}", "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--no-progress"],
        ["convert", "{M}", "{OUT}"],
    ],
    ids=["export-stock", "export-onnx", "finetune", "convert"],
)
def test_a_linked_manifest_is_refused_before_any_work(tmp_path, model, secret, run_cli, command):
    """Case 2: the checkpoint's normswap_manifest.json is a link to the user's credentials; every command
    that republishes a manifest refuses the model in one line naming the link, and OUT never exists."""
    (model / "normswap_manifest.json").symlink_to(secret)
    out = tmp_path / "out"
    code, _, err = run_cli(*[a.replace("{M}", str(model)).replace("{OUT}", str(out)) for a in command])
    _one_error_line(code, err, "normswap_manifest.json is a symbolic link to", "outside the model directory")
    assert not out.exists()
    _nowhere_but(tmp_path, secret)


def test_the_manifest_is_read_only_as_a_file_inside_the_model(tmp_path, model, secret):
    """The same rule where the manifest is read (export, fine-tune and eval read it after the model was
    resolved, so a link swapped in later is refused there too); the controls: a regular manifest and a
    link that stays inside the model directory (the side-file rule) are read."""
    from normswap.checkpoint.manifest import read_manifest
    from normswap.errors import NormswapError

    assert read_manifest(model) is None  # none yet
    (model / "normswap_manifest.json").write_text(json.dumps({"history": [{"step": "convert"}]}))
    assert read_manifest(model) == {"history": [{"step": "convert"}]}
    (model / "normswap_manifest.json").rename(model / "kept.json")
    (model / "normswap_manifest.json").symlink_to("kept.json")
    assert read_manifest(model) == {"history": [{"step": "convert"}]}
    (model / "normswap_manifest.json").unlink()
    (model / "normswap_manifest.json").symlink_to(secret)
    with pytest.raises(NormswapError, match="outside the model directory"):
        read_manifest(model)
    (model / "normswap_manifest.json").unlink()
    os.mkfifo(model / "normswap_manifest.json")  # would block a plain open forever
    with pytest.raises(NormswapError, match="not a regular file"):
        read_manifest(model)


@pytest.mark.parametrize("swap", [True, False], ids=["config swapped for a link", "control"])
def test_onnx_export_writes_config_from_what_it_read_never_through_a_link(tmp_path, model, monkeypatch, swap):
    """Case 4: config.json is replaced by a link to the user's key after the weights were read (during
    validation). The export reads it by the side-file rule and refuses; nothing is published. The control:
    without the swap DEST's config.json holds the source's config, written from the loaded object. The ONNX
    tracer and onnxruntime are replaced here (minutes on a loaded machine); what runs is the file handling."""
    pytest.importorskip("onnx")
    from normswap.errors import NormswapError
    from normswap.export import onnx as onnx_export
    from normswap.export import run_export

    key = tmp_path / "home" / ".ssh" / "id_rsa"
    key.parent.mkdir(parents=True)
    key.write_text('{"BEGIN OPENSSH PRIVATE KEY": "c2VjcmV0LXRva2Vu"}\n')
    source_config = json.loads((model / "config.json").read_text())

    def fake_graph(model_, path, norm_op):
        path.write_bytes(b"graph")
        return {"LayerNormalization": 9}

    def fake_validate(*a, **k):
        if swap:
            (model / "config.json").unlink()
            (model / "config.json").symlink_to(key)
        return {"passed": True, "max_abs_diff": 0.0, "metric": "logprob", "dtype": "float32"}

    monkeypatch.setattr(onnx_export, "export_graph", fake_graph)
    monkeypatch.setattr(onnx_export, "validate", fake_validate)
    dest = tmp_path / "dest"
    if swap:
        with pytest.raises(NormswapError, match="config.json is a symbolic link to .*outside the model directory"):
            run_export(model, dest, "onnx")
        assert not dest.exists()
        for p in tmp_path.rglob("*"):
            assert p == key or not p.is_file() or p.is_symlink() or b"c2VjcmV0LXRva2Vu" not in p.read_bytes(), p
    else:
        run_export(model, dest, "onnx")
        assert json.loads((dest / "config.json").read_text()) == source_config
        assert not (dest / "config.json").is_symlink()


# ------------------------------------------------------------------------------- cases 3 and 5
DEMO_RESULTS = Path(__file__).resolve().parent / "data" / "demo-results.json"  # a real eval's results


def _received(directory: Path, **changes) -> Path:
    """A results.json as a user might receive it (the committed demo's, with ``changes``)."""
    directory.mkdir(parents=True, exist_ok=True)
    results = json.loads(DEMO_RESULTS.read_text())
    results.update(changes)
    path = directory / "results.json"
    path.write_text(json.dumps(results, indent=2))
    return path


def test_render_never_copies_a_file_that_results_json_names(tmp_path, secret, run_cli):
    """Case 3: "lm_eval_log": "/…/id_rsa" in a received results.json; and the same through a relative
    path and through a link named lm_eval.log. Nothing is copied, the skip is one line naming it, the
    report is written. The control: a real lm_eval.log beside results.json travels with the report."""
    from normswap.report.report_dir import _log_beside

    results = _received(tmp_path / "received", lm_eval_log=str(secret))
    code, _, err = run_cli("eval", "render", results, "--out", tmp_path / "report")
    assert code == 0, err
    said = [line for line in err.splitlines() if "not carrying lm_eval_log" in line]
    assert len(said) == 1 and str(secret) in said[0], err
    assert not (tmp_path / "report" / "lm_eval.log").exists()
    assert "lm_eval_log" not in json.loads((tmp_path / "report" / "results.json").read_text())
    _nowhere_but(tmp_path, secret)
    # the same choice for a relative path out of the directory, and for a link at the log's own name
    d = tmp_path / "received"
    (d / "lm_eval.log").symlink_to(secret)
    for named in ("../home/.docker/config.json", "lm_eval.log"):
        said = []
        assert _log_beside({"lm_eval_log": named}, d, said.append) is None
        assert len(said) == 1 and named in said[0]
    # the control
    d = tmp_path / "ours"
    results = _received(d, lm_eval_log="lm_eval.log")
    (d / "lm_eval.log").write_text("lm-eval's own output\n")
    code, _, err = run_cli("eval", "render", results, "--out", tmp_path / "report-ours")
    assert code == 0 and "not carrying" not in err, err
    assert (tmp_path / "report-ours" / "lm_eval.log").read_text() == "lm-eval's own output\n"
    assert json.loads((tmp_path / "report-ours" / "results.json").read_text())["lm_eval_log"] == "lm_eval.log"


def test_render_beside_results_json_removes_nothing(tmp_path, run_cli):
    """Case 5: `eval render DIR/results.json` without --out used to publish the report over DIR with
    force, deleting everything else in it. Now it adds its own files, each by a rename: thesis.txt and
    photos/ stay, results.json is not rewritten, a symlink at report.html is replaced, not followed."""
    d = tmp_path / "DIR"
    results = _received(d)
    (d / "thesis.txt").write_text("four years of work\n")
    (d / "photos").mkdir()
    (d / "photos" / "a.jpg").write_bytes(b"\xff\xd8photo")
    victim = tmp_path / "bashrc"
    victim.write_text("export PATH\n")
    (d / "report.html").symlink_to(victim)
    before = _sha(results)

    code, out, err = run_cli("eval", "render", results)

    assert code == 0, err
    assert (d / "thesis.txt").read_text() == "four years of work\n"
    assert (d / "photos" / "a.jpg").read_bytes() == b"\xff\xd8photo"
    assert _sha(results) == before
    assert victim.read_text() == "export PATH\n" and not (d / "report.html").is_symlink()
    assert "data:image/png;base64," in (d / "report.html").read_text() and (d / "report.md").is_file()
    assert (d / "perplexity.png").read_bytes()[:4] == b"\x89PNG" and str(d / "report.html") in out
    leftovers = [p.name for p in d.iterdir() if "normswap" in p.name]
    assert leftovers == [], leftovers
    # --out naming results.json's own directory (even with --force) is the same: DIR is never replaced whole
    (d / "report.md").write_text("stale\n")
    code, _, err = run_cli("eval", "render", results, "--out", d, "--force")
    assert code == 0, err
    assert (d / "thesis.txt").exists() and (d / "photos" / "a.jpg").exists() and _sha(results) == before
    assert (d / "report.md").read_text() != "stale\n"
