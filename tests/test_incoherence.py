"""The incoherence rotation before int8 (slice/incoherence.py): exact on a conversion and on a sliced
model, spreads a loud coordinate's energy, and is refused on a LayerNorm original. Each exactness
check has its control: the same model with one reader turned twice (a wrong fold) fails it."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model

from normswap.convert import convert_model
from normswap.errors import NormswapError
from normswap.slice import slice_model
from normswap.slice.incoherence import coordinate_energy, incoherence_rotate
from normswap.slice.rotate import contract


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double().log_softmax(-1)


def _batches(vocab):
    return [torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(2))]


def _models(family):
    original = tiny_model(family, 0).double().eval()
    conversion = copy.deepcopy(original)
    convert_model(conversion)
    sliced = slice_model(conversion, _batches(256), 0.25).model.eval()
    return original, conversion, sliced


def _wrong_fold(model, seed):
    """The rotated model with one stream reader turned a second time: what a fold that misses (or
    repeats) one tensor computes."""
    from normswap.slice import basis as bases

    bad = copy.deepcopy(model)
    info = bad.config.normswap["slice"]
    key = next(k for k in info["stream_dims"] if k.endswith("mlp.c_fc.weight") or k.endswith("dense_h_to_4h.weight"))
    param = dict(bad.named_parameters())[key]
    z = bases.random_orthogonal(int(info["width"]), seed + 1)
    with torch.no_grad():
        param.copy_(contract(param.double(), info["stream_dims"][key][0], z))
    return bad


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_rotation_of_a_conversion_is_exact(family):
    original, conversion, _ = _models(family)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    turned = incoherence_rotate(conversion, seed=3)
    assert turned.config.normswap["slice"]["incoherence"]["seed"] == 3
    assert float((_logprobs(turned, ids) - _logprobs(original, ids)).abs().max()) < 1e-9
    # the control: a wrong fold of one reader moves the outputs far beyond that
    assert float((_logprobs(_wrong_fold(turned, 3), ids) - _logprobs(original, ids)).abs().max()) > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_rotation_of_a_sliced_model_is_exact_and_spreads_the_energy(family):
    """gpt2 has a tied head with γ (the adapter turns too); gpt_neox an untied head. PCA put most of the
    stream's energy in the first coordinate; the turn spreads it (and leaves the sliced model's function)."""
    _, _, sliced = _models(family)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    turned = incoherence_rotate(sliced, seed=1)
    assert float((_logprobs(turned, ids) - _logprobs(sliced, ids)).abs().max()) < 1e-9
    assert float((_logprobs(_wrong_fold(turned, 1), ids) - _logprobs(sliced, ids)).abs().max()) > 1e-3
    before = coordinate_energy(sliced, _batches(256))["max_over_mean"]
    after = coordinate_energy(turned, _batches(256))["max_over_mean"]
    assert before > 10 and after < 0.3 * before, (before, after)
    # the source is left as it was: turning it again with the same seed gives the same weights
    again = incoherence_rotate(sliced, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(turned.state_dict().values(), again.state_dict().values()))


def test_a_layernorm_original_is_refused_in_one_line():
    original = tiny_model("gpt2", 0).eval()
    with pytest.raises(NormswapError, match="LayerNorm original") as refused:
        incoherence_rotate(original)
    assert "\n" not in str(refused.value)
