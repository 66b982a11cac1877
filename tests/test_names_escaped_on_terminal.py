"""Names reach the terminal escaped, never as control characters (issue #57, case 7).

A model directory whose name holds escape sequences (set the window title, erase the line, a carriage
return over "verified") was printed as it is in progress lines, tables and errors. Now every line a
command prints passes one layer (normswap/progress.py: ``TerminalSafe`` in front of stdout and stderr,
and the progress lines' own stream) that writes each control character out as ``\\uXXXX``. The test
runs real commands on such a model and walks every character they print.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import checked_run, tiny_model, tiny_wordpiece

REPO = Path(__file__).resolve().parents[1]
# a window title, a bell, a carriage return and an erased line over "verified", a C1 CSI, a backspace,
# a bidirectional override
NAME = "kjv\x1b]0;owned\x07\r\x1b[2Kverified\x9b31m\x08\u202eok"
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("names") / NAME
    tiny_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=256).save_pretrained(path)
    tiny_wordpiece().save_pretrained(path)
    return path


def _run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "normswap", *map(str, args)]
    return checked_run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _assert_no_controls(proc, *, printed_name=True):
    for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        bad = CONTROL.search(text)
        assert bad is None, f"{stream} carries {bad.group()!r} raw: {text[max(0, bad.start() - 80) : bad.end() + 80]!r}"
    if printed_name:
        # (click takes a well-formed colour sequence out of what goes to a file; the rest is written out)
        assert "\\u001b]0;owned\\u0007\\u000d" in proc.stdout + proc.stderr


EVAL = ("--max-tokens", "64", "--seq-len", "16", "--device", "cpu")


def test_eval_prints_the_name_escaped_in_its_progress_and_table(model):
    proc = _run("eval", "ppl", model, *EVAL)
    assert proc.returncode == 0, proc.stderr
    _assert_no_controls(proc)


def test_convert_prints_the_name_escaped(model, tmp_path):
    proc = _run("convert", model, tmp_path / ("out" + NAME), "--no-verify")
    assert proc.returncode == 0, proc.stderr
    _assert_no_controls(proc)


def test_an_error_naming_the_model_is_escaped(model):
    proc = _run("eval", "ppl", model.parent / ("missing" + NAME), *EVAL)
    assert proc.returncode == 2
    _assert_no_controls(proc)


def test_json_output_stays_json_and_decodes_to_the_name(model):
    proc = _run("eval", "ppl", model, *EVAL, "--json")
    assert proc.returncode == 0, proc.stderr
    _assert_no_controls(proc, printed_name=False)

    def strings(o):
        if isinstance(o, str):
            yield o
        elif isinstance(o, dict):
            for v in o.values():
                yield from strings(v)
        elif isinstance(o, list):
            for v in o:
                yield from strings(v)

    assert any(NAME in s for s in strings(json.loads(proc.stdout)))  # the escapes decode to the name itself


def test_the_escape_writes_out_every_control_and_keeps_text():
    from normswap.progress import terminal_safe

    assert terminal_safe("a\tb\nc") == "a\tb\nc"  # the control: layout and text are kept
    assert terminal_safe("日本語 ok") == "日本語 ok"
    assert terminal_safe("\x1b[2K\r\x07\x9b\x7f\u202e") == "\\u001b[2K\\u000d\\u0007\\u009b\\u007f\\u202e"
    assert CONTROL.search(terminal_safe("".join(map(chr, range(0x20))) + "".join(map(chr, range(0x7F, 0xA0))))) is None
