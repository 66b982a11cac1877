"""A converted model's `generate()` does no more host work per generated token than its original's.

On a GPU an eager decode step is host-bound, so every extra Python call a token is paid in full.
Counted, not timed: Python calls (frames entered, `sys.setprofile`) of a greedy batch-1 `generate()`
of 5 new tokens minus those of 2, per token, so the prefill and the set-up cancel. Every shipped
family's tiny randomised model (tests/helpers.py) and its exact conversion, loaded the way users load
them: stock transformers (`from_pretrained(OUT, trust_remote_code=True)`) and `normswap.load_model`.
"""

from __future__ import annotations

import sys

import pytest
import torch
import transformers
from helpers import family_variants, tiny_config, tiny_model

import normswap
from normswap.convert.pipeline import convert_checkpoint

SHORT, LONG = 2, 5


def _calls(model, new_tokens: int) -> int:
    ids = torch.tensor([[1, 2, 3, 4]])
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    kwargs = {"do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    with torch.no_grad():
        sys.setprofile(prof)
        try:
            out = model.generate(ids, **kwargs)
        finally:
            sys.setprofile(None)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return count


def calls_per_token(model) -> float:
    model.eval()
    _calls(model, 1)  # lazy set-up (kernel decisions, caches) out of the way
    return (_calls(model, LONG) - _calls(model, SHORT)) / (LONG - SHORT)


def _stock(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-host-work")
    cache = {}

    def get(family, variant):
        if (family, variant) not in cache:
            src, out = root / f"{family}-{variant}", root / f"{family}-{variant}-converted"
            tiny_model(family, variant, task="causal-lm").save_pretrained(src)
            convert_checkpoint(str(src), str(out), verify=False)  # exactness is tested elsewhere
            cache[family, variant] = (src, out)
        return cache[family, variant]

    return get


# each family's first test config (its other variants differ in layout, not in what our modules do per token)
FAMILIES = [
    (f, v)
    for f, v in family_variants()
    if v == 0 and type(tiny_config(f, v)) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
]


@pytest.mark.parametrize(("family", "variant"), FAMILIES)
def test_a_conversion_makes_no_more_python_calls_per_generated_token_than_its_original(converted, family, variant):
    src, out = converted(family, variant)
    original = _stock(src)
    # normswap.load_model of an original is the same transformers class, so one count stands for both paths
    assert type(normswap.load_model(str(src))) is type(original)
    original = calls_per_token(original)
    for path, load in (("stock", _stock), ("normswap", lambda d: normswap.load_model(str(d)))):
        conversion = calls_per_token(load(out))
        assert conversion <= original, (path, conversion, original)


def test_control_the_remote_code_answer_of_transformers_costs_an_inspect_signature_per_token(converted, monkeypatch):
    """The control: the converted class answering `is_remote_code()` as transformers would for a class
    loaded as remote code (``_auto_class`` set), as it did before, makes generate() read
    `inspect.signature(self.forward)` every step: well over the original's count."""
    src, out = converted("gpt2", 0)
    original = calls_per_token(transformers.AutoModelForCausalLM.from_pretrained(str(src)))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    assert type(model)._auto_class is not None  # loaded as remote code
    assert calls_per_token(model) <= original
    # control: transformers' own answer for a class registered for an auto class
    monkeypatch.setattr(type(model), "is_remote_code", classmethod(lambda cls: cls._auto_class is not None))
    assert calls_per_token(model) > original + 50


def test_a_remote_code_conversion_saved_by_stock_transformers_keeps_its_code_and_its_outputs(converted, tmp_path):
    """is_remote_code() answers False, which also switches off transformers' copying of the code file
    on save: the converted class copies it itself, so a stock save loads back as it was."""
    _, out = converted("gpt2", 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "modeling_normswap.py").is_file()  # control: absent without the copy
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), trust_remote_code=True)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
