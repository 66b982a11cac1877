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


EVAL_FAST = ["--seq-len", "32", "--max-tokens", "256", "--no-speed", "--no-memory", "--no-diagnostics", "--quiet"]


@pytest.fixture
def model(tmp_path):
    """A private copy of the shipped kjv-gpt2 (a real trained GPT-2 with its tokenizer)."""
    path = tmp_path / "M"
    shutil.copytree(model_path("kjv-gpt2"), path)
    return path


# ------------------------------------------------------------------------------------ case 8
@pytest.fixture
def saved_rows(tmp_path):
    """Rows as `families survey --save-json` writes them (a few of the committed survey's)."""
    from normswap.convert.survey import shipped_rows

    path = tmp_path / "rows.json"
    path.write_text(json.dumps(shipped_rows()[:3], indent=1) + "\n")
    return path


def test_families_discover_never_writes_over_the_model(tmp_path, model, run_cli):
    weights = model / "model.safetensors"
    before = _sha(weights)
    code, _, err = run_cli("families", "discover", model, "--out", weights)
    _one_error_line(code, err, "overlaps the model", "which this command reads")
    code, _, err = run_cli("families", "discover", model, "--out", model / "family.yaml", "--force")
    _one_error_line(code, err, "overlaps the model")
    assert _sha(weights) == before and not (model / "family.yaml").exists()
    # an existing file is replaced only with --force, and the refusal comes before discovery runs
    taken = tmp_path / "taken.yaml"
    taken.write_text("mine\n")
    code, _, err = run_cli("families", "discover", model, "--out", taken)
    _one_error_line(code, err, "already exists; pass --force")
    assert taken.read_text() == "mine\n"
    # the control: with --force it is replaced, atomically, by the checked family file
    code, _, err = run_cli("families", "discover", model / "config.json", "--out", taken, "--force")
    assert code == 0, err
    assert "exact on a tiny randomised instance" in err and taken.read_text().startswith("# Discovered by")


@pytest.mark.parametrize("command", ["survey", "matrix"])
def test_families_tables_never_write_over_their_saved_rows(tmp_path, saved_rows, run_cli, command):
    rows = saved_rows
    if command == "matrix":
        rows = tmp_path / "m.json"
        rows.write_text(json.dumps({"rows": [], "meta": {}}))
    before = _sha(rows)
    for flag in ("--out", "--save-json"):
        code, _, err = run_cli("families", command, "--from-json", rows, flag, rows, "--force")
        _one_error_line(code, err, "overlaps the saved rows")
        assert _sha(rows) == before
    table = tmp_path / "table.md"
    table.write_text("mine\n")
    code, _, err = run_cli("families", command, "--from-json", rows, "--out", table)
    _one_error_line(code, err, f"--out {table} already exists; pass --force")
    assert table.read_text() == "mine\n"
    if command == "survey":  # the control: the table from the saved rows, with --force
        code, stdout, _ = run_cli("families", command, "--from-json", rows)
        assert code == 0 and "|" in stdout
        code, _, err = run_cli("families", command, "--from-json", rows, "--out", table, "--force")
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

    # through the CLI: one line each, no "choose a directory you can write", exit 0
    code, _, err = run_cli("eval", "report", "normswap:kjv-gpt2", "--out", out, "--force", *EVAL_FAST)
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
