"""A tokenizer is vetted before any library builds it (normswap/checkpoint/tokenizer_vet.py; issue #57 case 1).

The bad tokenizer is the shipped kjv-gpt2's tokenizer.json with a normalizer ``Replace`` pattern that
backtracks on runs of ``~`` only, ``(?:~|~~){1,20}\\d``, and one added token of ``~`` marked normalized:
the tokenizers library runs the normalizer over that token while it *builds* the tokenizer (in
``from_pretrained``, holding the interpreter lock), about 0.02 s of CPU a character. The guard's probe holds
no ``~``, so only the build is slow: round 6's guard, which starts after the build, never saw it. On the code
before the vet, the build ran in the command itself: SIGTERM did nothing until it ended (the signal test
fails at its deadline), and the CLI test found the model evaluated (exit 0). The control in each: the same
tokenizer with an 8-character token builds quickly, passes the vet and gives the library's own ids.
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

import psutil
import pytest

from tests.helpers import normswap_capped

ROOT = Path(__file__).resolve().parents[1]
ON_TILDES = r"(?:~|~~){1,20}\d"
LONG = 2_000  # about 40 s of CPU to build: far past the vet's budget, short enough for the code before it
DEADLINE = 20.0  # seconds from SIGTERM until the command and its children are gone (a loaded 2-core machine)
TEXT = "In the beginning God created the heaven and the earth.\n"


def _model(tmp_path, name: str, token_chars: int) -> Path:
    """kjv-gpt2 as shipped, its normalizer ON_TILDES, with one normalized added token of ``token_chars`` ``~``."""
    from normswap.assets.models import model_path

    out = tmp_path / name
    shutil.copytree(model_path("kjv-gpt2"), out)
    tj = json.loads((out / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Replace", "pattern": {"Regex": ON_TILDES}, "content": "x"}
    token = {"content": "~" * token_chars, "single_word": False, "lstrip": False, "rstrip": False}
    tj["added_tokens"].append({"id": 4096, **token, "normalized": True, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


@pytest.fixture
def builds(monkeypatch):
    """Every tokenizer transformers builds in this process (a vetted one is built here after its vet)."""
    from transformers import AutoTokenizer

    seen = []
    real = AutoTokenizer.from_pretrained.__func__

    def recorded(cls, path, *args, **kwargs):
        seen.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(recorded))
    return seen


def test_a_tokenizer_whose_build_runs_away_is_refused_before_any_library_builds_it(tmp_path, builds):
    from normswap.checkpoint.load import load_tokenizer
    from normswap.errors import NormswapError

    model = _model(tmp_path, "slow", LONG)
    # children this worker already had (an earlier test's, still ending) are not this load's
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(NormswapError, match=f"{model / 'tokenizer.json'}: building this tokenizer took more than"):
        load_tokenizer(str(model))
    assert builds == []  # before the vet: transformers built it here, for the whole 40 s
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert left == []  # the child the kernel ended is collected


def test_the_control_a_short_token_passes_the_vet_and_gives_the_librarys_ids(tmp_path, builds):
    from tokenizers import Tokenizer

    from normswap.checkpoint.load import load_tokenizer

    model = _model(tmp_path, "short", 8)
    tok = load_tokenizer(str(model))
    raw = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert builds == [str(model)]  # vetted, then built here once
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == raw.encode(TEXT, add_special_tokens=False).ids
    assert tok.decode(raw.encode("~" * 8 + TEXT).ids) == raw.decode(raw.encode("~" * 8 + TEXT).ids)


def test_a_decoder_that_runs_away_on_an_added_token_is_refused_on_load(tmp_path, builds):
    """The vet decodes every added token: a decoder pattern that backtracks on one is refused before it is
    built here (the guard's probe never decodes an added token)."""
    from normswap.checkpoint.load import load_tokenizer
    from normswap.errors import NormswapError

    model = _model(tmp_path, "decoder", 300)
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["normalizer"] = None
    tj["added_tokens"][-1]["normalized"] = False
    replace = {"type": "Replace", "pattern": {"Regex": r"(?:\D|\D\D){1,20}\d"}, "content": "x"}
    tj["decoder"] = {"type": "Sequence", "decoders": [replace, tj["decoder"]]}
    (model / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(NormswapError, match=r"tokenizer\.json: tokenizing and decoding .* probe took more than"):
        load_tokenizer(str(model))
    assert builds == []


def test_a_slow_build_is_one_line_at_the_cli(tmp_path):
    model = _model(tmp_path, "cli", LONG)
    code, err = normswap_capped("eval", "ppl", model, "--max-tokens", "32", timeout=240)
    lines = [line for line in err.splitlines() if not line.startswith("normswap eval")]
    assert code == 2 and len(lines) == 1, err  # before the vet: exit 0, the model evaluated after the build
    assert f"{model / 'tokenizer.json'}: building this tokenizer took more than" in lines[0]


def _wait_until_building(proc, stderr: Path, timeout: float = 180.0) -> None:
    """Until the command builds the tokenizer: its vetting child runs, or (on code without one) the tokenizers
    library has been loaded in the command for 5 s (what is left before the build then is a file lookup)."""
    t0, loaded = time.monotonic(), None
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, stderr.read_text()
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
            if any("tokenizer_vet_child" in " ".join(k.cmdline()) for k in kids):
                return
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except (psutil.Error, OSError):
            maps = ""
        if loaded is None and "tokenizers.abi3" in maps:
            loaded = time.monotonic()
        if loaded is not None and time.monotonic() - loaded > 5.0:
            return
        time.sleep(0.1)
    pytest.fail(f"the command did not reach the tokenizer's build in {timeout} s:\n{stderr.read_text()}")


def test_sigterm_ends_a_command_building_a_slow_tokenizer_promptly(tmp_path):
    """The command is started on the slow tokenizer and signalled while it builds (vets) it: it ends before
    the deadline, in one line, with every process it started."""
    model = _model(tmp_path, "signal", LONG)
    err = open(tmp_path / "stderr.txt", "w+")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NORMSWAP_DEBUG": ""}
    cmd = [sys.executable, "-m", "normswap", "eval", "ppl", str(model), "--max-tokens", "32"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        _wait_until_building(proc, tmp_path / "stderr.txt")
        assert proc.poll() is None  # the control: the build keeps it busy (it takes about 40 s of CPU)
        below = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=DEADLINE)  # before the vet: TimeoutExpired, the build in Rust holds the GIL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err.seek(0)
    text = err.read()
    lines = [line for line in text.splitlines() if not line.startswith("normswap eval")]
    assert proc.returncode == 128 + signal.SIGTERM and lines == ["normswap: stopped by SIGTERM"], text
    assert not [p for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
