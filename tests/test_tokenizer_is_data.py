"""Tokenizers are data, and slow data is bounded (normswap/checkpoint/tokenizer_guard.py).

The bad tokenizers are the shipped kjv-gpt2 model's real tokenizer.json with one more pre-tokenizer in
front of its own: an Oniguruma pattern that backtracks.
- SLOW, ``(?:\\D|\\D\\D){1,20}\\d``: about 0.03 s a character of plain text, under the retry limit, so the
  library never fails: it just takes hours over a test text (each position tries every way of
  splitting up to 20 non-digits into runs of one or two).
- PANIC, ``(?:\\D|\\D\\D)+\\d``: past Oniguruma's retry limit on 40 characters, a Rust panic
  (``pyo3_runtime.PanicException``, a BaseException).
- Variants that bite only on ``~``, which the load probe does not hold, so the guard on every encode, not
  only the probe, is tested: ``~`` + PANIC, and SLOW_ON_TILDES, ``(?:~|~~){1,20}\\d``, about 0.3 s per
  run of 40 tildes (under the retry limit) and nothing on plain text.
The control in each test: the unedited tokenizer (the same file less the extra pre-tokenizer) loads and
gives the same ids as the raw library. On the code before the guard: the SLOW model ignored SIGTERM
(only SIGKILL ended it, leaving its lock and staging), and PANIC ended in a 50-line traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLOW = r"(?:\D|\D\D){1,20}\d"
PANIC = r"(?:\D|\D\D)+\d"
SLOW_ON_TILDES = r"(?:~|~~){1,20}\d"
TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
    "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.\n"
)


def _model(tmp_path, name: str, pattern: str | None) -> Path:
    """kjv-gpt2 as shipped, with ``pattern`` split off before its own ByteLevel pre-tokenizer."""
    from normswap.assets.models import model_path

    out = tmp_path / name
    shutil.copytree(model_path("kjv-gpt2"), out)
    if pattern is not None:
        tj = json.loads((out / "tokenizer.json").read_text())
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tj["pre_tokenizer"]]}
        (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NORMSWAP_DEBUG": ""}


def test_the_unedited_tokenizer_loads_and_gives_the_librarys_ids(tmp_path):
    """The control: the guard changes nothing a normal tokenizer returns (one text, a batch, a pair)."""
    from tokenizers import Tokenizer

    from normswap.checkpoint.load import load_tokenizer
    from normswap.checkpoint.tokenizer_guard import GuardedBackend

    model = _model(tmp_path, "plain", None)
    tok = load_tokenizer(str(model))
    raw = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert isinstance(tok.backend_tokenizer, GuardedBackend)  # the control is guarded too
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == raw.encode(TEXT, add_special_tokens=False).ids
    batch = [TEXT, TEXT[:40], ""]
    assert tok(batch, add_special_tokens=False)["input_ids"] == [
        e.ids for e in raw.encode_batch(batch, add_special_tokens=False)
    ]
    assert tok.backend_tokenizer.encode(TEXT[:30], TEXT[30:60]).ids == raw.encode(TEXT[:30], TEXT[30:60]).ids
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT
    tok.save_pretrained(tmp_path / "saved")  # the Rust tokenizer is what is saved
    assert Tokenizer.from_file(str(tmp_path / "saved" / "tokenizer.json")).encode(TEXT).ids == raw.encode(TEXT).ids


@pytest.mark.parametrize("pattern", [SLOW, PANIC], ids=["slow", "panic"])
def test_a_backtracking_pattern_is_refused_on_load_in_one_line_naming_the_file(tmp_path, pattern):
    from normswap.checkpoint.load import load_tokenizer
    from normswap.errors import NormswapError

    model = _model(tmp_path, "bad", pattern)
    t0 = time.monotonic()
    with pytest.raises(NormswapError, match=f"{model / 'tokenizer.json'}: .*does not use this tokenizer"):
        load_tokenizer(str(model))
    assert time.monotonic() - t0 < 60  # the probe's budget, not hours (a loose bound: two loaded cores)


def test_a_panic_on_a_later_text_is_one_line_and_rusts_own_lines_are_dropped(tmp_path, capfd):
    """The PANIC pattern behind a trigger the probe does not hold: the load passes, the text panics."""
    from normswap.checkpoint.load import load_tokenizer
    from normswap.errors import NormswapError

    model = _model(tmp_path, "later", "~" + PANIC)
    tok = load_tokenizer(str(model))
    assert tok(TEXT)["input_ids"]  # the control: text without the trigger tokenizes
    capfd.readouterr()
    with pytest.raises(NormswapError, match=r"tokenizer\.json: the tokenizers library failed .*PanicException"):
        tok("~" + TEXT)
    out, err = capfd.readouterr()
    assert "panicked" not in err and "Onig" not in err and "backtrace" not in err, err


def test_panic_from_a_library_is_one_line_at_the_cli(monkeypatch, capsys):
    """The last-resort handler: a BaseException that is no Exception (a Rust panic that reached it)."""
    import normswap.cli.main as cli_main

    PanicException = type("PanicException", (BaseException,), {})  # as pyo3_runtime defines it

    def boom(*a, **k):
        raise PanicException("Onig: Regex search error: retry-limit-in-match over\nmore lines")

    monkeypatch.setattr(cli_main.cli, "main", boom)
    monkeypatch.delenv("NORMSWAP_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["models"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and err.strip().count("\n") == 0, err
    assert "PanicException: Onig: Regex search error" in err


def test_panic_during_eval_is_one_line(tmp_path):
    model = _model(tmp_path, "panic", PANIC)
    r = subprocess.run(
        [sys.executable, "-m", "normswap", "eval", "ppl", str(model), "--max-tokens", "64"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in r.stderr.splitlines() if not line.startswith("normswap eval ")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"{model / 'tokenizer.json'}: the tokenizers library failed" in lines[0]


def test_sigterm_ends_a_command_stuck_in_a_slow_pattern_and_cleans_up(tmp_path):
    """SLOW_ON_TILDES: the load passes, then `eval report` tokenizes a text of tilde runs for hours.
    SIGTERM ends it within seconds, in one line, its staging and lock removed."""
    model = _model(tmp_path, "slow", SLOW_ON_TILDES)
    data = tmp_path / "text.txt"
    data.write_text(("~" * 40 + " ") * 20_000 + TEXT)  # one document, one library call: well over an hour
    out = tmp_path / "report"
    cmd = [
        sys.executable, "-m", "normswap", "eval", "report", str(model), "--data", str(data), "--out", str(out),
        "--no-speed", "--no-memory", "--no-diagnostics", "--no-fidelity", "--max-tokens", "64",
    ]  # fmt: skip
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        lock = tmp_path / ".report.normswap.lock"
        t0 = time.monotonic()
        while not lock.exists() and time.monotonic() - t0 < 30:  # OUT's lock: the command is at work
            assert proc.poll() is None, open(tmp_path / "stderr.txt").read()
            time.sleep(0.2)
        time.sleep(3.0)  # into the tokenization
        assert proc.poll() is None  # the control: the text with the trigger keeps it tokenizing
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)  # on the code before the guard: TimeoutExpired, the call in Rust ignores it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err.seek(0)
    text = err.read()
    lines = [line for line in text.splitlines() if not line.startswith("normswap eval ")]
    assert proc.returncode == 128 + signal.SIGTERM and lines == ["normswap: stopped by SIGTERM"], text
    assert not out.exists() and not lock.exists()
    assert not [p.name for p in tmp_path.iterdir() if "normswap-staging" in p.name]
