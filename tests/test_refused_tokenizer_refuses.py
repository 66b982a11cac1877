"""A tokenizer normswap refuses refuses the command (issue #57 case 4).

Before: convert, export and study caught the guard's refusal like a missing tokenizer and went on — convert
verified on random ids and published the refused tokenizer.json in OUT, export dropped it, study quietly
used its fallback tokenizer — while the refused probe's thread kept a core busy in Rust for as long as the
process lived. Now the refusal (``TokenizerRefused``) reaches the command, which ends in one line before any
work; the probe that refuses a tokenizer on load runs in the vetting child, which the kernel ends, so no
thread of the command is left running it; and a guarded call past its budget makes the tokenizer refuse
every later call at once (its thread cannot be stopped: the command ends). The bad tokenizers are round 6's:
kjv-gpt2 with a backtracking pre-tokenizer pattern in front of its own (tests/test_tokenizer_is_data.py). The
control in each: the unedited tokenizer is used (converted with, the study's own, decoded as the library).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import psutil
import pytest

from tests.helpers import normswap_capped

SLOW = r"(?:\D|\D\D){1,20}\d"  # backtracks on any text: the load's probe refuses it
ON_TILDES = r"(?:~|~~){1,20}\d"  # backtracks on runs of ~ only: the probe passes it, a later text does not
TEXT = "In the beginning God created the heaven and the earth.\n"


def _model(tmp_path, name: str, split: str | None = None, decoder: str | None = None) -> Path:
    """kjv-gpt2 as shipped, with ``split`` as a pre-tokenizer before its own and ``decoder`` as a Replace
    pattern after its ByteLevel decoder (which joins the tokens: the pattern runs on the whole text)."""
    from normswap.assets.models import model_path

    out = tmp_path / name
    shutil.copytree(model_path("kjv-gpt2"), out)
    tj = json.loads((out / "tokenizer.json").read_text())
    if split is not None:
        pre = {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}
        tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [pre, tj["pre_tokenizer"]]}
    if decoder is not None:
        replace = {"type": "Replace", "pattern": {"Regex": decoder}, "content": "x"}
        tj["decoder"] = {"type": "Sequence", "decoders": [tj["decoder"], replace]}
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def _tokenizing_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "normswap-tokenize" and t.is_alive()]


def test_convert_refuses_a_refused_tokenizer_in_one_line_and_writes_nothing(tmp_path):
    model, out = _model(tmp_path, "bad", SLOW), tmp_path / "out"
    code, err = normswap_capped("convert", model, out, "--no-verify", timeout=300)
    lines = [line for line in err.splitlines() if line.startswith("normswap")]
    assert code == 2 and len(lines) == 1, err  # before: exit 0, OUT held the refused tokenizer.json
    assert f"{model / 'tokenizer.json'}: " in lines[0] and "does not use this tokenizer" in lines[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "normswap-staging" in p.name]


def test_export_refuses_a_refused_tokenizer_before_any_work(tmp_path):
    """A converted checkpoint (convert --no-verify of the unedited model) whose tokenizer.json is then swapped
    for the refused one: export ends in one line naming it (before: exported, exit 0)."""
    from normswap.checkpoint.load import load_tokenizer

    plain, converted, out = _model(tmp_path, "plain"), tmp_path / "converted", tmp_path / "out"
    code, err = normswap_capped("convert", plain, converted, "--no-verify", timeout=300)
    assert code == 0, err
    assert load_tokenizer(str(converted))(TEXT)["input_ids"]  # the control: its own tokenizer loads
    shutil.copy(_model(tmp_path, "bad", SLOW) / "tokenizer.json", converted / "tokenizer.json")
    code, err = normswap_capped("export", converted, out, "--format", "stock", timeout=300)
    lines = [line for line in err.splitlines() if line.startswith("normswap")]
    assert code == 2 and len(lines) == 1, err
    assert f"{converted / 'tokenizer.json'}: " in lines[0] and "does not use this tokenizer" in lines[0]
    assert not out.exists()


def test_the_control_a_model_without_a_tokenizer_file_is_not_refused(tmp_path):
    """What convert and export can do without (no tokenizer file: verification on random ids) is not a
    refusal; the unedited tokenizer loads, guarded."""
    from normswap.checkpoint.load import optional_tokenizer
    from normswap.checkpoint.tokenizer_guard import GuardedBackend

    model = _model(tmp_path, "none")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    optional_tokenizer(str(model))  # transformers' own answer (None, or an empty tokenizer): no refusal
    assert isinstance(optional_tokenizer(str(_model(tmp_path, "plain"))).backend_tokenizer, GuardedBackend)


def test_the_study_refuses_instead_of_using_its_fallback(tmp_path):
    from normswap.checkpoint.load import load_config
    from normswap.errors import NormswapError
    from normswap.study.arms import _tokenizer_for

    plain = _model(tmp_path, "plain")
    config = load_config(str(plain))
    assert Path(_tokenizer_for("m", config, plain).name_or_path) == plain  # the control: its own tokenizer
    bad = _model(tmp_path, "bad", SLOW)
    with pytest.raises(NormswapError, match=f"{bad / 'tokenizer.json'}: .*does not use this tokenizer"):
        _tokenizer_for("m", config, bad)  # before: kjv-gpt2's own tokenizer, the fallback, unsaid


def test_no_thread_outlives_a_refusal_on_load(tmp_path):
    from normswap.checkpoint.load import load_tokenizer
    from normswap.errors import NormswapError

    before = _tokenizing_threads()
    with pytest.raises(NormswapError, match="does not use this tokenizer"):
        load_tokenizer(str(_model(tmp_path, "bad", SLOW)))
    assert _tokenizing_threads() == before  # before: the probe's thread, still in Rust, for hours
    assert psutil.Process().children(recursive=True) == []  # the vetting child is gone too


@pytest.fixture
def short_budget(monkeypatch):
    """Every guarded call gets half a second (a call past it is what is tested, not how long it waits)."""
    from normswap.checkpoint import tokenizer_guard

    monkeypatch.setattr(tokenizer_guard, "BASE_SECONDS", 0.5)
    monkeypatch.setattr(tokenizer_guard, "MIN_CHARS_PER_SECOND", 10**12)


def test_a_call_past_its_budget_refuses_every_later_call_at_once(tmp_path, short_budget):
    from normswap.checkpoint.load import load_tokenizer
    from normswap.errors import NormswapError

    tok = load_tokenizer(str(_model(tmp_path, "later", ON_TILDES)))
    assert tok(TEXT)["input_ids"]  # the control: text without tildes tokenizes
    with pytest.raises(NormswapError, match="tokenizing .* characters took more than"):
        tok(("~" * 40 + " ") * 200)
    running = len(_tokenizing_threads())
    with pytest.raises(NormswapError, match="tokenizing"):
        tok(TEXT)  # refused at once: no second call beside the one still in Rust (before: tokenized)
    assert len(_tokenizing_threads()) <= running


def test_a_decode_past_its_budget_is_refused(tmp_path, short_budget):
    """A decoder pattern that backtracks on tildes: the load's probe passes; decoding a text of tilde runs
    is refused within its budget (before: decode held the GIL until the pattern was done)."""
    from tokenizers import Tokenizer

    from normswap.checkpoint.load import load_tokenizer
    from normswap.errors import NormswapError

    model = _model(tmp_path, "decoder", decoder=ON_TILDES)
    tok = load_tokenizer(str(model))
    raw = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = raw.encode(TEXT).ids
    assert tok.decode(ids) == raw.decode(ids)  # the control: the library's own text
    with pytest.raises(NormswapError, match="decoding .* ids took more than"):
        tok.decode(raw.encode(("~" * 40 + " ") * 20).ids)
