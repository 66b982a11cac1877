"""Every count option has an upper bound, declared once, checked on the command line and again on the
options a resumed run reads back; a batch whose logits cannot fit is refused before the model loads."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _one_line(code, err, *needles):
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, (code, err)
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


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
