"""`normswap.slice` in memory: the rotation is exact at F = 0 for every family normswap converts
exactly, a stream that lives in k directions slices to k losslessly under PCA (and not under a
random basis), and the sliced tied-γ GPT-2 has fewer parameters than its original."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import family_variants, tiny_model

from normswap.convert import convert_model
from normswap.errors import NormswapError
from normswap.slice import slice_model
from normswap.slice.basis import pca_basis, width_for
from normswap.slice.model import rotate_model
from normswap.slice.rotate import contract
from normswap.slice.stream import stream_map

# what cannot be rotated is refused in one line (none of the pre-LN families now): BLOOM's embedding
# norm is precomputed into its table and XGLM's sinusoidal positions are stored
# (tests/test_slice_bloom_xglm.py)
REFUSED: dict[str, str] = {}


def _batches(vocab, n=2, rows=4, seq=16):
    return [torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _probe(vocab):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(99))


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double().log_softmax(-1)


def _converted(family, variant, dtype):
    original = tiny_model(family, variant).to(dtype)
    model = copy.deepcopy(original)
    convert_model(model)
    return original, model


@pytest.mark.parametrize("family,variant", family_variants("pre"))
def test_rotation_alone_reproduces_the_original(family, variant):
    """F = 0 (only the all-ones direction deleted): the sliced model computes what the LayerNorm
    original computes, γ, β, biases and embeddings randomised, every pre-LN family row. The control
    is test_deleting_a_used_direction_is_caught below (same comparison, a wrong basis)."""
    torch.set_default_dtype(torch.float64)  # modeling code that builds constants in it (XGLM's mask floor)
    try:
        _rotation_alone_reproduces_the_original(family, variant)
    finally:
        torch.set_default_dtype(torch.float32)


def _rotation_alone_reproduces_the_original(family, variant):
    original, model = _converted(family, variant, torch.float64)
    vocab = model.config.vocab_size
    if family in REFUSED:
        with pytest.raises(NormswapError, match=REFUSED[family]) as refused:
            slice_model(model, _batches(vocab, n=1), 0.0)
        assert "\n" not in str(refused.value)
        return
    result = slice_model(model, _batches(vocab, n=1), 0.0)
    assert result.width == result.hidden_size - 1
    ids = _probe(vocab)
    assert float((_logprobs(result.model, ids) - _logprobs(original, ids)).abs().max()) < 1e-9


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_deleting_a_used_direction_is_caught(family):
    """The control of the exactness test: the same rotation keeping u in place of the stream's
    first principal direction deletes a direction the stream uses; the outputs move far beyond
    the tolerance (and the correct basis passes the same comparison)."""
    original, model = _converted(family, 0, torch.float64)
    result = slice_model(model, _batches(256, n=1), 0.0)
    d, q = result.hidden_size, result.basis_matrix
    ids = _probe(256)
    ref = _logprobs(original, ids)
    assert float((_logprobs(result.model, ids) - ref).abs().max()) < 1e-9
    wrong = torch.cat([q[:, -1:], q[:, 1:-1], q[:, :1]], dim=1)
    moved = rotate_model(model, result.stream, wrong, d - 1, fraction=0.0, basis="pca")
    assert float((_logprobs(moved, ids) - ref).abs().max()) > 1e-3


def _plant_low_rank(model, rank, seed=0):
    """Project every tensor that writes the stream onto a random rank-``rank`` subspace of u⊥: the
    stream then lives in those directions only (the model stays a valid exact conversion)."""
    stream = stream_map(model)
    d = stream.hidden_size
    gen = torch.Generator().manual_seed(seed)
    u = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.cat([u, torch.randn(d, rank, generator=gen, dtype=torch.float64)], dim=1))
    p = basis[:, 1:]
    proj = p @ p.T
    state = model.state_dict()
    with torch.no_grad():
        for key, axis in stream.writes.items():
            t = state[key]
            t.copy_(contract(t.to(torch.float64), axis, proj).to(t.dtype))
    return model


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_a_low_rank_stream_slices_to_its_rank_without_loss(family):
    """A model whose stream lives in k directions: PCA finds them and slicing to k changes nothing;
    a random basis of the same width does not (the control)."""
    _, model = _converted(family, 0, torch.float64)
    d = model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.n_embd
    fraction = 0.25
    k = width_for(d, fraction, 8)
    _plant_low_rank(model, k)
    vocab = model.config.vocab_size
    ids = _probe(vocab)
    ref = _logprobs(model, ids)
    pca = slice_model(model, _batches(vocab), fraction)
    assert pca.width == k < d - 1
    assert pca.kept_energy_total > 1 - 1e-12
    assert float((_logprobs(pca.model, ids) - ref).abs().max()) < 1e-8
    rand = slice_model(model, _batches(vocab), fraction, basis="random", seed=3)  # the control
    assert rand.width == k
    assert rand.kept_energy_total < 0.95
    assert float((_logprobs(rand.model, ids) - ref).abs().max()) > 1e-2


def test_pca_basis_puts_the_ones_direction_last_and_orders_by_energy():
    d = 12
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, d, generator=gen, dtype=torch.float64) * torch.linspace(3, 0.1, d, dtype=torch.float64)
    x = x - x.mean(dim=1, keepdim=True)  # a centred stream
    q, values = pca_basis(x.T @ x)
    assert torch.allclose(q.T @ q, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(q[:, -1], torch.full((d,), 1 / math.sqrt(d), dtype=torch.float64), atol=1e-12)
    assert bool((values[:-1] >= values[1:]).all())
    energy = torch.einsum("ik,ij,jk->k", q, x.T @ x, q)
    assert bool((energy[:-2] >= energy[1:-1] - 1e-9).all())  # kept first, u (no energy) last
    assert float(energy[-1]) < 1e-9


@pytest.mark.parametrize("name", ["kjv-gpt2", "kjv-neox"])
def test_sliced_shipped_models_have_fewer_parameters_at_a_tenth(name):
    """At F = 0.1 the sliced model has fewer parameters than the LayerNorm original (the tied GPT-2
    keeps its tie: a head adapter of k² + k + 2·vocab, not an untied vocab × k head)."""
    import normswap
    from normswap.assets.models import model_path

    original = normswap.load_model(model_path(name))
    before = sum(p.numel() for p in original.parameters())
    model = copy.deepcopy(original)
    convert_model(model)
    result = slice_model(model, _batches(model.config.vocab_size, n=1), 0.1)
    assert result.parameters_after < before
    assert result.parameters_after == sum(p.numel() for p in result.model.parameters())
    if model.config.tie_word_embeddings:
        assert result.model.get_output_embeddings().weight is result.model.get_input_embeddings().weight
        # control: untying the head instead (what SliceGPT ships) would cost more than the original
        assert result.parameters_after + model.config.vocab_size * result.width > before


def test_refusals_are_one_line_before_any_work():
    original = tiny_model("gpt2").double()
    with pytest.raises(NormswapError, match="not a normswap conversion"):
        slice_model(original, _batches(256), 0.25)  # not converted
    _, model = _converted("gpt2", 0, torch.float64)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(NormswapError, match="--fraction"):
            slice_model(model, _batches(256), bad)
    with pytest.raises(NormswapError, match="--basis"):
        slice_model(model, _batches(256), 0.25, basis="eigen")
    approx = copy.deepcopy(original)
    convert_model(approx, mode="approx")
    with pytest.raises(NormswapError, match="exact conversion") as refused:
        slice_model(approx, _batches(256), 0.25)
    assert "\n" not in str(refused.value)


def test_per_layer_arm_is_exact_at_zero_and_counts_its_shortcuts():
    """SliceGPT-style per-layer rotations: exact at F = 0 through the shortcut hooks; the hooks are
    what makes it exact (control: the same model with them removed is not)."""
    original, model = _converted("gpt_neox", 0, torch.float64)
    result = slice_model(model, _batches(256), 0.0, basis="per-layer")
    ids = _probe(256)
    ref = _logprobs(original, ids)
    assert float((_logprobs(result.model, ids) - ref).abs().max()) < 1e-9
    k, layers = result.width, model.config.num_hidden_layers
    assert result.parameters_after == sum(p.numel() for p in result.model.parameters()) + (layers + 1) * k * k
    for module in result.model.modules():
        module._forward_pre_hooks.clear()  # the control: no shortcuts
    assert float((_logprobs(result.model, ids) - ref).abs().max()) > 1e-3
